"""The step engine: runs one optimizer step of a (possibly parallelised) model.

The trainer only talks to an engine: `train_step`, `eval_loss`, `set_lr`, `state_dict`/`load_state_dict`.
How the model was parallelised (runtime.apply) is invisible to it; how a step's microbatches run is its
step runner's business, one per runner the schedules registry (plan.schedules) names: `Accumulate` (no
pipeline: each microbatch's forward and backward in turn, FSDP2's gradient sync off for all but the last, or
on for every one where the plan reduces every microbatch: runtime.sharding.reduce_every_microbatch;
runtime.step_runner), a torch pipeline schedule (runtime.pipeline) or BPipe (runtime.bpipe). The engine keeps
what every step needs: the microbatches and the loss's divisors (runtime.microbatches), exact global-norm
clipping over data-parallel and pipeline ranks (runtime.grad_norm), each unit's optimizer on device
(runtime.optimizer builds them) and the host optimizer of partially offloaded units (`runtime.offload`), loss
scaling, checkpoints.
"""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from snugfit.plan import Plan
from snugfit.plan.optimizer import describe
from snugfit.report.trace import StepTrace
from snugfit.runtime.grad_norm import global_grad_norm
from snugfit.runtime.loss_scale import LossScale
from snugfit.runtime.memory import MemoryTracker, local
from snugfit.runtime.microbatches import loss_divisors, split_batch
from snugfit.runtime.offload import HostOffload
from snugfit.runtime.optimizer import (
    OptimConfig, OptimUnit, load_state, make_optimizer, optimizer_units, saved_state, set_lr,
)
from snugfit.runtime.precision import CastOnce
from snugfit.runtime.step_in_backward import StepInBackward
from snugfit.runtime.step_runner import Accumulate, StepRunner
from snugfit.runtime.stream_states import StreamedStates
from snugfit.runtime.tied_embeddings import TiedEmbeddings, saved_name

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    loss: float  # mean over the step's target tokens (all microbatches, all data-parallel ranks)
    grad_norm: float  # global, before clipping
    skipped: bool  # non-finite loss or gradient: no update was made
    overflow: bool = False  # of which: fp16 gradients overflowed the loss scale (expected now and then)


