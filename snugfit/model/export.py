"""Model files: safetensors weights + config, loadable by snugfit and, for HF-compatible shapes, by transformers.

A folder holds model.safetensors, snugfit.json (the ModelConfig) and, when the
architecture has a Hugging Face twin (llama: LlamaForCausalLM; gpt2 with tied
embeddings and full attention heads: GPT2LMHeadModel), config.json with the
weights stored under Hugging Face's names. Loading never unpickles anything.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from snugfit.errors import SnugfitError
from snugfit.model.decoder import Decoder, ModelConfig

# built-in name pattern -> Hugging Face Llama name pattern
LLAMA_NAMES = [
    (r"embed\.tokens\.weight", "model.embed_tokens.weight"),
    (r"blocks\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blocks\.(\d+)\.mlp_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blocks\.(\d+)\.attn\.(q|k|v|o)\.weight", r"model.layers.\1.self_attn.\2_proj.weight"),
    (r"blocks\.(\d+)\.mlp\.(gate|up|down)\.weight", r"model.layers.\1.mlp.\2_proj.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"head\.weight", "lm_head.weight"),
]
LLAMA_NAMES_BACK = [
    (r"model\.embed_tokens\.weight", "embed.tokens.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"blocks.\1.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"blocks.\1.mlp_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.(q|k|v|o)_proj\.weight", r"blocks.\1.attn.\2.weight"),
    (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", r"blocks.\1.mlp.\2.weight"),
    (r"model\.norm\.weight", "norm.weight"),
    (r"lm_head\.weight", "head.weight"),
]


def hf_twin(cfg: ModelConfig) -> str | None:
    """The transformers class that computes exactly what this config computes, if any."""
    if cfg.arch == "llama":
        return "LlamaForCausalLM"
    if cfg.arch == "gpt2" and cfg.tie_embeddings and cfg.n_kv_heads == cfg.n_heads:
        return "GPT2LMHeadModel"
    return None


def hf_config(cfg: ModelConfig) -> dict:
    if cfg.arch == "llama":
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
            "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
            "hidden_act": "silu", "torch_dtype": "float32",
        }
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
        "n_embd": cfg.dim, "n_inner": cfg.ffn_dim, "n_layer": cfg.n_layers, "n_head": cfg.n_heads,
        "n_positions": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new",
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": True, "torch_dtype": "float32",
        "bos_token_id": None, "eos_token_id": None,
    }


def _rename(sd: dict[str, torch.Tensor], table: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in sd.items():
        for pattern, repl in table:
            if re.fullmatch(pattern, name):
                out[re.sub(pattern, repl, name)] = t
                break
        else:
            raise SnugfitError(f"no mapping for weight {name!r}; this model cannot be exported in that format")
    return out


def _gpt2_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """GPT-2 keeps fused q|k|v and stores Linear weights transposed (Conv1D)."""
    out = {"transformer.wte.weight": sd["embed.tokens.weight"], "transformer.wpe.weight": sd["embed.positions.weight"],
           "transformer.ln_f.weight": sd["norm.weight"], "transformer.ln_f.bias": sd["norm.bias"]}
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            out[h + theirs + ".weight"], out[h + theirs + ".bias"] = sd[b + ours + ".weight"], sd[b + ours + ".bias"]
        out[h + "attn.c_attn.weight"] = torch.cat([sd[b + f"attn.{x}.weight"] for x in "qkv"]).t().contiguous()
        out[h + "attn.c_attn.bias"] = torch.cat([sd[b + f"attn.{x}.bias"] for x in "qkv"])
        for ours, theirs in (("attn.o", "attn.c_proj"), ("mlp.up", "mlp.c_fc"), ("mlp.down", "mlp.c_proj")):
            out[h + theirs + ".weight"] = sd[b + ours + ".weight"].t().contiguous()
            out[h + theirs + ".bias"] = sd[b + ours + ".bias"]
    return out


def _gpt2_from_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {"embed.tokens.weight": sd["transformer.wte.weight"], "embed.positions.weight": sd["transformer.wpe.weight"],
           "norm.weight": sd["transformer.ln_f.weight"], "norm.bias": sd["transformer.ln_f.bias"]}
    for i in range(cfg.n_layers):
        b, h = f"blocks.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            out[b + ours + ".weight"], out[b + ours + ".bias"] = sd[h + theirs + ".weight"], sd[h + theirs + ".bias"]
        for x, w, bias in zip("qkv", sd[h + "attn.c_attn.weight"].t().chunk(3), sd[h + "attn.c_attn.bias"].chunk(3)):
            out[b + f"attn.{x}.weight"], out[b + f"attn.{x}.bias"] = w.contiguous(), bias.contiguous()
        for ours, theirs in (("attn.o", "attn.c_proj"), ("mlp.up", "mlp.c_fc"), ("mlp.down", "mlp.c_proj")):
            out[b + ours + ".weight"] = sd[h + theirs + ".weight"].t().contiguous()
            out[b + ours + ".bias"] = sd[h + theirs + ".bias"]
    out["head.weight"] = out["embed.tokens.weight"]
    return out


def save_model(model_sd: dict[str, torch.Tensor], cfg: ModelConfig, folder: Path) -> Path:
    """Write weights and configs; Hugging Face names when there is a twin, snugfit's otherwise."""
    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().cpu().contiguous() for k, v in model_sd.items()}
    twin = hf_twin(cfg)
    if twin == "LlamaForCausalLM":
        if cfg.tie_embeddings:
            sd.pop("head.weight", None)
        sd = _rename(sd, LLAMA_NAMES)
    elif twin == "GPT2LMHeadModel":
        sd = _gpt2_to_hf(sd, cfg)
    elif cfg.tie_embeddings:
        sd.pop("head.weight", None)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt", "names": twin or "snugfit"})
    (folder / "snugfit.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    if twin:
        (folder / "config.json").write_text(json.dumps(hf_config(cfg), indent=1))
    return folder


def load_model(folder: Path) -> Decoder:
    """A Decoder from a folder written by save_model."""
    meta, weights = folder / "snugfit.json", folder / "model.safetensors"
    if not meta.is_file() or not weights.is_file():
        raise SnugfitError(f"{folder} is not a snugfit model folder (needs snugfit.json and model.safetensors)")
    cfg = ModelConfig.from_dict(json.loads(meta.read_text()))
    sd = load_file(str(weights))
    twin = hf_twin(cfg)
    if twin == "LlamaForCausalLM":
        sd = _rename(sd, LLAMA_NAMES_BACK)
    elif twin == "GPT2LMHeadModel":
        sd = _gpt2_from_hf(sd, cfg)
    if cfg.tie_embeddings:
        sd.setdefault("head.weight", sd["embed.tokens.weight"])
    model = Decoder(cfg)
    model.load_state_dict(sd, strict=True)
    return model
