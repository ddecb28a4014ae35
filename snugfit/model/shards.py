"""How FSDP2 lays a whole tensor out over ranks, for code that fills or copies shards by hand: loading NF4
weights (model.hf), host offload's fp32 masters (runtime.offload)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_shard(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full` laid out as DTensor `p` is (FSDP2 shards with torch.chunk)."""
    t = full
    if isinstance(p, DTensor):
        for mesh_dim, placement in enumerate(p.placements):
            if placement.is_shard():
                n, r = p.device_mesh.size(mesh_dim), p.device_mesh.get_local_rank(mesh_dim)
                chunks = torch.chunk(t, n, dim=placement.dim)
                t = chunks[r] if r < len(chunks) else t.narrow(placement.dim, 0, 0)
    held = p.to_local() if isinstance(p, DTensor) else p
    if t.shape != held.shape:
        raise RuntimeError(f"host shard {tuple(t.shape)} does not match device shard {tuple(held.shape)}")
    return t