class Engine:
    """One optimizer step: the runner's forward and backward of every microbatch, exact global-norm clipping,
    AdamW on device and host.

    model: this rank's model (its pipeline stages' part of it), as runtime.build parallelised it; runner: how the
    microbatches run (`StepRunner`; default `Accumulate`); dp_group: data-parallel process group (None: one
    process); host: the partially offloaded units; cast: the compute copies of a model that runs unwrapped below
    fp32 (runtime.precision). `memory` (a MemoryTracker) is sampled at each phase of a step;
    after `train_step`, `memory.peak()` is that step's peak by category.

    Each unit (a block, the root pieces) has its own optimizer (runtime.optimizer, as plan.optimizer says), so a
    unit can step on its own: after backward, clipped by the global gradient norm, or in backward
    (runtime.step_in_backward), clipped by its share of it; with its states streamed from host
    (runtime.stream_states) where its BlockPlan says.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        optim: OptimConfig,
        device: torch.device,
        runner: StepRunner | None = None,
        dp_group=None,
        host: HostOffload | None = None,
        cast: CastOnce | None = None,
        tied: TiedEmbeddings | None = None,
    ):
        self.model, self.plan, self.optim_cfg, self.device = model, plan, optim, device
        self.runner = runner or Accumulate(model)
        self.dp_group, self.host, self.stage_group = dp_group, host, self.runner.stage_group
        self.cast, self.tied = cast, tied
        units = self.runner.units
        self.lr = optim.lr
        self.scaler = LossScale() if plan.compute_dtype == "float16" else None
        if host is not None:
            host.attach(model, lambda masters: make_optimizer(masters, optim, plan.optimizer))
        self.units: list[OptimUnit] = optimizer_units(model, plan, optim, skip=lambda p: host and host.owns(p))
        self.streamed = StreamedStates(self.units, device) if any(u.streamed for u in self.units) else None
        sources = [x.memory for x in (host, self.streamed) if x is not None]
        sources += [cast.memory] if cast is not None else []
        self.memory = MemoryTracker(model, [u.optimizer for u in self.units], sources, units,
                                    not_saved=lambda: cast.storages if cast is not None else set())
        self.in_backward = None
        if plan.optimizer.in_backward:
            groups = {u.name: u.params for u in self.units}
            groups.update({("host", i): u.params for i, u in enumerate(host.units)} if host is not None else {})
            self.in_backward = StepInBackward(groups, plan.num_microbatches, self._unit_ready)
            self._elements = self._trainable_elements()
        self._unit_named = {u.name: u for u in self.units}
        self._step_state = (0.0, False)  # stepping in backward: the squared norms so far, and whether a unit skipped
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.info("optimizer: %s", describe(plan.optimizer, optim.grad_clip > 0))
        # Counting saved tensors costs a Python hook per tensor (~20% of a small model's step on CPU),
        # so the trainer turns it on only for the steps whose memory it reports.
        self.track_memory = True
        self.trace: StepTrace | None = None  # set by the trainer for the steps it draws

    def sample(self) -> None:
        """Let the memory tracker see what is held now (on the steps whose memory is counted)."""
        if self.track_memory:
            self.memory.sample()

    def span(self, kind: str, mb: int = -1, stage: int = -1):
        """Time one action into the trace, when a step is being traced."""
        return self.trace.span(dist.get_rank(), kind, mb, stage) if self.trace is not None else nullcontext()

    def set_lr(self, lr: float) -> None:
        """The rate of the next step. Host optimizers get it with that step's queued work, not here: the
        previous step's host updates may still be waiting on the worker thread and must keep their rate."""
        self.lr = lr
        for u in self.units:
            set_lr(u.optimizer, lr)

    @property
    def loss_scale(self) -> float:
        """What the loss is multiplied by before backward (1 but for float16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        hosted = [u.optimizer for u in self.host.units] if self.host is not None else []
        return [u.optimizer for u in self.units] + hosted

    def train_step(self, batch: torch.Tensor) -> StepResult:
        """One optimizer step over this rank's (num_microbatches x micro_batch_size) rows."""
        self.model.train()
        micro = split_batch(batch.to(self.device, non_blocking=True), self.plan)
        divisors = loss_divisors(batch, self.plan, self.dp_group, self.device)
        self.memory.reset_peak()
        self._begin()
        loss = self.runner.train(self, micro, divisors)
        if self.tied is not None:
            self.tied.sum_grads()  # a tied weight's copies in the first and last pipeline stages
        if self.cast is not None:
            self.cast.release()  # the optimizer changes the masters; the next step casts them again
        return self._update(loss)

    def stage_stats(self) -> dict | None:
        """What this rank's pipeline stages held in the last step (runtime.pipeline), None without a pipeline."""
        stats = getattr(self.runner, "stage_stats", None)
        return stats() if stats else None

    def _begin(self) -> None:
        """A step begins: stepping in backward, no unit has stepped yet."""
        if self.in_backward is not None:
            self.in_backward.begin()
            self._step_state = (0.0, False)

    # -- the update --
    def _update(self, loss: torch.Tensor) -> StepResult:
        if self.dp_group is not None:
            with self.span("collective"):
                dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.dp_group)
        if self.in_backward is not None:
            return self._finish_in_backward(loss)
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
        if not skipped and self.units:
            with self.span("optimizer"):
                if coef != 1.0:
                    torch._foreach_mul_([local(g) for _, g in device_grads], coef)
                for u in self.units:
                    self._step_unit(u)
        self.sample()  # the optimizer moment: gradients and states together
        self.model.zero_grad(set_to_none=True)
        self.sample()  # the next forward starts from here
        return StepResult(loss=loss.item(), grad_norm=grad_norm.item(), skipped=skipped, overflow=overflow)

    def _step_unit(self, u: OptimUnit) -> None:
        """One unit's update, its states streamed in and out where they live on host."""
        if u.streamed:
            self.streamed.load(u)
        u.optimizer.step()
        self.sample()  # a unit's update: streamed states on the device
        if u.streamed:
            self.streamed.offload(u)

    # -- stepping in backward --
    def _trainable_elements(self) -> int:
        """Trainable elements of the whole model (every pipeline stage's): what each unit's clipping share is of."""
        params = [p for u in self.units for p in u.params] + (
            [p for u in self.host.units for p in u.params] if self.host is not None else [])
        total = torch.tensor(float(sum(p.numel() for p in params)), device=self.device)
        if self.stage_group is not None:
            dist.all_reduce(total, group=self.stage_group)
        return int(total.item())

    @torch.no_grad()
    def _unit_ready(self, key) -> None:
        """A unit's gradient is final (runtime.step_in_backward): clip it by its share of the threshold, step it,
        free its gradient. A share of sqrt(its elements / all) keeps the norm of the whole update within the
        threshold, as global-norm clipping would; a unit whose gradient is not finite does not step."""
        hosted = isinstance(key, tuple)
        u = self.host.units[key[1]] if hosted else self._unit_named[key]
        grads = self.host.unit_grads(u) if hosted else u.grads()
        norm = global_grad_norm(grads, self.device).item()
        squares, skipped = self._step_state
        finite = math.isfinite(norm)
        self._step_state = (squares + norm**2 if finite else math.inf, skipped or not finite)
        clip = self.optim_cfg.grad_clip
        bound = clip * math.sqrt(sum(p.numel() for p, _ in grads) / self._elements)
        coef = min(bound / (norm + 1e-6), 1.0) if clip > 0 and finite else 1.0
        if hosted:
            self.host.submit(u, coef, not finite, self.lr)
            return
        if finite:
            if coef != 1.0:
                torch._foreach_mul_([local(g) for _, g in grads], coef)
            self._step_unit(u)
        for p in u.params:
            p.grad = None

    def _finish_in_backward(self, loss: torch.Tensor) -> StepResult:
        self.in_backward.finish()
        squares, skipped = self._step_state
        total = torch.tensor(squares, device=self.device)
        if self.stage_group is not None:
            dist.all_reduce(total, group=self.stage_group)
        grad_norm = total.sqrt().item()
        skipped = skipped or not (math.isfinite(loss.item()) and math.isfinite(grad_norm))
        self.sample()
        self.model.zero_grad(set_to_none=True)
        self.sample()
        return StepResult(loss=loss.item(), grad_norm=grad_norm, skipped=skipped)

    @torch.no_grad()
    def eval_loss(self, batch: torch.Tensor) -> float:
        """Mean loss over the target tokens of the batch on every data-parallel rank, as the training loss."""
        self.model.eval()
        micro = split_batch(batch.to(self.device), self.plan)
        total = self.runner.eval(self, micro, loss_divisors(batch, self.plan, self.dp_group, self.device))
        if self.dp_group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.AVG, group=self.dp_group)
        return total.item()

    # -- checkpoints --
    def _state_owners(self):
        """(name, parameter, the tensor keying its states, optimizer, streamed unit or None) of every trainable
        parameter this rank updates: device units' parameters, host offload's masters. A tied weight's copies
        share one name (runtime.tied_embeddings.saved_name)."""
        for u in self.units:
            for name, p in zip(u.names, u.params):
                yield saved_name(name, p), p, p, u.optimizer, u if u.streamed else None
        if self.host is not None:
            for name, p, master, opt in self.host.named_masters():
                yield saved_name(name, p), p, master, opt, None

    def state_dict(self) -> dict:
        """Model and optimizer keyed by parameter name (FQN), so DCP reshards them under another plan.

        Offloaded units contribute their masters (not the compute copies). Optimizer states are fp32, whatever
        the optimizer keeps (runtime.optimizer.saved_state), so a checkpoint loads under another world size or
        optimizer setup.
        """
        model_sd = get_model_state_dict(self.model)
        states = {}
        if self.host is not None:
            self.host.wait()
        for name, p, key, opt, streamed in self._state_owners():
            if key is not p:  # a host master
                model_sd[name] = _as_dtensor_like(key.detach(), p)
            if streamed is not None:
                self.streamed.load(streamed)
            states[name] = saved_state(opt.state[key], p, copy=streamed is not None)
            if streamed is not None:
                self.streamed.offload(streamed)
        return {"model": model_sd, "optimizer": {"state": states}}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        model_sd, saved = dict(state["model"]), state["optimizer"]["state"]
        if self.host is not None:
            self.host.wait()
        set_model_state_dict(self.model, model_sd)
        for name, p, key, opt, streamed in self._state_owners():
            if key is not p:  # a host master: the model's entry holds it, and its device copy follows
                key.copy_(local(model_sd[name]))
                local(p).copy_(key)
            if name not in saved:
                continue
            if streamed is not None:
                self.streamed.load(streamed)
            load_state(opt.state[key], saved[name])
            if streamed is not None:
                self.streamed.offload(streamed)


def _as_dtensor_like(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride()) if isinstance(p, DTensor) else t
