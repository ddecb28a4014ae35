"""Streamed optimizer states (BlockPlan.stream_states): a unit's states live on host, and its update runs on the
device, with the states copied in before the unit's step and back after it.

The alternative to runtime.offload's AdamW on the host's cores: the weights and their gradients stay on the device,
and per step the device's update costs the states' bytes over PCIe twice (a quarter of fp32's with 8-bit states)
instead of the host's much slower update. Units step in the order backward finishes them, so while one steps the
next block's states are already coming in (`prefetch`), on a copy stream beside the compute; stepping in backward
(runtime.step_in_backward) the copies overlap the rest of backward. The device holds two units' states at most
(plan.piece_memory.stream_windows).

The states stay the optimizer's own tensors (plain, DTensors, torchao's quantized subclasses): only the storages
behind them are emptied (`untyped_storage().resize_(0)`, as FSDP2 frees its gathered copies) and refilled, so the
optimizer, its compiled update and checkpoints see the same objects. Where the device is this CPU (tests), the
same copies run between two host buffers. `StreamedStates` is runtime.optimizer's `DeviceUnits` with the states
loaded around each use (a step, a checkpoint).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from snugfit.runtime.memory import MemoryTracker, storage_leaves, tensor_bytes
from snugfit.runtime.optimizer import DeviceUnits, OptimUnit

log = logging.getLogger(__name__)


class _Leaves:
    """The device tensors holding one unit's states, and their host copies (pinned where an accelerator exists)."""

    def __init__(self, unit: OptimUnit):
        pin = torch.accelerator.is_available()
        self.device = [leaf for state in unit.optimizer.state.values() for value in state.values()
                       if isinstance(value, torch.Tensor) and value.dim() > 0 for leaf in storage_leaves(value)]
        self.host = [torch.empty(leaf.shape, dtype=leaf.dtype, device="cpu", pin_memory=pin) for leaf in self.device]
        self.nbytes = [leaf.untyped_storage().nbytes() for leaf in self.device]
        self.loaded = True
        self.ready: torch.Event | None = None  # the copy in finished (accelerators)


class StreamedStates(DeviceUnits):
    """Units whose states are on host between their uses (see the module docstring), in the order backward
    finishes them."""

    states_move = True

    def __init__(self, units: list[OptimUnit], device: torch.device, sample: Callable[[], None]):
        super().__init__(units, sample)
        self.device = device
        self.leaves = {id(u): _Leaves(u) for u in self.order}
        accel = device.type != "cpu" and torch.accelerator.is_available()
        self.module = torch.get_device_module(device.type) if accel else None  # torch.cuda, ...
        self.stream = self.module.Stream(device=device) if accel else None
        for u in self.order:
            self.offload(u)
        log.info("streamed optimizer states: %d units, %.1f MB on host", len(self.order),
                 self.memory()["host.optimizer"] / 2**20)

    def _next(self, u: OptimUnit) -> OptimUnit | None:
        i = next(i for i, v in enumerate(self.order) if v is u)
        return self.order[i + 1] if i + 1 < len(self.order) else None

    @torch.no_grad()
    def prefetch(self, u: OptimUnit | None) -> None:
        """Start copying u's states to the device (on the copy stream where there is one)."""
        if u is None or self.leaves[id(u)].loaded:
            return
        lv = self.leaves[id(u)]
        for leaf, n in zip(lv.device, lv.nbytes):
            leaf.untyped_storage().resize_(n)
        if self.stream is None:
            for leaf, host in zip(lv.device, lv.host):
                leaf.copy_(host)
        else:
            self.stream.wait_stream(self.module.current_stream(self.device))  # the storages may reuse freed blocks
            with self.module.stream(self.stream):
                for leaf, host in zip(lv.device, lv.host):
                    leaf.copy_(host, non_blocking=True)
                    leaf.record_stream(self.stream)  # allocated on the compute stream, written on this one
            lv.ready = self.stream.record_event()
        lv.loaded = True

    def load(self, u: OptimUnit) -> None:
        """u's states on the device, ready for its step (the stream's copy waited for); the next block's start
        coming in. The root pieces' states (the embedding's and the head's, the largest) come in only for their
        own step, the step's last: held beside the root's reduce, they would set the device's peak."""
        self.prefetch(u)
        lv = self.leaves[id(u)]
        if lv.ready is not None:
            self.module.current_stream(self.device).wait_event(lv.ready)
            lv.ready = None
        later = self._next(u)
        if later is not None and later.name != "root":
            self.prefetch(later)

    @torch.no_grad()
    def offload(self, u: OptimUnit) -> None:
        """Copy u's states back to host after its step and free their device storages."""
        lv = self.leaves[id(u)]
        if not lv.loaded:
            return
        if self.stream is None:
            for leaf, host in zip(lv.device, lv.host):
                host.copy_(leaf)
        else:
            self.stream.wait_stream(self.module.current_stream(self.device))  # after the step
            with self.module.stream(self.stream):
                for leaf, host in zip(lv.device, lv.host):
                    host.copy_(leaf, non_blocking=True)
                    leaf.record_stream(self.stream)  # freed below: not reused before the copy has read it
        for leaf in lv.device:
            leaf.untyped_storage().resize_(0)
        lv.loaded = False

    @contextmanager
    def loaded(self, unit: OptimUnit) -> Iterator[None]:
        """The unit's states on the device while inside, back on host after."""
        self.load(unit)
        yield
        self.offload(unit)

    def track(self, tracker: MemoryTracker) -> None:
        super().track(tracker)  # loaded states: the optimizer's, on the device
        tracker.add_source(self.memory)

    def memory(self) -> dict[str, int]:
        """MemoryTracker source: the host copies (the device's loaded states count as the optimizer's)."""
        return {"host.optimizer": tensor_bytes(h for lv in self.leaves.values() for h in lv.host)}
