"""Where a Hugging Face model's tensors lie in its checkpoint: under the module's own name, or built from several
stored tensors, the way transformers 5 loads Mixture-of-Experts checkpoints.

transformers 5 keeps an MoE layer's experts as two 3-D parameters (`mlp.experts.gate_up_proj`: E x 2f x d,
`mlp.experts.down_proj`: E x d x f), while checkpoints on the hub, and what its own save_pretrained writes, hold one
matrix per expert (`mlp.experts.3.gate_proj.weight`; Mixtral's `block_sparse_moe.experts.3.w1.weight`). Its
conversion mapping (transformers.conversion_mapping) says, per architecture, which stored names rename and which
stack (MergeModulelist) and concatenate (Concatenate) into which parameter. That mapping is read here as data,
with transformers' own renaming function; the tensors are not converted by transformers' loader because it builds
each parameter whole, and snugfit fills ranks' shards (FSDP2, tensor parallel) by reading only their rows: a
`Stacked` parameter reads, of each stored matrix, the part that falls in the region asked for.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from snugfit.errors import SnugfitError


@dataclass
class Stacked:
    """A parameter made of stored tensors: `members[p]` the stored names matching source pattern p (one per
    expert, in expert order), stacked along `stack_dim`, the patterns then concatenated along `cat_dim`."""

    patterns: list[str]
    stack_dim: int
    cat_dim: int | None
    members: dict[str, list[str]] = field(default_factory=dict)

    def names(self) -> list[str]:
        return [n for p in self.patterns for n in self.members.get(p, [])]


Source = str | Stacked  # a stored name, or a parameter built from several


def _natural(name: str) -> list:
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name)]


def _ops(converter) -> tuple[int, int | None]:
    """(stack dim, concatenation dim or None) of a converter whose operations snugfit's region reader follows."""
    kinds = [type(op).__name__ for op in converter.operations]
    if kinds == ["MergeModulelist"] or kinds == ["MergeModulelist", "Concatenate"]:
        stack = converter.operations[0].dim
        cat = converter.operations[1].dim if len(kinds) == 2 else None
        if cat != stack:
            return stack, cat
    raise SnugfitError(f"the checkpoint's {converter.source_patterns} convert to {converter.target_patterns} by "
                       f"{kinds}; snugfit reads only per-expert tensors stacked (and concatenated): save the folder "
                       "with transformers' save_pretrained in its fused layout, or convert it first")


def conversions(hf_class: str, model_type: str) -> tuple[list, list]:
    """(renamings, converters) transformers applies when it loads a checkpoint of this class or model type."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    found = get_checkpoint_conversion_mapping(hf_class) or get_checkpoint_conversion_mapping(model_type) or []
    found += get_checkpoint_conversion_mapping("legacy") or []
    renamings = [t for t in found if not hasattr(t, "operations")]
    return renamings, [t for t in found if hasattr(t, "operations")]


def checkpoint_layout(stored: Iterable[str], hf_class: str, model_type: str) -> dict[str, Source]:
    """Model tensor name (as transformers' module names it) -> where its values are stored."""
    from transformers.core_model_loading import apply_renamings

    renamings, converters = conversions(hf_class, model_type)
    out: dict[str, Source] = {}
    for name in sorted(stored, key=_natural):
        renamed = apply_renamings(name, renamings) if renamings else name
        for conv in converters:
            target, pattern = conv.rename_source_key(renamed)
            if pattern is not None:
                stack, cat = _ops(conv)
                entry = out.setdefault(target, Stacked(list(conv.source_patterns), stack, cat))
                entry.members.setdefault(pattern, []).append(name)
                break
        else:
            out[renamed] = name
    return out


def read_region(source: Source, region: tuple[slice, ...], get_slice: Callable, shape: tuple[int, ...]
                ) -> torch.Tensor:
    """The `region` (a slice per dimension, steps of 1) of the model tensor of `shape` stored as `source`;
    `get_slice(name)` opens a stored tensor lazily (safetensors' get_slice)."""
    if isinstance(source, str):
        return get_slice(source)[region]
    s = source
    counts = {len(s.members.get(p, [])) for p in s.patterns}
    if counts != {shape[s.stack_dim]}:
        raise SnugfitError(f"the checkpoint holds {sorted(counts)} tensors for {s.patterns}, the model "
                           f"{shape[s.stack_dim]} experts; is config.json from the same model?")
    bounds = [(r.start or 0, shape[i] if r.stop is None else r.stop) for i, r in enumerate(region)]
    out = None
    offset = 0  # along cat_dim, where this pattern's part starts
    for p in s.patterns:
        first = get_slice(s.members[p][0])
        size = list(first.get_shape())
        size.insert(s.stack_dim, 1)
        for e, name in enumerate(s.members[p]):
            start = [0] * len(shape)
            start[s.stack_dim] = e
            if s.cat_dim is not None:
                start[s.cat_dim] = offset
            box = [(max(lo, a), min(hi, a + n)) for (lo, hi), a, n in zip(bounds, start, size)]
            if any(lo >= hi for lo, hi in box):
                continue
            src = tuple(slice(lo - a, hi - a) for (lo, hi), a, d in zip(box, start, range(len(shape)))
                        if d != s.stack_dim)
            part = (first if e == 0 else get_slice(name))[src].unsqueeze(s.stack_dim)
            if out is None:
                out = torch.empty([hi - lo for lo, hi in bounds], dtype=part.dtype)
            out[tuple(slice(lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(box, bounds))] = part
        offset += size[s.cat_dim] if s.cat_dim is not None else 0
    if out is None:  # an empty region (a rank holding no rows of it)
        return torch.empty([hi - lo for lo, hi in bounds])
    return out


def stored_shape(source: Source, get_slice: Callable) -> tuple[int, ...]:
    """The shape of the model tensor `source` builds (for the shape check against the config)."""
    if isinstance(source, str):
        return tuple(get_slice(source).get_shape())
    size = list(get_slice(source.members[source.patterns[0]][0]).get_shape())
    size.insert(source.stack_dim, len(source.members[source.patterns[0]]))
    if source.cat_dim is not None:
        size[source.cat_dim] = sum(get_slice(source.members[p][0]).get_shape()[source.cat_dim - (
            source.cat_dim > source.stack_dim)] for p in source.patterns)
    return tuple(size)


def as_transformers_saves(state: dict[str, torch.Tensor], hf_config, hf_class: str) -> dict[str, torch.Tensor]:
    """`state` (transformers' module names -> whole tensors) in the layout transformers' own save_pretrained writes:
    for MoE architectures one matrix per expert under the hub's names, which transformers 5 converts back as it
    loads and which tools that read hub checkpoints expect. Its own reversal (revert_weight_conversion) on a
    meta-device model of the config; architectures with no conversion are returned as they are."""
    if not _converts(hf_class, hf_config.model_type):
        return state
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf_config)
    out = revert_weight_conversion(meta, dict(state))
    # the reversal's chunks and unbinds are views of one tensor: safetensors stores each tensor on its own
    kept = {id(t) for t in state.values()}
    return {k: v if id(v) in kept else v.clone(memory_format=torch.contiguous_format) for k, v in out.items()}


def _converts(hf_class: str, model_type: str) -> bool:
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    return bool(get_checkpoint_conversion_mapping(hf_class) or get_checkpoint_conversion_mapping(model_type))
