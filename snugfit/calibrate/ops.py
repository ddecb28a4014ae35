"""Counting the operators a step dispatches: the host's share of a step, the same on any hardware.

A small model's step on a GPU is bound by the host: each aten operator costs a dispatch (~10 us) whatever its
size (docs/gpu.md: snugfit's engine dispatched 18.4k operators a step where a plain loop dispatched 13.7k). The
count does not depend on the device, so a bar on it holds on CPU what a GPU run would show. Operators inside a
compiled graph are not dispatched one by one; the graph's own calls are.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts every aten operator dispatched while active (forward, backward, optimizer, collectives)."""

    def __init__(self):
        super().__init__()
        self.by_op: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_op[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def count(self) -> int:
        return sum(self.by_op.values())


def count_ops(step: Callable[[], object]) -> OpCounter:
    """The operators one call of `step` dispatches."""
    with OpCounter() as counter:
        step()
    return counter
