"""How FSDP2 and tensor parallelism lay a whole tensor out over ranks, for code that fills shards by hand:
reading weights into a model built on the meta device (model.hf, the built-in init), host offload's fp32
masters (runtime.offload)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from snugfit.model.quantize import copy_nf4, is_quantized, quantize


def local_region(p: torch.Tensor) -> tuple[slice, ...]:
    """The slices of the whole tensor that `p` (a DTensor, or a plain tensor: all of it) holds on this rank.
    DTensor's own layout rule, so 2-D shards (FSDP2's _StridedShard over tensor parallelism) come out right."""
    if not isinstance(p, DTensor):
        return tuple(slice(0, n) for n in p.shape)
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def local_shard(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full` laid out as `p` is."""
    t = full[local_region(p)]
    held = p.to_local() if isinstance(p, DTensor) else p
    if t.shape != held.shape:
        raise RuntimeError(f"host shard {tuple(t.shape)} does not match device shard {tuple(held.shape)}")
    return t


def write_whole(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of the whole tensor `full` into `target` (plain, DTensor, or NF4: quantized whole,
    as QLoRA quantizes, then split as FSDP2 splits NF4 weights, by rows)."""
    if is_quantized(target):
        held = getattr(target, "_local_tensor", target)  # the NF4 object itself: to_local() returns a fresh alias
        whole = quantize(full, like=held)
        if isinstance(target, DTensor):
            dim0 = next(i for i, pl in enumerate(target.placements) if pl.is_shard())
            n, r = target.device_mesh.size(dim0), target.device_mesh.get_local_rank(dim0)
            whole = torch.chunk(whole, n)[r]
        copy_nf4(held, whole)
        return
    held = target.to_local() if isinstance(target, DTensor) else target
    held.copy_(local_shard(full, target))
