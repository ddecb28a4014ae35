"""Hugging Face causal LMs in the shape snugfit's runtime drives: embed / blocks / norm / head.

`HFCausalLM` re-homes the modules of a transformers causal LM (no copy, no
reimplementation of any layer) under the built-in Decoder's structure:

    model.embed   token embedding (+ learned positions, projection, dropout as the arch has them)
    model.blocks  ModuleDict {"0": HFBlock, ...}; each HFBlock holds one HF decoder layer as `.layer`
    model.norm    final norm (Identity where the arch has none)
    model.head    lm_head (preceded by OPT's project_out where it exists)
    model.rope    the HF rotary embedding module, or None; the runtime passes it to every block

and calls each layer as the HF model does for a training batch without
padding: the attention mask of the layer's type from transformers' own mask
functions, which is none at all where SDPA's causal kernel is exact (full
attention), a window where the layer slides, and the additive mask eager
attention needs. What a CausalLM class does outside its modules is redone
here: Gemma 2's final logit soft-capping (`LogitSoftcap`). Parameter names
map back to the HF names by module identity (`hf_names`), which is what loading
and saving use (model.hf); nothing depends on a per-architecture name table of
snugfit's (a Mixture-of-Experts checkpoint's per-expert names come from
transformers' own conversion mapping: model.hf_layout).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from snugfit.errors import SnugfitError
from snugfit.model.decoder import Decoder, Documents, positions_from

log = logging.getLogger(__name__)


@dataclass
class HFInfo:
    """What the runtime reads from `model.cfg` (the same field names as the built-in ModelConfig)."""

    arch: str  # the HF model_type
    vocab_size: int
    dim: int  # hidden size between blocks
    n_layers: int
    max_seq_len: int  # the model's longest sequence
    tie_embeddings: bool


@dataclass
class HFStructure:
    """Where the pieces of an HF causal LM live, by role (the order embed -> layers -> norm -> head)."""

    tokens: nn.Embedding
    layers: list[nn.Module]
    head: nn.Module
    positions: nn.Embedding | None = None
    position_offset: int = 0  # OPT's learned positions start at index 2
    project_in: nn.Module | None = None
    drop: nn.Module | None = None
    norm: nn.Module | None = None
    project_out: nn.Module | None = None
    rotary: nn.Module | None = None


# Checked to match transformers' own forward exactly (tests/test_hf.py, one tiny random model each).
VERIFIED = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "opt", "phi3", "olmo2", "gemma", "gemma2", "gemma3_text",
            # Mixture-of-Experts (tests/test_hf_moe.py); the loss is the LM loss: the router's auxiliary loss,
            # which transformers adds only with output_router_logits, is not added
            "mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "gpt_oss", "deepseek_v3")
# Scale embeddings or logits outside their modules in ways the pieces below do not reproduce.
DIFFERENT = ("granite", "cohere")
SUPPORTED = ("supported: Llama, Mistral, Qwen2/3, Phi-3, OLMo2, Gemma 1-3 (text), GPT-2, OPT; MoE: Mixtral, Qwen2-MoE, "
             "Qwen3-MoE, OLMoE, gpt-oss, DeepSeek-V3")


def hf_structure(model: nn.Module) -> HFStructure:
    """Find the pieces of a Llama-family (Llama, Mistral, Qwen2, ...), GPT-2 or OPT causal LM."""
    kind = model.config.model_type
    if kind.startswith(DIFFERENT):
        raise SnugfitError(f"{type(model).__name__} is not supported yet; {SUPPORTED}")
    quantized = getattr(model.config, "quantization_config", None)
    if quantized:  # gpt-oss ships MXFP4 experts, DeepSeek-V3 FP8 blocks: weights snugfit's loader does not decode
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else type(quantized).__name__
        raise SnugfitError(f"{kind}: the checkpoint is quantized ({method}); snugfit reads unquantized weights: "
                           "save a bfloat16 copy first (transformers' from_pretrained with its quantization config's "
                           "dequantize=True, then save_pretrained) and pass that folder")
    found = _find_structure(model)
    if found is None:
        raise SnugfitError(f"don't know where the layers of {type(model).__name__} are; {SUPPORTED}")
    if kind not in VERIFIED:
        log.warning("%s: layers found by structure; equality with its own forward is verified only for %s",
                    type(model).__name__, ", ".join(VERIFIED))
    return found


def is_moe(model: nn.Module) -> bool:
    """Experts as transformers 5 holds them: 3-D parameters (E x out x in) in a module named experts."""
    return any(p.dim() == 3 and ".experts." in f".{n}" for n, p in model.named_parameters())


def _find_structure(model: nn.Module) -> HFStructure | None:
    head = model.get_output_embeddings()
    base = getattr(model, "model", None)
    if base is not None and all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm")):
        return HFStructure(tokens=base.embed_tokens, layers=list(base.layers), head=head, norm=base.norm,
                           rotary=getattr(base, "rotary_emb", None))
    if base is not None and hasattr(base, "decoder") and hasattr(base.decoder, "layers"):  # OPT
        dec = base.decoder
        return HFStructure(tokens=dec.embed_tokens, layers=list(dec.layers), head=head, positions=dec.embed_positions,
                           position_offset=getattr(dec.embed_positions, "offset", 0), project_in=dec.project_in,
                           norm=dec.final_layer_norm, project_out=dec.project_out)
    tr = getattr(model, "transformer", None)
    if tr is not None and hasattr(tr, "h"):  # GPT-2
        return HFStructure(tokens=tr.wte, layers=list(tr.h), head=head, positions=tr.wpe, drop=tr.drop, norm=tr.ln_f)
    return None


class HFEmbed(nn.Module):
    """tokens -> first hidden states, in the order the HF model computes them."""

    def __init__(self, s: HFStructure):
        super().__init__()
        self.tokens, self.positions, self.project_in, self.drop = s.tokens, s.positions, s.project_in, s.drop
        self.position_offset = s.position_offset

    def forward(self, tokens: torch.Tensor, start: int | torch.Tensor = 0) -> torch.Tensor:
        """start: the first token's position, or each token's (batch, seq) positions (packed documents)."""
        h = self.tokens(tokens)
        if self.project_in is not None:
            h = self.project_in(h)
        if self.positions is not None:
            learned = F.embedding(positions_from(start, tokens) + self.position_offset, self.positions.weight)
            h = h + (learned if learned.dim() == 3 else learned[None])
        return self.drop(h) if self.drop is not None else h


def layer_types(cfg, n_layers: int) -> list[str]:
    """Each layer's attention type as transformers names them: "sliding_attention" or "full_attention" (the
    config's own list where it has one, as Gemma 2/3 alternate; else every layer alike)."""
    types = getattr(cfg, "layer_types", None)
    if types:
        return list(types)[:n_layers]
    slides = getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True)
    return ["sliding_attention" if slides else "full_attention"] * n_layers


