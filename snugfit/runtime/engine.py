"""The step engine: runs one optimizer step of a (possibly parallelised) model.

The trainer only talks to an engine: `train_step`, `eval_loss`, `set_lr`,
`state_dict`/`load_state_dict`. How the model was parallelised (see
`runtime.apply`) is invisible to it, except for three things a data-parallel
step needs: switching gradient sync off for all but the last microbatch (which a plan reducing every
microbatch keeps on: runtime.sharding.reduce_every_microbatch), the
data-parallel group (target counts, loss averaging, gradient-norm reduction), and the host
optimizer of partially offloaded units (`runtime.offload`).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from snugfit.data.instruct import IGNORE
from snugfit.plan import Plan, PlanError
from snugfit.report.trace import StepTrace
from snugfit.runtime.memory import MemoryTracker, local
from snugfit.runtime.offload import HostOffload
from snugfit.runtime.precision import CastOnce
from snugfit.runtime.tensor_parallel import vocab_parallel_loss


@dataclass
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping


@dataclass
class StepResult:
    loss: float  # mean over the step's target tokens (all microbatches, all data-parallel ranks)
    grad_norm: float  # global, before clipping
    skipped: bool  # non-finite loss or gradient: no update was made
    overflow: bool = False  # of which: fp16 gradients overflowed the loss scale (expected now and then)


class LossScale:
    """Dynamic loss scaling for float16: multiply the loss before backward so small gradients survive fp16,
    halve the scale when gradients overflow (the step is skipped), double it after `growth_interval` clean steps.

    Hand-written rather than torch.amp.GradScaler: that one unscales and checks for infinities per optimizer
    and device, while here gradients live in FSDP2 shards, on other pipeline stages and on the host (offloaded
    optimizer units). The engine already reduces one global gradient norm over all of them; its being finite
    is the overflow check, and the scale folds into the clipping factor.
    """

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000):
        self.scale, self.growth_interval, self.clean_steps = scale, growth_interval, 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale, self.clean_steps = self.scale / 2, 0
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale, self.clean_steps = self.scale * 2, 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])


def param_groups(params: list[torch.Tensor], weight_decay: float) -> list[dict]:
    """Decay matrices, not norms, biases or anything 1-D."""
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def make_adamw(params: list[torch.Tensor], cfg: OptimConfig) -> torch.optim.AdamW:
    """Fused AdamW where the device supports it (CPU included: 5x faster than the default here)."""
    groups = [g for g in param_groups(params, cfg.weight_decay) if g["params"]]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)


def split_batch(batch: torch.Tensor, plan: Plan) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batch -> [(inputs, targets)] per microbatch.

    2-D (rows, seq+1): a token stream, targets are the inputs shifted by one.
    3-D (rows, 2, seq+1): instruction data, row 0 tokens and row 1 targets
    (-100 where no loss is taken, e.g. the prompt), shifted the same way.
    """
    rows, cols = plan.num_microbatches * plan.micro_batch_size, plan.seq_len + 1
    expected = (rows, cols) if batch.dim() != 3 else (rows, 2, cols)
    if tuple(batch.shape) != expected:
        raise PlanError(
            f"batch of shape {tuple(batch.shape)} does not fit the plan: each rank needs "
            f"(num_microbatches x micro_batch_size, seq_len + 1) = ({rows}, {cols}), "
            f"or ({rows}, 2, {cols}) for (tokens, targets) pairs"
        )
    tokens, labels = (batch, batch) if batch.dim() == 2 else (batch[:, 0], batch[:, 1])
    inputs, targets = tokens[:, :-1], labels[:, 1:]
    return list(zip(inputs.split(plan.micro_batch_size), targets.split(plan.micro_batch_size)))


