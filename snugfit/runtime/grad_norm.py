"""The global gradient norm the step clips by: over data-parallel shards, tensor-parallel pieces, expert-parallel
slices (runtime.expert_parallel: each rank of an ep group holds other experts, a mesh dimension that shards them
as tp's does, so each expert counts once), pipeline ranks and gradients held on host."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from snugfit.runtime.memory import local
from snugfit.runtime.tied_embeddings import is_head_copy


def shard_groups(p: torch.Tensor) -> tuple:
    """The process groups over which p's local pieces partition it (FSDP2's dp, tensor parallelism's tp: each
    mesh dimension that shards it), empty if this rank holds all of it."""
    if not isinstance(p, DTensor):
        return ()
    # not is_shard(): FSDP2 over a tensor-parallel weight shards it with _StridedShard, which is no Shard
    return tuple(p.device_mesh.get_group(dim) for dim, placement in enumerate(p.placements)
                 if not (placement.is_replicate() or placement.is_partial()) and p.device_mesh.size(dim) > 1)


def global_grad_norm(grads: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                     stage_group=None) -> torch.Tensor:
    """L2 norm over all (parameter, local gradient) pairs: shards are summed over their groups, replicas counted
    once.

    stage_group: pipeline ranks holding disjoint parts of the model; their squares add up too. A tied weight's
    copy in the head (runtime.tied_embeddings) is left out: its gradient equals the embedding's.

    Hand-written because torch's clip_grad_norm_ cannot mix DTensors of different
    meshes (zero 0 blocks live on a 2-D mesh, sharded ones on a 1-D mesh) and
    knows nothing of gradients held on host.
    """
    by_groups: dict[tuple, list[torch.Tensor]] = {}
    for p, g in grads:
        if is_head_copy(p):  # a tied weight's second copy: the embedding's counts it
            continue
        g = local(g)
        by_groups.setdefault((shard_groups(p), g.device, g.dtype), []).append(g)
    squares: dict[tuple, torch.Tensor] = {}
    for (groups, _, _), tensors in by_groups.items():  # one foreach kernel per kind, not four operators per tensor
        sq = torch.stack(torch._foreach_norm(tensors, 2.0, dtype=torch.float32)).square().sum().to(device)
        squares[groups] = squares[groups] + sq if groups in squares else sq
    total = torch.zeros((), device=device)
    for groups, sq in squares.items():
        for group in groups:  # a 2-D shard: sum over dp, then over tp
            dist.all_reduce(sq, group=group)
        total += sq
    if stage_group is not None:
        dist.all_reduce(total, group=stage_group)
    return total.sqrt()
