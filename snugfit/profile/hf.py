"""Find the pieces of a Hugging Face causal LM: embedding, decoder layers, final norm, head.

Covers the Llama family (Llama, Mistral, Qwen2: model.embed_tokens / layers / norm,
lm_head), GPT-2 (transformer.wte, wpe / h / ln_f) and OPT (model.decoder.embed_tokens,
embed_positions, project_in / layers / final_layer_norm, project_out). The full HF
adapter (wrapping, pipeline splits) builds on hf_parts.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from snugfit.errors import SnugfitError
from snugfit.profile.record import ModelParts


def build_hf_meta(config: dict) -> nn.Module:
    """An HF causal LM from a config.json dict, on the meta device (no weights, no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    model_type = cfg.pop("model_type", None)
    if model_type is None:
        raise SnugfitError("HF config has no model_type; pass a config.json from a Hugging Face model")
    hf_cfg = AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if not k.startswith("_")})
    hf_cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_cfg)


def _present(*mods) -> list[nn.Module]:
    return [m for m in mods if m is not None]


def hf_parts(model: nn.Module) -> ModelParts:
    """Pieces of an HF causal LM; SnugfitError naming the structure when it is not one we know."""

    def loss(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return model(input_ids=tokens, labels=targets, use_cache=False).loss

    head = model.get_output_embeddings()
    base = getattr(model, "model", None)
    if base is not None and hasattr(base, "layers") and hasattr(base, "embed_tokens"):  # Llama, Mistral, Qwen2
        return ModelParts([base.embed_tokens], list(base.layers), _present(base.norm, head), loss)
    if base is not None and hasattr(base, "decoder") and hasattr(base.decoder, "layers"):  # OPT
        dec = base.decoder
        embed = _present(dec.embed_tokens, dec.embed_positions, getattr(dec, "project_in", None))
        last = _present(getattr(dec, "final_layer_norm", None), getattr(dec, "project_out", None), head)
        return ModelParts(embed, list(dec.layers), last, loss)
    tr = getattr(model, "transformer", None)
    if tr is not None and hasattr(tr, "h"):  # GPT-2
        return ModelParts(_present(tr.wte, getattr(tr, "wpe", None)), list(tr.h), _present(tr.ln_f, head), loss)
    raise SnugfitError(
        f"don't know where the layers of {type(model).__name__} are; supported: Llama, Mistral, Qwen2, GPT-2, OPT"
    )
