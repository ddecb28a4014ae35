"""The built-in decoder's Mixture-of-Experts MLP: a router, its top-k experts as 3-D weights run through grouped GEMM
over the tokens sorted by expert (dropless: no capacity factor), optional shared experts, and the load-balancing
auxiliary loss, whose gradient is added in backward (so it reaches the router in every execution path, pipelines
included, where only the last stage has the loss)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_reduce, wait_tensor
from torch.distributed.tensor import DTensor
from torch.nn.utils import parametrize


@torch.library.custom_op("snugfit::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm: a (M, K) rows in groups ending at offs with b (G, K, N) -> (M, N); or a (K, M), b (M, N)
    grouped along M -> (G, K, N) (the weights' gradient). Wrapped as an operator of our own because torch's meta
    kernel (so FakeTensorMode, which the profiler runs on) accepts only bfloat16, and CPU ranks plan in float32;
    its fake kernel gives the shapes in every dtype, and profile.record prices it as one grouped GEMM."""
    return torch._grouped_mm(a, b, offs=offs)


@grouped_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])


def _setup(ctx, inputs, output) -> None:
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)


def _backward(ctx, grad: torch.Tensor):
    a, b, offs = ctx.saved_tensors
    grad = grad.contiguous()  # an fp32 grouped GEMM fails on an expanded (stride-0) gradient (PLATFORM.md)
    return grouped_mm(grad, b.transpose(-2, -1), offs), grouped_mm(a.t(), grad, offs), None


grouped_mm.register_autograd(_backward, setup_context=_setup)


