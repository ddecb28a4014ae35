"""How one step's microbatches run on a rank: the `StepRunner` protocol the engine drives, the `StepContext` it hands
each runner for a step, and `Accumulate`, the runner without a pipeline. The pipeline's runners are runtime.pipeline
(torch's schedules) and runtime.bpipe; the schedules registry (plan.schedules) names which one a plan takes."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from snugfit.plan import Plan
from snugfit.report.trace import StepTrace
from snugfit.runtime.memory import MemoryTracker, local
from snugfit.runtime.microbatches import Microbatch
from snugfit.runtime.precision import CastOnce
from snugfit.runtime.sharding import requires_gradient_sync
from snugfit.runtime.tensor_parallel import vocab_parallel_loss


@dataclass(frozen=True)
class StepContext:
    """What a runner reads of the step it runs (the engine builds one per step; runners never hold the engine)."""

    device: torch.device
    # blocks until the previous step's queued updates (host offload's worker) have reached the parameters: a
    # runner whose stages never call the model (whose forward hooks wait for them) calls it before they run
    wait_updates: Callable[[], None]
    loss_scale: float = 1.0  # what the loss is multiplied by before backward (float16's scale; 1 otherwise)
    memory: MemoryTracker | None = None  # sampled at each phase of the step; None: its memory is not counted
    trace: StepTrace | None = None  # the step's spans, on the steps the trainer traces
    cast: CastOnce | None = None  # the compute copies of a model run unwrapped below fp32 (runtime.precision)

    def span(self, kind: str, mb: int = -1, stage: int = -1) -> AbstractContextManager:
        """Time one action into the trace, when the step is traced."""
        return self.trace.span(dist.get_rank(), kind, mb, stage) if self.trace is not None else nullcontext()

    def sample(self) -> None:
        """Let the memory tracker see what is held now (on the steps whose memory is counted)."""
        if self.memory is not None:
            self.memory.sample()

    def track_activations(self) -> AbstractContextManager:
        """Count what a forward saves for backward (on the steps whose memory is counted)."""
        return self.memory.track_activations() if self.memory is not None else nullcontext()


class StepRunner(Protocol):
    """How one step's microbatches run on this rank (the plan's schedule's runner, plan.schedules)."""

    stage_group: object  # the pipeline group whose ranks hold the model's other parts (None: this rank has all)
    units: tuple[nn.Module, ...]  # FSDP2 root units beside the model (pipeline stages), for the memory tracker

    def train(self, ctx: StepContext, micro: list[Microbatch],
              divisors: list[float]) -> torch.Tensor:
        """Forward and backward of every microbatch (gradients left in place); the step's loss on this rank."""

    def eval(self, ctx: StepContext, micro: list[Microbatch],
             divisors: list[float]) -> torch.Tensor:
        """The step's loss on this rank, forward only."""


class Accumulate:
    """No pipeline: each microbatch's forward and backward in turn, the gradients accumulated. FSDP2 reduces
    them in the last microbatch's backward only, or in every one where the plan says (`requires_gradient_sync`)."""

    stage_group = None
    units: tuple[nn.Module, ...] = ()

    def __init__(self, model: nn.Module, plan: Plan):
        self.model, self.plan = model, plan

    def train(self, ctx: StepContext, micro: list[Microbatch],
              divisors: list[float]) -> torch.Tensor:
        total = torch.zeros((), device=ctx.device)
        for i, (inputs, targets, docs) in enumerate(micro):
            last = i == len(micro) - 1
            if isinstance(self.model, FSDPModule):
                self.model.set_requires_gradient_sync(requires_gradient_sync(self.plan, last))
            elif ctx.cast is not None:
                ctx.cast.keep = not last  # the last backward drops each compute copy once used
            with vocab_parallel_loss(self.plan):
                with ctx.span("F", i), ctx.track_activations():
                    loss = local(self.model(inputs, targets, docs)) / divisors[i]
                ctx.sample()
                with ctx.span("B", i):
                    (loss * ctx.loss_scale).backward()
            total += loss.detach()
        ctx.sample()
        return total

    @torch.no_grad()
    def eval(self, ctx: StepContext, micro: list[Microbatch],
             divisors: list[float]) -> torch.Tensor:
        total = torch.zeros((), device=ctx.device)
        for (inputs, targets, docs), divisor in zip(micro, divisors):
            with vocab_parallel_loss(self.plan):
                total += local(self.model(inputs, targets, docs)).float() / divisor
        return total
