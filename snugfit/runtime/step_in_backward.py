"""The step in backward (OptimizerPlan.in_backward): each unit steps as soon as its gradient is ready in the step's
last backward, and the gradient is freed at once, so no step-wide gradient buffer exists.

"Ready" is the parameter's post-accumulate-grad hook: FSDP2 calls it on the sharded parameter right after it has
reduced the unit's gradient (torch 2.13's `foreach_reduce`), autograd after accumulating a plain parameter's; host
offload's own hook has moved the gradient to host by then. Every backward calls it once per parameter: with one
microbatch, or gradients reduced every microbatch (Plan.validate refuses the rest), the m-th call of a step is its
last, whichever schedule runs the microbatches. A unit steps when each of its parameters has had its last call;
`finish` steps what never got there (a parameter without a gradient this step).

Global-norm clipping needs every gradient before any update, which no longer exists: each unit is clipped by its
share of the threshold instead (`StepInBackward._ready`), and the step's norm is summed from the units'.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch
import torch.distributed as dist

from snugfit.runtime.grad_norm import global_grad_norm
from snugfit.runtime.offload import weak_hook
from snugfit.runtime.optimizer import Updater


class StepInBackward:
    """Steps each unit of the `updaters` (runtime.optimizer.Updater) once per step, when its gradient is final.

    grad_clip: the threshold of the whole update's norm (0: none); stage_group: the pipeline ranks holding the
    model's other units (their elements and norms add up)."""

    def __init__(self, updaters: list[Updater], microbatches: int, grad_clip: float, device: torch.device,
                 stage_group=None):
        self.microbatches, self.grad_clip, self.device, self.stage_group = microbatches, grad_clip, device, stage_group
        self.units = {(updater, key): params for updater in updaters for key, params in updater.unit_params().items()}
        self._unit_of = {id(p): unit for unit, params in self.units.items() for p in params}
        for params in self.units.values():
            for p in params:
                p.register_post_accumulate_grad_hook(weak_hook(self._accumulated))
        self._elements = self._trainable_elements()
        self.begin(0.0)

    def _trainable_elements(self) -> int:
        """Trainable elements of the whole model (every pipeline stage's): what each unit's clipping share is of."""
        total = torch.tensor(float(sum(p.numel() for params in self.units.values() for p in params)),
                             device=self.device)
        if self.stage_group is not None:
            dist.all_reduce(total, group=self.stage_group)
        return int(total.item())

    def begin(self, lr: float) -> None:
        """A new step at learning rate `lr`: no gradient seen yet, no unit stepped."""
        self.lr = lr
        self._calls = dict.fromkeys(self._unit_of, 0)
        self._waiting = {unit: len(params) for unit, params in self.units.items()}
        self._stepped: set = set()
        self._squares, self._skipped = 0.0, False  # of the units stepped so far

    def _accumulated(self, p: torch.Tensor) -> None:
        self._calls[id(p)] += 1
        if self._calls[id(p)] != self.microbatches:
            return
        unit = self._unit_of[id(p)]
        self._waiting[unit] -= 1
        if self._waiting[unit] == 0:
            self._ready(unit)

    @torch.no_grad()
    def _ready(self, unit: tuple[Updater, Hashable]) -> None:
        """A unit's gradient is final: clip it by its share of the threshold, step it, free its gradient. A share
        of sqrt(its elements / all) keeps the norm of the whole update within the threshold, as global-norm
        clipping would; a unit whose gradient is not finite does not step."""
        self._stepped.add(unit)
        updater, key = unit
        grads = updater.grads(key)
        norm = global_grad_norm(grads, self.device).item()
        finite = math.isfinite(norm)
        self._squares = self._squares + norm**2 if finite else math.inf
        self._skipped = self._skipped or not finite
        bound = self.grad_clip * math.sqrt(sum(p.numel() for p, _ in grads) / self._elements)
        coef = min(bound / (norm + 1e-6), 1.0) if self.grad_clip > 0 and finite else 1.0
        updater.step(coef, not finite, self.lr, key)
        for p in self.units[unit]:
            p.grad = None

    def finish(self) -> tuple[float, bool]:
        """After the step's last backward: step the units that did not complete in it (some parameter got no
        gradient, or fewer); the step's gradient norm over every pipeline rank, and whether a unit skipped."""
        for unit in self.units:
            if unit not in self._stepped and any(self._calls[id(p)] for p in self.units[unit]):
                self._ready(unit)
        total = torch.tensor(self._squares, device=self.device)
        if self.stage_group is not None:
            dist.all_reduce(total, group=self.stage_group)
        return total.sqrt().item(), self._skipped
