"""Expert parallelism: a Mixture-of-Experts block's E experts split over the ep ranks of an expert group, tokens sent
to their experts' ranks and back by all-to-all (as torchtitan's ExpertParallel).

    weights     rank r of the ep group keeps experts [r E/ep, (r+1) E/ep) of each 3-D expert weight, as a DTensor
                sharded on dim 0 over the ep mesh (`shard_experts`): its logical shape stays E x ..., so checkpoints
                (DCP) hold whole experts and resume under any ep; FSDP2 then shards each local slice over the
                ranks holding the same experts (runtime.mesh `expert_shard`, dp x cp / ep of them); where LoRA
                adapts them (model.lora.LoRAExpertWeight), their frozen base and their adapters (A, B: E x ...)
                are split alike, so each rank trains its own experts' adapters
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
Hugging Face experts (transformers 5's fused 3-D experts of the models in plan.facts.EXPERT_PARALLEL_HF) are
run the same way: each experts module becomes a `DispatchedExperts` holding the same parameters under the same
names (so weights and checkpoints read alike), called as transformers calls it, with the tokens' top-k experts and
weights from the model's own router.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn.utils import parametrize

from snugfit.model.moe import GroupedExperts, grouped_mm, local, local_experts, moe_layers
from snugfit.plan.facts import EXPERT_PARALLEL_HF


class ExpertParallel:
    """MoEMLP's dispatcher over an ep group: run `experts` (this rank's E/ep of them) on the copies of every rank of
    the group routed to them. Called as model.moe.local_experts is: (experts, x sorted by expert, counts per expert
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
        y = experts(torch.cat([arrived[order], arrived.new_zeros(1, x.shape[1])]), offs.to(torch.int32))
        # back in arrival order: y[order.argsort()], the inverse permutation by a scatter rather than a second
        # sort; an index_select saves only its index for backward (index_copy kept y, a copy per block)
        unsort = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
        return _exchange(y.index_select(0, unsort), send, recv, self.group)


def _exchange(t: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """All-to-all of t's rows: in_splits[i] rows to rank i, out_splits[j] from rank j; backward is the reverse."""
    return wait_tensor(all_to_all_single_autograd(t.contiguous(), out_splits, in_splits, group))


class DispatchedExperts(nn.Module):
    """A Hugging Face experts module (gate_up_proj E x 2f x d, gate first; down_proj E x d x f; act_fn between),
    called as transformers calls it (tokens, their top-k experts, their weights), its tokens' copies sorted by
    expert and run through `dispatch` as model.moe.MoEMLP runs its own."""

    def __init__(self, experts: nn.Module, dispatch=local_experts):
        super().__init__()
        self.act_fn, self.n_experts, self.dispatch = experts.act_fn, experts.gate_up_proj.shape[0], dispatch
        for name in ("gate_up_proj", "down_proj"):
            if parametrize.is_parametrized(experts, name):  # LoRA (model.lora.LoRAExpertWeight): the same adapter
                adapted = experts.parametrizations[name]
                self.register_parameter(name, adapted.original)
                parametrize.register_parametrization(self, name, adapted[0], unsafe=True)
            else:
                self.register_parameter(name, getattr(experts, name))

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[-1]
        flat = top_k_index.flatten()
        counts = torch.bincount(flat, minlength=self.n_experts)
        order = flat.argsort(stable=True)
        y = self.dispatch(self._grouped, x[order // k], counts)
        y = y[order.argsort()].view(x.shape[0], k, -1)
        return (y * top_k_weights.to(y.dtype).unsqueeze(-1)).sum(dim=1).to(x.dtype)

    def _grouped(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """This rank's experts over x, sorted by expert (GroupedExperts' GEMMs with the model's activation)."""
        gate, up = grouped_mm(x, local(self.gate_up_proj).transpose(1, 2), offs).chunk(2, dim=-1)
        return grouped_mm(self.act_fn(gate) * up, local(self.down_proj).transpose(1, 2), offs)


def hf_experts(part: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, name) of each Hugging Face experts module of `part` that `DispatchedExperts` runs: fused 3-D
    experts of a model type plan.facts.EXPERT_PARALLEL_HF names."""
    holders = [part, *getattr(part, "blocks", {}).values()]  # a pipeline stage's config: its HF blocks' (HFBlock)
    config = next((c for m in holders if (c := getattr(m, "hf_config", None) or getattr(m, "_config", None))), None)
    if getattr(config, "model_type", None) not in EXPERT_PARALLEL_HF:
        return []
    return [(parent, name) for parent in part.modules() for name, m in parent.named_children()
            if name == "experts" and getattr(getattr(m, "gate_up_proj", None), "dim", lambda: 0)() == 3]


def shard_experts(part: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Keep this rank's E/ep experts of every MoE layer of `part` (a model or a pipeline stage, on the meta device
    or not) as DTensors sharded on dim 0 over `ep_mesh`, and make the layer dispatch through `ExpertParallel`."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    dispatch = ExpertParallel(ep_mesh.get_group(), ep)
    for parent, name in hf_experts(part):
        setattr(parent, name, DispatchedExperts(getattr(parent, name)))
    layers = [(m.experts, m) for m in moe_layers(part)] + [
        (m, m) for m in part.modules() if isinstance(m, DispatchedExperts)]
    for experts, caller in layers:
        # the weights, and where LoRA adapts them their frozen base and adapters (E x ... each): all split alike
        for owner in experts.modules():
            for pname, p in list(owner.named_parameters(recurse=False)):
                n = p.shape[0] // ep
                piece = p.detach()[rank * n:(rank + 1) * n].clone()
                held = DTensor.from_local(piece, ep_mesh, [Shard(0)], run_check=False, shape=p.shape,
                                          stride=p.stride())
                owner.register_parameter(pname, nn.Parameter(held, requires_grad=p.requires_grad))
        caller.dispatch = dispatch


def expert_modules(block: nn.Module) -> list[nn.Module]:
    """The experts modules of `block` that expert parallelism split: each its own FSDP2 unit (runtime.sharding)."""
    return [m.experts for m in moe_layers(block)] + [m for m in block.modules() if isinstance(m, DispatchedExperts)]
