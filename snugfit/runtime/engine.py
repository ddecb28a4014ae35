"""The step engine: runs one optimizer step of a (possibly parallelised) model.

The trainer only talks to an engine: `train_step`, `eval_loss`, `set_lr`, `state_dict`/`load_state_dict`.
How the model was parallelised (runtime.apply) is invisible to it; how a step's microbatches run is its
step runner's business, one per runner the schedules registry (plan.schedules) names: `Accumulate` (no
pipeline; runtime.step_runner), a torch pipeline schedule (runtime.pipeline) or BPipe (runtime.bpipe), each handed
the step's `StepContext`, never the engine. How units are updated is their updaters' (runtime.optimizer.Updater:
states on the device, host offload, streamed states), stepped after backward or, stepping in backward, by
runtime.step_in_backward. The engine keeps what every step needs: the microbatches and the loss's divisors
(runtime.microbatches), exact global-norm clipping over data-parallel and pipeline ranks (runtime.grad_norm), loss
scaling, checkpoints.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from snugfit.plan import Plan
from snugfit.plan.optimizer import describe
from snugfit.report.trace import StepTrace
from snugfit.model.moe import begin_step, moe_layers, step_aux_loss, step_token_counts
from snugfit.runtime.grad_norm import global_grad_norm
from snugfit.runtime.loss_scale import LossScale
from snugfit.runtime.memory import MemoryTracker
from snugfit.runtime.microbatches import loss_divisors, split_batch
from snugfit.runtime.offload import HostOffload
from snugfit.runtime.optimizer import DeviceUnits, OptimConfig, Updater, make_optimizer, optimizer_units
from snugfit.runtime.precision import CastOnce
from snugfit.runtime.step_in_backward import StepInBackward
from snugfit.runtime.step_runner import StepContext, StepRunner
from snugfit.runtime.stream_states import StreamedStates
from snugfit.runtime.tied_embeddings import TiedEmbeddings

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    loss: float  # mean over the step's target tokens (all microbatches, all data-parallel ranks)
    grad_norm: float  # global, before clipping
    skipped: bool  # non-finite loss or gradient: no update was made
    overflow: bool = False  # of which: fp16 gradients overflowed the loss scale (expected now and then)
    aux_loss: float | None = None  # Mixture-of-Experts routers' load-balancing loss (model.moe), apart from `loss`
    tokens_per_expert: list[list[int]] | None = None  # per MoE layer of this stage, summed over data parallel


class Engine:
    """One optimizer step: the runner's forward and backward of every microbatch, exact global-norm clipping, and
    every updater's step.

    model: this rank's model (its pipeline stages' part of it), as runtime.build parallelised it; runner: how the
    microbatches run (`StepRunner`); dp_group: data-parallel process group (None: one process); host: the
    partially offloaded units; cast: the compute copies of a model that runs unwrapped below fp32
    (runtime.precision). `memory` (a MemoryTracker) is sampled at each phase of a step; after `train_step`,
    `memory.peak()` is that step's peak by category.

    Each unit (a block, the root pieces) has its own optimizer (runtime.optimizer, as plan.optimizer says), so a
    unit can step on its own: after backward, clipped by the global gradient norm, or in backward
    (runtime.step_in_backward), clipped by its share of it; its updater is host offload's where the plan offloads
    it, streamed states' where its BlockPlan streams them (runtime.stream_states), else `DeviceUnits`.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        optim: OptimConfig,
        device: torch.device,
        runner: StepRunner,
        dp_group=None,
        host: HostOffload | None = None,
        cast: CastOnce | None = None,
        tied: TiedEmbeddings | None = None,
        cp_rank: int = 0,
    ):
        self.model, self.plan, self.optim_cfg, self.device = model, plan, optim, device
        self.runner, self.dp_group, self.host, self.cast, self.tied = runner, dp_group, host, cast, tied
        self.cp_rank = cp_rank  # which chunk of each sequence this rank takes (runtime.context_parallel)
        self.lr = optim.lr
        self.scaler = LossScale() if plan.compute_dtype == "float16" else None
        # Counting saved tensors costs a Python hook per tensor (~20% of a small model's step on CPU),
        # so the trainer turns it on only for the steps whose memory it reports.
        self.track_memory = True
        self.trace: StepTrace | None = None  # set by the trainer for the steps it draws
        self.updaters = self._updaters(host)
        self.memory = MemoryTracker(model, units=runner.units,
                                    not_saved=lambda: cast.storages if cast is not None else set())
        for updater in self.updaters:
            updater.track(self.memory)
        if cast is not None:
            self.memory.add_source(cast.memory)
        self.moe = bool(getattr(getattr(model, "cfg", None), "n_experts", 0)) or bool(moe_layers(model))
        self.in_backward = StepInBackward(self.updaters, plan.num_microbatches, optim.grad_clip, device,
                                          runner.stage_group) if plan.optimizer.in_backward else None
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.info("optimizer: %s", describe(plan.optimizer, optim.grad_clip > 0))

    def _updaters(self, host: HostOffload | None) -> list[Updater]:
        """Host offload's (first: its steps run on a worker thread while the device steps), the device units', the
        streamed units'."""
        if host is not None:
            host.attach(self.model, lambda masters: make_optimizer(masters, self.optim_cfg, self.plan.optimizer))
        units = optimizer_units(self.model, self.plan, self.optim_cfg, skip=host.owns if host else lambda p: False)
        streamed = [u for u in units if u.streamed]
        updaters: list[Updater] = [host] if host is not None else []
        updaters.append(DeviceUnits([u for u in units if not u.streamed], self.sample))
        if streamed:
            updaters.append(StreamedStates(streamed, self.device, self.sample))
        return updaters

    def sample(self) -> None:
        """Let the memory tracker see what is held now (on the steps whose memory is counted)."""
        if self.track_memory:
            self.memory.sample()

    def set_lr(self, lr: float) -> None:
        """The rate of the next step: each updater gets it with that step's work (host offload's previous step
        may still be waiting on its worker thread and must keep its rate)."""
        self.lr = lr

    @property
    def loss_scale(self) -> float:
        """What the loss is multiplied by before backward (1 but for float16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for u in self.updaters for o in u.optimizers()]

    def _wait_updates(self) -> None:
        """Block until every queued update has reached the parameters."""
        for u in self.updaters:
            u.wait()

    def _context(self) -> StepContext:
        """What the runner reads of this step (and the engine's own spans time into its trace)."""
        return StepContext(self.device, self._wait_updates, self.loss_scale,
                           self.memory if self.track_memory else None, self.trace, self.cast)

    def train_step(self, batch: torch.Tensor) -> StepResult:
        """One optimizer step over this rank's (num_microbatches x micro_batch_size) rows."""
        self.model.train()
        micro = split_batch(batch.to(self.device, non_blocking=True), self.plan, self.cp_rank)
        divisors = loss_divisors(batch, self.plan, self.dp_group, self.device, self.cp_rank)
        self.memory.reset_peak()
        if self.in_backward is not None:
            self.in_backward.begin(self.lr)
        if self.moe:  # each microbatch's aux loss weighs as the LM loss's on token streams
            begin_step(self.model, 1.0 / len(micro), self.loss_scale)
        loss = self.runner.train(self._context(), micro, divisors)
        if self.tied is not None:  # after backward, before the update: a tied weight's copies in two stages joined
            self.tied.sum_grads()
        if self.cast is not None:
            self.cast.release()  # the optimizer changes the masters; the next step casts them again
        return self._update(loss)

    def stage_stats(self) -> dict | None:
        """What this rank's pipeline stages held in the last step (runtime.pipeline), None without a pipeline."""
        stats = getattr(self.runner, "stage_stats", None)
        return stats() if stats else None

    def _update(self, loss: torch.Tensor) -> StepResult:
        """After the step's last backward: the loss averaged over dp; the gradients, final on this rank, clipped
        together and every updater stepped (stepping in backward: the units still to step)."""
        ctx = self._context()
        if self.dp_group is not None:
            with ctx.span("collective"):
                dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.dp_group)
        if self.in_backward is not None:
            grad_norm, skipped = self.in_backward.finish()
            skipped, overflow = skipped or not (math.isfinite(loss.item()) and math.isfinite(grad_norm)), False
        else:
            grad_norm, skipped, overflow = self._clip_and_step(loss, ctx)
        self.sample()  # the optimizer moment: gradients and states together
        self.model.zero_grad(set_to_none=True)
        self.sample()  # the next forward starts from here
        return StepResult(loss=loss.item(), grad_norm=grad_norm, skipped=skipped, overflow=overflow,
                          aux_loss=self._aux_loss(), tokens_per_expert=self._tokens_per_expert())

    def _tokens_per_expert(self) -> list[list[int]] | None:
        """The routing report's counts: this rank's MoE layers (its pipeline stage's), summed over data parallel."""
        counts = step_token_counts(self.model) if self.moe else []
        if not counts:
            return None
        total = torch.tensor(counts, device=self.device)
        if self.dp_group is not None:
            dist.all_reduce(total, group=self.dp_group)
        return total.tolist()

    def _aux_loss(self) -> float | None:
        """The step's router aux loss: this rank's layers' sum, summed over the pipeline's stages and averaged over
        data parallel, as the loss."""
        if not self.moe:
            return None
        aux = step_aux_loss(self.model)
        aux = torch.zeros((), device=self.device) if aux is None else aux.float()
        if self.runner.stage_group is not None:
            dist.all_reduce(aux, group=self.runner.stage_group)
        if self.dp_group is not None:
            dist.all_reduce(aux, op=dist.ReduceOp.AVG, group=self.dp_group)
        return aux.item()

    def _clip_and_step(self, loss: torch.Tensor, ctx: StepContext) -> tuple[float, bool, bool]:
        """Every updater's step, its gradients clipped by the global norm (unscaled from float16's loss scale); that
        norm, whether the step was skipped (a loss or gradient not finite) and whether for a float16 overflow."""
        scale = self.loss_scale
        grads = [pg for u in self.updaters for pg in u.grads()]
        grad_norm = global_grad_norm(grads, self.device, self.runner.stage_group) / scale
        skipped = not bool(torch.isfinite(loss) and torch.isfinite(grad_norm))
        overflow = skipped and self.scaler is not None and bool(torch.isfinite(loss))
        if self.scaler is not None:
            self.scaler.update(overflow)
        clip = self.optim_cfg.grad_clip
        # Same factor as torch.nn.utils.clip_grad_norm_, so a one-process run reproduces it; unscaling folds in.
        coef = (min(clip / (grad_norm.item() + 1e-6), 1.0) if clip > 0 and not skipped else 1.0) / scale
        with ctx.span("optimizer"):
            for u in self.updaters:  # host offload's first: it runs on a worker thread while the device steps
                u.step(coef, skipped, self.lr)
        return grad_norm.item(), skipped, overflow

    @torch.no_grad()
    def eval_loss(self, batch: torch.Tensor) -> float:
        """Mean loss over the target tokens of the batch on every data-parallel rank, as the training loss."""
        self.model.eval()
        micro = split_batch(batch.to(self.device), self.plan, self.cp_rank)
        ctx = StepContext(self.device, self._wait_updates)
        total = self.runner.eval(ctx, micro, loss_divisors(batch, self.plan, self.dp_group, self.device, self.cp_rank))
        if self.dp_group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.AVG, group=self.dp_group)
        return total.item()

    # -- checkpoints --
    def state_dict(self) -> dict:
        """Model and optimizer keyed by parameter name (FQN), so DCP reshards them under another plan.

        Offloaded units contribute their masters (not the compute copies). Optimizer states are fp32, whatever
        the optimizer keeps (runtime.optimizer.saved_state), so a checkpoint loads under another world size or
        optimizer setup.
        """
        self._wait_updates()
        model_sd = get_model_state_dict(self.model)
        states = {}
        for u in self.updaters:
            states.update(u.state_dict(model_sd))
        if self.tied is not None:
            states = self.tied.saved_states(states)
        return {"model": model_sd, "optimizer": {"state": states}}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        model_sd, saved = dict(state["model"]), state["optimizer"]["state"]
        if self.tied is not None:
            saved = self.tied.states_to_load(saved)
        self._wait_updates()
        set_model_state_dict(self.model, model_sd)
        for u in self.updaters:
            u.load_state_dict(model_sd, saved)
