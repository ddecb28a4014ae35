"""How one step's microbatches run on a rank: the `StepRunner` protocol the engine drives, and `Accumulate`,
the runner without a pipeline. The pipeline's runners are runtime.pipeline (torch's schedules) and
runtime.bpipe; the schedules registry (plan.schedules) names which one a plan takes."""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from snugfit.runtime.memory import local
from snugfit.runtime.tensor_parallel import vocab_parallel_loss

if TYPE_CHECKING:
    from snugfit.runtime.engine import Engine


class StepRunner(Protocol):
    """How one step's microbatches run on this rank (the plan's schedule's runner, plan.schedules)."""

    stage_group: object  # the pipeline group whose ranks hold the model's other parts (None: this rank has all)
    units: tuple[nn.Module, ...]  # FSDP2 root units beside the model (pipeline stages), for the memory tracker

    def train(self, engine: "Engine", micro: list[tuple[torch.Tensor, torch.Tensor]],
              divisors: list[float]) -> torch.Tensor:
        """Forward and backward of every microbatch (gradients left in place); the step's loss on this rank."""

    def eval(self, engine: "Engine", micro: list[tuple[torch.Tensor, torch.Tensor]],
             divisors: list[float]) -> torch.Tensor:
        """The step's loss on this rank, forward only."""


class Accumulate:
    """No pipeline: each microbatch's forward and backward in turn, the gradients accumulated. FSDP2 reduces
    them in the last microbatch's backward only (or in every one: runtime.sharding.reduce_every_microbatch)."""

    stage_group = None
    units: tuple[nn.Module, ...] = ()

    def __init__(self, model: nn.Module):
        self.model = model

    def train(self, engine: "Engine", micro: list[tuple[torch.Tensor, torch.Tensor]],
              divisors: list[float]) -> torch.Tensor:
        total = torch.zeros((), device=engine.device)
        for i, (inputs, targets) in enumerate(micro):
            if isinstance(self.model, FSDPModule):
                self.model.set_requires_gradient_sync(i == len(micro) - 1)
            elif engine.cast is not None:
                engine.cast.keep = i < len(micro) - 1  # the last backward drops each compute copy once used
            with vocab_parallel_loss(engine.plan):
                with engine.span("F", i), engine.memory.track_activations() if engine.track_memory else nullcontext():
                    loss = local(self.model(inputs, targets)) / divisors[i]
                engine.sample()
                with engine.span("B", i):
                    (loss * engine.loss_scale).backward()
            total += loss.detach()
        engine.sample()
        return total

    @torch.no_grad()
    def eval(self, engine: "Engine", micro: list[tuple[torch.Tensor, torch.Tensor]],
             divisors: list[float]) -> torch.Tensor:
        total = torch.zeros((), device=engine.device)
        for (inputs, targets), divisor in zip(micro, divisors):
            with vocab_parallel_loss(engine.plan):
                total += local(self.model(inputs, targets)).float() / divisor
        return total