def loss_divisors(batch: torch.Tensor, plan: Plan, dp_group=None, device: torch.device | None = None) -> list[float]:
    """What each microbatch's mean loss is divided by, so that the step loss is the mean over every target token
    of the global batch, however the tokens fall into microbatches and ranks.

    Summed over microbatches and averaged over dp ranks (as FSDP2 averages gradients),
    mean_i / d_i with d_i = (targets in the global batch) / (dp x targets in microbatch i)
    is (sum of token losses) / (targets in the global batch). Every position of a token
    stream is a target, so there d_i is exactly num_microbatches, as it always was, and
    nothing is counted; instruction data (prompts and padding masked) gathers its count
    over dp. A microbatch without targets has no mean (NaN): the step is skipped.
    """
    m = plan.num_microbatches
    if batch.dim() == 2:
        return [float(m)] * m
    counts = (batch[:, 1, 1:] != IGNORE).reshape(m, -1).sum(1)
    total = counts.sum().to(device)
    if dp_group is not None:
        dist.all_reduce(total, group=dp_group)
    return [total.item() / (plan.dp * max(c, 1)) for c in counts.tolist()]


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

    stage_group: pipeline ranks holding disjoint parts of the model; their squares add up too.

    Hand-written because torch's clip_grad_norm_ cannot mix DTensors of different
    meshes (zero 0 blocks live on a 2-D mesh, sharded ones on a 1-D mesh) and
    knows nothing of gradients held on host.
    """
    by_groups: dict[tuple, list[torch.Tensor]] = {}
    for p, g in grads:
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


class Engine:
    """Gradient accumulation over microbatches, exact global-norm clipping, AdamW on device and host.

    model: as `runtime.apply.apply_plan` returned it; dp_group: data-parallel
    process group (None: one process); host: the partially offloaded units;
    stage_group: the pipeline group when `model` is one pipeline rank's part;
    units: FSDP2 root units outside `model` (its pipeline stages), for the memory tracker; cast: the compute
    copies of a model that runs unwrapped below fp32 (runtime.precision).
    `memory` (a MemoryTracker) is sampled at each phase of a step; after
    `train_step`, `memory.peak()` is that step's peak by category.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        optim: OptimConfig,
        device: torch.device,
        dp_group=None,
        host: HostOffload | None = None,
        stage_group=None,
        units: tuple[nn.Module, ...] = (),
        cast: CastOnce | None = None,
    ):
        self.model, self.plan, self.optim_cfg, self.device = model, plan, optim, device
        self.dp_group, self.host, self.stage_group = dp_group, host, stage_group
        self.cast = cast  # the compute copies of a model that runs unwrapped below fp32 (runtime.precision)
        self.lr = optim.lr
        self.scaler = LossScale() if plan.compute_dtype == "float16" else None
        if host is not None:
            host.attach(model, lambda masters: make_adamw(masters, optim))
        device_params = [p for p in model.parameters() if p.requires_grad and not (host and host.owns(p))]
        # None when every unit is offloaded (torch refuses an optimizer without parameters).
        self.optimizer = make_adamw(device_params, optim) if device_params else None
        sources = [host.memory] if host is not None else []
        sources += [cast.memory] if cast is not None else []
        self.memory = MemoryTracker(model, [self.optimizer] if self.optimizer else [], sources, units,
                                    not_saved=lambda: cast.storages if cast is not None else set())
        # Counting saved tensors costs a Python hook per tensor (~20% of a small model's step on CPU),
        # so the trainer turns it on only for the steps whose memory it reports.
        self.track_memory = True
        self.trace: StepTrace | None = None  # set by the trainer for the steps it draws

    def _sample(self) -> None:
        if self.track_memory:
            self.memory.sample()

    def _span(self, kind: str, mb: int = -1):
        """Time one action into the trace, when a step is being traced."""
        return self.trace.span(dist.get_rank(), kind, mb) if self.trace is not None else nullcontext()

    def set_lr(self, lr: float) -> None:
        """The rate of the next step. Host optimizers get it with that step's queued work, not here: the
        previous step's host updates may still be waiting on the worker thread and must keep their rate."""
        self.lr = lr
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr

    @property
    def loss_scale(self) -> float:
        """What the loss is multiplied by before backward (1 but for float16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        hosted = [u.optimizer for u in self.host.units] if self.host is not None else []
        return [opt for opt in (self.optimizer, *hosted) if opt is not None]

    def train_step(self, batch: torch.Tensor) -> StepResult:
        """One optimizer step over this rank's (num_microbatches x micro_batch_size) rows."""
        self.model.train()
        micro = split_batch(batch.to(self.device, non_blocking=True), self.plan)
        divisors = loss_divisors(batch, self.plan, self.dp_group, self.device)
        total = torch.zeros((), device=self.device)
        self.memory.reset_peak()
        for i, (inputs, targets) in enumerate(micro):
            # reduce gradients once, after the last microbatch (or every microbatch: sharding.reduce_every_microbatch)
            if isinstance(self.model, FSDPModule):
                self.model.set_requires_gradient_sync(i == len(micro) - 1)
            elif self.cast is not None:
                self.cast.keep = i < len(micro) - 1  # the last backward drops each compute copy once used
            with vocab_parallel_loss(self.plan):
                with self._span("F", i), self.memory.track_activations() if self.track_memory else nullcontext():
                    loss = local(self.model(inputs, targets)) / divisors[i]
                self._sample()
                with self._span("B", i):
                    (loss * self.loss_scale).backward()
            total += loss.detach()
        self._sample()
        if self.cast is not None:
            self.cast.release()  # the optimizer changes the masters; the next step casts them again
        return self._update(total)

    def _update(self, loss: torch.Tensor) -> StepResult:
        if self.dp_group is not None:
            with self._span("collective"):
                dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.dp_group)
        device_grads = [(p, p.grad) for p in self.model.parameters() if p.grad is not None]
        host_grads = self.host.host_grads() if self.host is not None else []
        scale = self.loss_scale
        grad_norm = global_grad_norm(device_grads + host_grads, self.device, self.stage_group) / scale
        skipped = not bool(torch.isfinite(loss) and torch.isfinite(grad_norm))
        overflow = skipped and self.scaler is not None and bool(torch.isfinite(loss))
        if self.scaler is not None:
            self.scaler.update(overflow)
        clip = self.optim_cfg.grad_clip
        # Same factor as torch.nn.utils.clip_grad_norm_, so a one-process run reproduces it; unscaling folds in.
        coef = (min(clip / (grad_norm.item() + 1e-6), 1.0) if clip > 0 and not skipped else 1.0) / scale
        if self.host is not None:
            self.host.step(coef, skipped, self.lr)  # runs on a worker thread while the device steps
        if not skipped and self.optimizer is not None:
            with self._span("optimizer"):
                if coef != 1.0:
                    torch._foreach_mul_([local(g) for _, g in device_grads], coef)
                self.optimizer.step()
        self._sample()  # the optimizer moment: gradients and states together
        self.model.zero_grad(set_to_none=True)
        self._sample()  # the next forward starts from here
        return StepResult(loss=loss.item(), grad_norm=grad_norm.item(), skipped=skipped, overflow=overflow)

    @torch.no_grad()
    def eval_loss(self, batch: torch.Tensor) -> float:
        """Mean loss over the target tokens of the batch on every data-parallel rank, as the training loss."""
        self.model.eval()
        micro = split_batch(batch.to(self.device), self.plan)
        total = torch.zeros((), device=self.device)
        for (inputs, targets), divisor in zip(micro, loss_divisors(batch, self.plan, self.dp_group, self.device)):
            with vocab_parallel_loss(self.plan):
                total += local(self.model(inputs, targets)).float() / divisor
        if self.dp_group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.AVG, group=self.dp_group)
        return total.item()

    def state_dict(self) -> dict:
        """Model and optimizer keyed by parameter name (FQN), so DCP reshards them under another plan.

        Offloaded units contribute their fp32 masters (not the compute copies)
        and host AdamW states, in the same FQN-keyed layout.
        """
        model_sd, optim_sd = get_state_dict(self.model, [self.optimizer] if self.optimizer else [])
        optim_sd = optim_sd or {"state": {}, "param_groups": []}
        if self.host is not None:
            self.host.wait()
            merge_host_state(self.host, model_sd, optim_sd)
        return {"model": model_sd, "optimizer": optim_sd}

    def load_state_dict(self, state: dict) -> None:
        model_sd, optim_sd = dict(state["model"]), dict(state["optimizer"])
        if self.host is not None:
            self.host.wait()
            split_host_state(self.host, model_sd, optim_sd)
        if self.optimizer is None:
            set_model_state_dict(self.model, model_sd)
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def _as_dtensor_like(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride()) if isinstance(p, DTensor) else t