class HFBlock(nn.Module):
    """One HF decoder layer behind the runtime's block call `block(hidden, rope, docs)`.

    A wrapper rather than hooks because the runtime replaces `block.forward` for
    recomputation and activation offload, and those wrappers pass positional
    arguments only. The layer gets the mask of its type from transformers' mask functions (`mask`): None where
    SDPA's causal kernel is exact, so the fast path stays; `rope` is called with the layer's type where the rotary
    module keeps one table per type (Gemma 3's local and global bases).
    """

    def __init__(self, layer: nn.Module, hf_config, layer_type: str, typed_rope: bool):
        super().__init__()
        self.layer = layer
        self.layer_type, self.typed_rope = layer_type, typed_rope
        self._config = hf_config  # read by the mask functions: attention implementation, window
        # context parallelism (runtime.context_parallel.apply_cp): this rank holds chunk cp_rank of cp of each
        # sequence, so its positions start at cp_rank x its length, and attention's mask covers the whole sequence
        self.cp, self.cp_rank = 1, 0

    def mask(self, h: torch.Tensor, length: int, positions: torch.Tensor | None = None):
        """None where SDPA's causal kernel is exact (full attention, or a window the sequence fits in), asked of no
        mask function: theirs read tensors' values (torch.compile could not trace the block); else theirs.
        positions: packed documents' (batch, length), each restarting at 0, from which transformers' mask functions
        find the documents (masking_utils.find_packed_sequence_indices) and keep attention within each."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        slides = self.layer_type == "sliding_attention"
        window = getattr(self._config, "sliding_window", None) or 0
        if self._config._attn_implementation == "sdpa" and (not slides or length <= window) and positions is None:
            return None
        make = create_sliding_window_causal_mask if slides else create_causal_mask
        shaped = h if length == h.shape[1] else h[:, :1].expand(-1, length, -1)  # read for its shape and dtype only
        return make(config=self._config, inputs_embeds=shaped, attention_mask=None, cache=None,
                    position_ids=positions if positions is not None else torch.arange(length, device=h.device)[None])

    def forward(self, h: torch.Tensor, rope: nn.Module | None = None, docs: Documents | None = None) -> torch.Tensor:
        """docs: packed examples over the whole sequence: positions restart at each document (this cp rank's slice
        of them), and the mask keeps each document to itself."""
        start = self.cp_rank * h.shape[1]
        whole = docs.positions if docs is not None else None
        pos = (whole[:, start:start + h.shape[1]] if whole is not None
               else torch.arange(start, start + h.shape[1], device=h.device)[None])
        extra = {}
        if rope is not None:
            extra["position_embeddings"] = rope(h, pos, self.layer_type) if self.typed_rope else rope(h, pos)
        mask = self.mask(h, self.cp * h.shape[1], whole)  # over the whole sequence: under cp, attention sees all of it
        out = self.layer(h, attention_mask=mask, position_ids=pos, use_cache=False, **extra)
        return out[0] if isinstance(out, tuple) else out


class LogitSoftcap(nn.Module):
    """cap * tanh(logits / cap): Gemma 2's final logit soft-capping, which its CausalLM applies after lm_head."""

    def __init__(self, cap: float):
        super().__init__()
        self.cap = cap

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.tanh(logits / self.cap) * self.cap


