"""Expert parallelism: a Mixture-of-Experts block's E experts split over the ep ranks of an expert group, tokens sent
to their experts' ranks and back by all-to-all (as torchtitan's ExpertParallel).

    weights     rank r of the ep group keeps experts [r E/ep, (r+1) E/ep) of each 3-D expert weight, as a DTensor
                sharded on dim 0 over the ep mesh (`shard_experts`): its logical shape stays E x ..., so checkpoints
                (DCP) hold whole experts and resume under any ep; FSDP2 then shards each local slice over the
                ranks holding the same experts (runtime.mesh `expert_shard`, dp x cp / ep of them)
    dispatch    after routing, each rank's (token, slot) copies are sorted by expert, so expert group r's copies
                are one contiguous run: the per-expert counts are exchanged (all-to-all of E counts), then the
                copies themselves (all-to-all with uneven splits); what arrives is ordered by (source rank, local
                expert), regrouped by local expert for one grouped GEMM, put back and returned by the reverse
                all-to-all (`ExpertParallel`, the dispatcher model.moe.MoEMLP calls)
    gradients   the all-to-alls' backward is the reverse exchange, so each rank's local experts receive the
                gradients of every token routed to them in the ep group; FSDP2 reduces them over `expert_shard`
                and divides by all dp x cp ranks, as the dense weights' (runtime.sharding)
    norm        runtime.grad_norm sums squares over every mesh dimension that shards a gradient, ep included:
                each expert counted once

The router, its aux loss and the routing report run on each rank's own tokens before dispatch, unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from snugfit.model.moe import GroupedExperts, moe_layers


class ExpertParallel:
    """MoEMLP's dispatcher over an ep group: run `experts` (this rank's E/ep of them) on the copies of every rank of
    the group routed to them. Called as model.moe.LocalExperts is: (experts, x sorted by expert, counts per expert
    (E,)) -> the experts' outputs for x, in x's order."""

    def __init__(self, group, ep: int):
        self.group, self.ep = group, ep

    def __call__(self, experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep = self.ep
        local = counts.numel() // ep
        # got[j, i]: copies rank j of the group sends to my local expert i
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=self.group)
        send = counts.view(ep, local).sum(1).tolist()
        got = got.view(ep, local)
        recv = got.sum(1).tolist()
        arrived = _exchange(x, recv, send, self.group)  # ordered by (source rank, local expert)
        # regroup by local expert: a stable sort of each arrived copy's local expert index
        expert_of = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(ep), got.flatten())
        order = expert_of.argsort(stable=True)
        # one zero row more, the last expert's: a rank that receives no copy still runs its experts (a grouped
        # GEMM's backward over no rows fails), and the zero row adds nothing to their gradients
        offs = got.sum(0).cumsum(0) + (torch.arange(local, device=x.device) == local - 1)
        y = experts(torch.cat([arrived[order], arrived.new_zeros(1, x.shape[1])]), offs.to(torch.int32))[:-1]
        back = torch.empty_like(y).index_copy(0, order, y)  # y[order.argsort()], without a second sort
        return _exchange(back, send, recv, self.group)


def _exchange(t: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """All-to-all of t's rows: in_splits[i] rows to rank i, out_splits[j] from rank j; backward is the reverse."""
    return wait_tensor(all_to_all_single_autograd(t.contiguous(), out_splits, in_splits, group))


def shard_experts(part: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Keep this rank's E/ep experts of every MoE layer of `part` (a model or a pipeline stage, on the meta device
    or not) as DTensors sharded on dim 0 over `ep_mesh`, and make the layer dispatch through `ExpertParallel`."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for mlp in moe_layers(part):
        experts = mlp.experts
        for name, p in list(experts.named_parameters(recurse=False)):
            n = p.shape[0] // ep
            piece = p.detach()[rank * n:(rank + 1) * n].clone()
            held = DTensor.from_local(piece, ep_mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
            experts.register_parameter(name, nn.Parameter(held, requires_grad=p.requires_grad))
        mlp.dispatch = ExpertParallel(ep_mesh.get_group(), ep)