class GroupedExperts(nn.Module):
    """E SwiGLU experts as 3-D weights laid out as Linear's (out x in): gate_up_proj E x 2f x d, down_proj E x d x f."""

    def __init__(self, n_experts: int, dim: int, width: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * width, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, width))

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """x: tokens sorted by expert, expert e's ending at offs[e] (the experts this rank holds: all of them, or
        its slice under expert parallelism, whose weights are DTensors over the ep ranks)."""
        gate, up = self._project("gate_up_proj", x, offs).chunk(2, dim=-1)
        return self._project("down_proj", F.silu(gate) * up, offs)

    def _project(self, name: str, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """x through expert weight `name`; where LoRA adapts it (a parametrization, model.lora.LoRAExpertWeight),
        the frozen base and the adapter's low-rank path on the same sorted tokens rather than the merged weight,
        wherever grouped GEMM takes rank-wide rows (`low_rank`)."""
        adapted = self.parametrizations[name] if parametrize.is_parametrized(self, name) else None
        if adapted is not None and adapted[0].low_rank(x):
            return grouped_mm(x, local(adapted.original).transpose(1, 2), offs) + adapted[0].project(x, offs)
        return grouped_mm(x, local(getattr(self, name)).transpose(1, 2), offs)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's experts of `t`: a DTensor's local rows (expert parallelism splits experts and their adapters
    over the ep ranks), else t itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_experts(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """MoEMLP's default dispatch, every expert on this rank: (experts, x sorted by expert, the count of each
    expert's rows) -> the experts' outputs in x's order. runtime.expert_parallel.ExpertParallel is the other one."""
    return experts(x, counts.cumsum(0).to(torch.int32))


class _AddAuxGrad(torch.autograd.Function):
    """Identity on the MLP's output whose backward also gives the aux loss its gradient, `owner._aux_weight` (this
    microbatch's share of the step, as the LM loss's) times `owner._grad_scale` (float16's loss scale), and adds the
    aux value to `owner._aux_sum` for the run's report. As Megatron's MoEAuxLossAutoScaler: the gradient comes with
    the output's, so a pipeline stage needs no loss of its own; backward runs once per microbatch (a recomputed
    forward's graph is never backpropagated), so the report counts each microbatch once."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, owner: "MoEMLP") -> torch.Tensor:
        ctx.owner, ctx.aux, ctx.weight, ctx.scale = owner, aux.detach(), owner._aux_weight, owner._grad_scale
        ctx.recorded = owner._recorded
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        owner = ctx.owner
        value = ctx.aux * ctx.weight
        if ctx.recorded:
            owner._aux_sum = value if owner._aux_sum is None else owner._aux_sum + value
        return grad, torch.full_like(ctx.aux, ctx.weight * ctx.scale), None


class MoEMLP(nn.Module):
    """router (Linear dim -> E, no bias) -> softmax -> top-k, the top-k weights renormalised (Qwen3-MoE, Mixtral);
    the tokens' copies sorted by expert through `experts`, weighted and summed back; plus `shared` (a dense MLP)
    where given. aux_coef: each layer's share of router_aux_coef (the loss is the mean over layers of
    E * sum_e f_e * P_e, f_e the share of the routed (token, slot) pairs expert e got, P_e its mean router
    probability: 1 at balanced routing).

    balanced: route round-robin instead (token t's slot j to expert (t*k + j) % E): the profiler's switch, so what it
    records and times is the balanced routing the planner prices, whatever random or fake weights would route."""

    def __init__(self, dim: int, n_experts: int, top_k: int, width: int, aux_coef: float, shared: nn.Module | None):
        super().__init__()
        self.n_experts, self.top_k, self.aux_coef = n_experts, top_k, aux_coef
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(n_experts, dim, width)
        self.shared = shared
        self.dispatch = local_experts  # how the sorted copies reach their experts (runtime.expert_parallel)
        self.balanced = False
        self._aux_weight, self._grad_scale = 1.0, 1.0  # set per step by the engine (`begin_step`)
        self._aux_sum: torch.Tensor | None = None  # this step's aux loss so far (weighted), detached
        self._recorded = True  # False in forwards that are no microbatch (`unrecorded`)
        self._token_counts: torch.Tensor | None = None  # this step's (token, slot) pairs per expert, detached
        self.cp_group = None  # the group a microbatch's sequences are split over (runtime.context_parallel)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, d) -> (router probabilities T x E in fp32, chosen experts T x k, their renormalised weights)."""
        probs = self.router(x).float().softmax(dim=-1)
        t, k = x.shape[0], self.top_k
        if self.balanced:
            chosen = (torch.arange(t, device=x.device)[:, None] * k + torch.arange(k, device=x.device)) % self.n_experts
            weights = probs.gather(1, chosen)
        else:
            weights, chosen = probs.topk(k, dim=-1)
        return probs, chosen, weights / weights.sum(dim=-1, keepdim=True)

    def aux_loss(self, probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """aux_coef * E * sum_e f_e * P_e (counts: the (token, slot) pairs each expert got on this rank).

        Under context parallelism each cp rank routes an equal chunk of the microbatch's tokens: f_e is the whole
        microbatch's (the counts summed over `cp_group`), P_e this rank's mean, so the mean over the cp ranks is
        the microbatch's aux loss, and its gradient, averaged over dp x cp with the LM loss's, is the router's."""
        if self.cp_group is not None:
            counts = wait_tensor(all_reduce(counts, "sum", self.cp_group))
        share = counts.float() / counts.sum().clamp(min=1)
        return self.aux_coef * self.n_experts * (share * probs.mean(dim=0)).sum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs, chosen, weights = self.route(x)
        flat = chosen.flatten()
        counts = flat.new_zeros(self.n_experts).index_add_(0, flat, torch.ones_like(flat))
        if torch.is_grad_enabled() and self._recorded:  # a microbatch's training forward: the routing report's counts
            seen = counts.detach()
            self._token_counts = seen if self._token_counts is None else self._token_counts + seen
        order = flat.argsort(stable=True)
        # the dispatch buffer: each token's k copies, sorted by expert (tokens x top_k x dim)
        y = self.dispatch(self.experts, x[order // self.top_k], counts)
        y = y[order.argsort()].view(x.shape[0], self.top_k, -1)  # back in token order, then weighted and summed
        out = (y * weights.to(y.dtype).unsqueeze(-1)).sum(dim=1)
        if self.shared is not None:
            out = out + self.shared(x)
        if torch.is_grad_enabled() and self.aux_coef:
            out = _AddAuxGrad.apply(out, self.aux_loss(probs, counts), self)
        return out.view(shape)


def moe_layers(model: nn.Module) -> list[MoEMLP]:
    return [m for m in model.modules() if isinstance(m, MoEMLP)]


def begin_step(model: nn.Module, weight: float, grad_scale: float) -> None:
    """Before a step's microbatches: each one's aux loss weighs `weight` (1 / microbatches: the LM loss's divisor on
    token streams; every microbatch routes as many tokens), its gradient times `grad_scale` (float16's loss scale)."""
    for m in moe_layers(model):
        m._aux_weight, m._grad_scale, m._aux_sum, m._token_counts = weight, grad_scale, None, None


def step_token_counts(model: nn.Module) -> list[list[int]]:
    """Tokens (token, slot pairs) per expert this step, one list per MoE layer, summed over microbatches."""
    return [m._token_counts.tolist() for m in moe_layers(model) if m._token_counts is not None]


def step_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The aux loss this rank's layers added in the step (summed over its layers, weighted over microbatches)."""
    sums = [m._aux_sum for m in moe_layers(model) if m._aux_sum is not None]
    return torch.stack(sums).sum() if sums else None


@contextmanager
def unrecorded(module: nn.Module) -> Iterator[None]:
    """Forwards of `module` that are no microbatch: torch's pipeline stages infer their shapes with one, and
    backpropagate it for the gradients' shapes; its aux loss stays out of the step's report."""
    layers = moe_layers(module)
    for m in layers:
        m._recorded = False
    try:
        yield
    finally:
        for m in layers:
            m._recorded = True


def set_balanced(model: nn.Module, balanced: bool = True) -> None:
    """Route round-robin (the profiler's balanced routing) or by the router."""
    for m in moe_layers(model):
        m.balanced = balanced
