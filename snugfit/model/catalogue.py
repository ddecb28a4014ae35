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
from snugfit.model.decoder import ModelConfig
from snugfit.model.hub import looks_like_hub_id, not_cached


def _gpt2(dim: int, layers: int, heads: int) -> ModelConfig:
    return ModelConfig(arch="gpt2", vocab_size=50257, dim=dim, n_layers=layers, n_heads=heads, max_seq_len=1024,
                       tie_embeddings=True)


def _llama(vocab, dim, layers, heads, kv, ffn, seq, theta=10000.0, eps=1e-5) -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv,
                       ffn_dim=ffn, max_seq_len=seq, rope_theta=theta, norm_eps=eps)


def _opt(dim: int, layers: int, heads: int, proj: int | None = None) -> dict:
    return {"model_type": "opt", "vocab_size": 50272, "hidden_size": dim, "num_hidden_layers": layers,
            "num_attention_heads": heads, "ffn_dim": 4 * dim, "max_position_embeddings": 2048,
            "word_embed_proj_dim": proj or dim, "do_layer_norm_before": proj is None, "tie_word_embeddings": True}


def _qwen(dim, layers, heads, kv, ffn, vocab, tied) -> dict:
    return {"model_type": "qwen2", "vocab_size": vocab, "hidden_size": dim, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": ffn,
            "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": tied}


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
}

ALIASES = {"gpt2-124m": "gpt2", "gpt2-355m": "gpt2-medium", "gpt2-774m": "gpt2-large", "gpt2-1.5b": "gpt2-xl",
           "llama-3.1-8b-instruct": "llama-3.1-8b", "mistral-7b-v0.1": "mistral-7b"}


def resolve_model(name_or_path: str) -> ModelConfig | dict:
    """A catalogue name, a config.json (or a directory holding one): built-in ModelConfig or HF config dict.

    A JSON file with an "arch" key is a built-in ModelConfig; otherwise it must be an HF config.
    """
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json":
        if not path.exists():
            raise SnugfitError(f"model config {path} does not exist")
        data = json.loads(path.read_text())
        return ModelConfig.from_dict(data) if "arch" in data else data
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
