"""The step in backward (OptimizerPlan.in_backward): each unit steps as soon as its gradient is ready in the step's
last backward, and the gradient is freed at once, so no step-wide gradient buffer exists.

"Ready" is the parameter's post-accumulate-grad hook: FSDP2 calls it on the sharded parameter right after it has
reduced the unit's gradient (torch 2.13's `foreach_reduce`), autograd after accumulating a plain parameter's; host
offload's own hook has moved the gradient to host by then. Every backward calls it once per parameter: with one
microbatch, or gradients reduced every microbatch (Plan.validate refuses the rest), the m-th call of a step is its
last, whichever schedule runs the microbatches. A unit steps when each of its parameters has had its last call;
`finish` steps what never got there (a parameter without a gradient this step).

Global-norm clipping needs every gradient before any update, which no longer exists: the engine clips each unit by
its share of the threshold instead (runtime.engine.Engine._unit_ready).
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch.nn as nn

from snugfit.runtime.offload import weak_hook


class StepInBackward:
    """Calls `ready(key)` once per step for each unit (key -> its parameters) when its gradient is final."""

    def __init__(self, units: dict[Hashable, list[nn.Parameter]], microbatches: int,
                 ready: Callable[[Hashable], None]):
        self.units, self.microbatches, self.ready = units, microbatches, ready
        self._unit_of = {id(p): key for key, params in units.items() for p in params}
        for params in units.values():
            for p in params:
                p.register_post_accumulate_grad_hook(weak_hook(self._accumulated))
        self.begin()

    def begin(self) -> None:
        """A new step: no gradient seen yet."""
        self._calls = dict.fromkeys(self._unit_of, 0)
        self._waiting = {key: len(params) for key, params in self.units.items()}
        self._stepped: set = set()

    def _accumulated(self, p: nn.Parameter) -> None:
        self._calls[id(p)] += 1
        if self._calls[id(p)] != self.microbatches:
            return
        key = self._unit_of[id(p)]
        self._waiting[key] -= 1
        if self._waiting[key] == 0:
            self._step(key)

    def _step(self, key: Hashable) -> None:
        self._stepped.add(key)
        self.ready(key)

    def finish(self) -> None:
        """Step the units that did not complete in backward (some parameter got no gradient, or fewer)."""
        for key in self.units:
            if key not in self._stepped and any(self._calls[id(p)] for p in self.units[key]):
                self._step(key)
