"""Real architectures as config data, so plans can be made for models nobody downloaded.

Where the built-in decoder expresses a model exactly (same parameters, same FLOPs)
the entry is a ModelConfig (GPT-2, Llama-2/3, Mistral). The others (OPT: ReLU,
offset positions, project_in/out; Qwen2.5: q/k/v biases) stay Hugging Face
config.json dicts, profiled through transformers on the meta device.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from snugfit.errors import SnugfitError
from snugfit.model.config import ModelConfig
from snugfit.model.hub import looks_like_hub_id, not_cached


def _gpt2(dim: int, layers: int, heads: int) -> ModelConfig:
    return ModelConfig(arch="gpt2", vocab_size=50257, dim=dim, n_layers=layers, n_heads=heads, max_seq_len=1024,
                       tie_embeddings=True)


def _llama(vocab, dim, layers, heads, kv, ffn, seq, theta=10000.0, eps=1e-5, tied=False) -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv,
                       ffn_dim=ffn, max_seq_len=seq, rope_theta=theta, norm_eps=eps, tie_embeddings=tied)


def _opt(dim: int, layers: int, heads: int, proj: int | None = None) -> dict:
    return {"model_type": "opt", "vocab_size": 50272, "hidden_size": dim, "num_hidden_layers": layers,
            "num_attention_heads": heads, "ffn_dim": 4 * dim, "max_position_embeddings": 2048,
            "word_embed_proj_dim": proj or dim, "do_layer_norm_before": proj is None, "tie_word_embeddings": True}


def _qwen(dim, layers, heads, kv, ffn, vocab, tied) -> dict:
    return {"model_type": "qwen2", "vocab_size": vocab, "hidden_size": dim, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": ffn,
            "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": tied}


def _qwen3(dim, layers, heads, ffn, tied) -> dict:
    return {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": dim, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": ffn,
            "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": tied}


def _gemma2(dim, layers, heads, kv, ffn, head_dim, scalar) -> dict:
    return {"model_type": "gemma2", "vocab_size": 256000, "hidden_size": dim, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim, "intermediate_size": ffn,
            "query_pre_attn_scalar": scalar, "max_position_embeddings": 8192, "sliding_window": 4096,
            "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}


def _gemma3(dim, layers, heads, kv, ffn, head_dim, vocab, seq, window) -> dict:
    return {"model_type": "gemma3_text", "vocab_size": vocab, "hidden_size": dim, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim, "intermediate_size": ffn,
            "query_pre_attn_scalar": head_dim, "max_position_embeddings": seq, "sliding_window": window}


def _phi3(dim, layers, heads, kv, ffn, vocab, seq) -> dict:
    return {"model_type": "phi3", "vocab_size": vocab, "hidden_size": dim, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": ffn,
            "max_position_embeddings": seq, "original_max_position_embeddings": seq, "pad_token_id": 0}


def _moe(vocab, dim, layers, heads, kv, experts, top_k, width, seq, theta) -> ModelConfig:
    """A Mixture-of-Experts decoder the built-in one expresses (Mixtral exactly; OLMoE but for its q/k norms' 4k
    weights a layer)."""
    return ModelConfig(arch="llama", vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv,
                       n_experts=experts, top_k=top_k, moe_ffn_dim=width, max_seq_len=seq, rope_theta=theta)


MODELS: dict[str, ModelConfig | dict] = {
    "gpt2": _gpt2(768, 12, 12),
    "gpt2-medium": _gpt2(1024, 24, 16),
    "gpt2-large": _gpt2(1280, 36, 20),
    "gpt2-xl": _gpt2(1600, 48, 25),
    "opt-125m": _opt(768, 12, 12),
    "opt-350m": _opt(1024, 24, 16, proj=512),
    "opt-1.3b": _opt(2048, 24, 32),
    "opt-2.7b": _opt(2560, 32, 32),
    "opt-6.7b": _opt(4096, 32, 32),
    "opt-13b": _opt(5120, 40, 40),
    "opt-30b": _opt(7168, 48, 56),
    "opt-66b": _opt(9216, 64, 72),
    "llama-2-7b": _llama(32000, 4096, 32, 32, 32, 11008, 4096),
    "llama-2-13b": _llama(32000, 5120, 40, 40, 40, 13824, 4096),
    "llama-2-70b": _llama(32000, 8192, 80, 64, 8, 28672, 4096),
    "llama-3-8b": _llama(128256, 4096, 32, 32, 8, 14336, 8192, 500000.0),
    "llama-3-70b": _llama(128256, 8192, 80, 64, 8, 28672, 8192, 500000.0),
    "llama-3.1-8b": _llama(128256, 4096, 32, 32, 8, 14336, 131072, 500000.0),
    "llama-3.1-70b": _llama(128256, 8192, 80, 64, 8, 28672, 131072, 500000.0),
    "mistral-7b": _llama(32000, 4096, 32, 32, 8, 14336, 32768),
    "qwen2.5-0.5b": _qwen(896, 24, 14, 2, 4864, 151936, True),
    "qwen2.5-1.5b": _qwen(1536, 28, 12, 2, 8960, 151936, True),
    "qwen2.5-3b": _qwen(2048, 36, 16, 2, 11008, 151936, True),
    "qwen2.5-7b": _qwen(3584, 28, 28, 4, 18944, 152064, False),
    "qwen2.5-14b": _qwen(5120, 48, 40, 8, 13824, 152064, False),
    "qwen2.5-32b": _qwen(5120, 64, 40, 8, 27648, 152064, False),
    "qwen2.5-72b": _qwen(8192, 80, 64, 8, 29568, 152064, False),
    "llama-3.2-1b": _llama(128256, 2048, 16, 32, 8, 8192, 131072, 500000.0, tied=True),
    "llama-3.2-3b": _llama(128256, 3072, 28, 24, 8, 8192, 131072, 500000.0, tied=True),
    "qwen3-0.6b": _qwen3(1024, 28, 16, 3072, True),
    "qwen3-1.7b": _qwen3(2048, 28, 16, 6144, True),
    "qwen3-4b": _qwen3(2560, 36, 32, 9728, True),
    "qwen3-8b": _qwen3(4096, 36, 32, 12288, False),
    "qwen3-14b": _qwen3(5120, 40, 40, 17408, False),
    "qwen3-32b": _qwen3(5120, 64, 64, 25600, False),
    "gemma-2-2b": _gemma2(2304, 26, 8, 4, 9216, 256, 256),
    "gemma-2-9b": _gemma2(3584, 42, 16, 8, 14336, 256, 256),
    "gemma-2-27b": _gemma2(4608, 46, 32, 16, 36864, 128, 144),
    "gemma-3-1b": _gemma3(1152, 26, 4, 1, 6912, 256, 262144, 32768, 512),
    "gemma-3-4b": _gemma3(2560, 34, 8, 4, 10240, 256, 262208, 131072, 1024),
    "gemma-3-12b": _gemma3(3840, 48, 16, 8, 15360, 256, 262208, 131072, 1024),
    "gemma-3-27b": _gemma3(5376, 62, 32, 16, 21504, 128, 262208, 131072, 1024),
    "phi-3-mini": _phi3(3072, 32, 32, 32, 8192, 32064, 4096),
    "phi-4": _phi3(5120, 40, 40, 10, 17920, 100352, 16384),
    "mixtral-8x7b": _moe(32000, 4096, 32, 32, 8, 8, 2, 14336, 32768, 1e6),
    "olmoe-1b-7b": _moe(50304, 2048, 16, 16, 16, 64, 8, 1024, 4096, 10000.0),
    # head_dim 128 at 32 heads (q wider than the hidden size), q/k norms: transformers' own modules
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                      "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                      "tie_word_embeddings": False},
    "gpt-oss-20b": {"model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "num_hidden_layers": 24,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880,
                    "num_local_experts": 32, "num_experts_per_tok": 4, "max_position_embeddings": 131072,
                    "sliding_window": 128, "tie_word_embeddings": False},
}

ALIASES = {"gpt2-124m": "gpt2", "gpt2-355m": "gpt2-medium", "gpt2-774m": "gpt2-large", "gpt2-1.5b": "gpt2-xl",
           "llama-3.1-8b-instruct": "llama-3.1-8b", "mistral-7b-v0.1": "mistral-7b",
           "phi-3-mini-4k-instruct": "phi-3-mini", "gemma-2-9b-it": "gemma-2-9b", "gemma-3-1b-it": "gemma-3-1b"}


def resolve_model(name_or_path: str, attention: str = "sdpa") -> ModelConfig | dict:
    """A catalogue name, a config.json (or a directory holding one): built-in ModelConfig or HF config dict.

    A JSON file with an "arch" key is a built-in ModelConfig; otherwise it must be an HF config, which carries
    `attention` (model.attention) as transformers' "attn_implementation" where it is not the default sdpa.
    """
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json":
        if not path.exists():
            raise SnugfitError(f"model config {path} does not exist")
        data = json.loads(path.read_text())
        if "arch" in data:
            return ModelConfig.from_dict(data)
        return {**data, "attn_implementation": attention} if attention != "sdpa" else data
    key = name_or_path.lower().split("/")[-1]
    key = ALIASES.get(key, key)
    if key in MODELS:
        entry = MODELS[key]
        return ModelConfig.from_dict(entry.to_dict()) if isinstance(entry, ModelConfig) else dict(entry)
    close = difflib.get_close_matches(key, [*MODELS, *ALIASES], n=3, cutoff=0.5)
    if looks_like_hub_id(name_or_path):
        raise SnugfitError(f"{not_cached(name_or_path)}; or name a catalogue model "
                           f"({', '.join(close) if close else ', '.join(MODELS)})")
    hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(MODELS)}"
    raise SnugfitError(f"unknown model {name_or_path!r}; {hint} (or pass a config.json path)")


def block_count(model: ModelConfig | dict) -> int:
    """The model's blocks: ModelConfig.n_layers, or a Hugging Face config's own field for them (GPT-2's n_layer)."""
    if isinstance(model, ModelConfig):
        return model.n_layers
    found = next((model[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if model.get(k)), None)
    if found is None:
        raise SnugfitError("the model's config.json names no layer count (num_hidden_layers or n_layer); pass a "
                           "Hugging Face model's own config.json")
    return int(found)