def merge_host_state(host: HostOffload, model_sd: dict, optim_sd: dict) -> None:
    """Put host masters and AdamW states into the FQN-keyed state dicts (sharing host storage).

    Param groups are merged by hyperparameters and ordered decay-first, as
    `make_adamw` orders them, so the layout does not depend on what is offloaded:
    DCP matches param groups by position when another plan loads the checkpoint.
    """
    groups: dict[str, dict] = {}

    def add(hyper: dict, names: list[str]) -> None:
        groups.setdefault(repr(sorted(hyper.items())), {**hyper, "params": []})["params"].extend(names)

    for g in optim_sd["param_groups"]:
        add({k: v for k, v in g.items() if k != "params"}, list(g["params"]))
    for name, p, master, opt in host.named_masters():
        model_sd[name] = _as_dtensor_like(master.detach(), p)
        optim_sd["state"][name] = {k: _as_dtensor_like(v, p) if v.dim() else v for k, v in opt.state[master].items()}
        group = next(g for g in opt.param_groups if any(m is master for m in g["params"]))
        add({k: v for k, v in group.items() if k != "params"}, [name])
    optim_sd["param_groups"] = sorted(groups.values(), key=lambda g: -g["weight_decay"])


def split_host_state(host: HostOffload, model_sd: dict, optim_sd: dict) -> None:
    """Load the host entries of the state dicts into the host masters and states; drop them from the optimizer's."""
    optim_sd["state"] = dict(optim_sd["state"])
    hosted = set()
    with torch.no_grad():
        for name, p, master, opt in host.named_masters():
            hosted.add(name)
            master.copy_(local(model_sd[name]))  # left in model_sd too: the model's strict load wants every key
            local(p).copy_(master)
            saved = optim_sd["state"].pop(name, None)
            if saved:
                opt.state[master] = {k: local(v).clone() for k, v in saved.items()}
    groups = [{**g, "params": [n for n in g["params"] if n not in hosted]} for g in optim_sd["param_groups"]]
    optim_sd["param_groups"] = [g for g in groups if g["params"]]