def _module_names(root: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in root.named_modules(remove_duplicate=False)}


class HFCausalLM(nn.Module):
    """A transformers causal LM as embed / blocks / norm / head (see the module docstring).

    forward(tokens, targets=None) as the built-in Decoder: logits, or the mean
    cross-entropy (targets of -100 ignored); a pipeline stage without `embed`
    takes hidden states, one without `head` returns them.
    """

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        s = hf_structure(hf_model)
        cfg = hf_model.config
        self.hf_config = cfg
        self.embed: HFEmbed | None = HFEmbed(s)
        typed_rope = s.rotary is not None and "layer_type" in inspect.signature(s.rotary.forward).parameters
        self.blocks = nn.ModuleDict({str(i): HFBlock(layer, cfg, kind, typed_rope)
                                     for i, (layer, kind) in enumerate(zip(s.layers, layer_types(cfg, len(s.layers))))})
        self.norm: nn.Module | None = s.norm if s.norm is not None else nn.Identity()
        head = [s.project_out] * (s.project_out is not None) + [s.head]
        softcap = getattr(cfg, "final_logit_softcapping", None)
        head += [LogitSoftcap(softcap)] if softcap else []
        self.head: nn.Module | None = head[0] if len(head) == 1 else nn.Sequential(*head)
        self.rope = s.rotary
        self.cp_rank = 0  # as the built-in Decoder's: the embedding's learned positions start there
        self.cfg = HFInfo(arch=cfg.model_type, vocab_size=cfg.vocab_size, dim=cfg.hidden_size,
                          n_layers=len(s.layers), max_seq_len=cfg.max_position_embeddings,
                          tie_embeddings=s.head.weight is s.tokens.weight)
        hf_mods = _module_names(hf_model)
        self.hf_names: dict[str, str] = {}  # our parameter / persistent buffer name -> HF name
        for name, m in self.named_modules(remove_duplicate=False):
            if id(m) in hf_mods:
                prefix, ours = hf_mods[id(m)] + ".", name + "." if name else ""
                tensors = list(m.named_parameters(recurse=False)) + [
                    (n, b) for n, b in m.named_buffers(recurse=False) if n not in m._non_persistent_buffers_set]
                for leaf, _ in tensors:
                    self.hf_names[ours + leaf] = prefix + leaf
        self.hf_class = type(hf_model).__name__
        self.is_moe = is_moe(hf_model)
        self.base_prefix = hf_model.base_model_prefix
        self.head_weight = next(n for n, p in self.named_parameters(remove_duplicate=False)
                                if p is s.head.weight and n.startswith("head."))
        self.tokens_hf_name = self.hf_names["embed.tokens.weight"]

    # the built-in decoder's walk over the same pieces (embed, blocks, norm, head; pruned ones skipped)
    forward, placed = Decoder.forward, Decoder.placed

    @torch.no_grad()
    def reset_derived_buffers(self) -> None:
        """Refill the non-persistent buffers a checkpoint does not hold, after a meta-device model is allocated
        (`to_empty` leaves them as garbage): Gemma's embedding scale (transformers' own init sets it from
        `scalar_embed_scale` the same way). The rotary tables are rebuilt whole by the weights' filler."""
        for m in self.modules():
            if hasattr(m, "scalar_embed_scale") and isinstance(getattr(m, "embed_scale", None), torch.Tensor):
                m.embed_scale.fill_(m.scalar_embed_scale)

    def prune(self, blocks: set[int] | None = None, embed: bool = True, head: bool = True) -> None:
        """Keep only the given blocks (names stay stable) and pieces, as a pipeline stage does."""
        if blocks is not None:
            for name in [n for n in self.blocks if int(n) not in blocks]:
                del self.blocks[name]
        if not embed:
            self.embed = None
        if not head:
            self.norm = self.head = None
        present = {n for n, _ in self.named_parameters(remove_duplicate=False)} | {n for n, _ in self.named_buffers()}
        self.hf_names = {k: v for k, v in self.hf_names.items() if k in present}


# -- loading --
