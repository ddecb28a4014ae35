"""What a block does with its saved activations: keep, recompute, selective, offload.

`apply_activation_policy(block, policy)` replaces the block's `forward` on the
instance (no wrapper module), so parameter names -- and checkpoints -- stay the
same under every policy, and FSDP2's module hooks still run around it.

- keep: autograd saves what it saves.
- recompute: non-reentrant `torch.utils.checkpoint` around the block; only the
  block input is held, the forward runs again in backward.
- selective: the same checkpoint with a selective policy that keeps the outputs
  of matrix multiplies and attention (the expensive ops: mm, addmm, bmm, sdpa)
  and recomputes the cheap elementwise/norm ops, which are most of the bytes.
- offload: saved tensors are copied to host memory in forward (pinned, on a
  side stream, where an accelerator exists) and copied back one block ahead of
  backward: when the gradient reaches a block's output, the copies of the block
  before it start, newest first, so they arrive while this block computes.
  Tensors already off the device (flash attention's CPU seed and offset) stay.
- recompute_offload: recompute, with the one tensor it keeps, the block input,
  on host as offload moves its tensors. The checkpoint itself holds that input
  too (torch.utils.checkpoint keeps its arguments), so its device storage is
  emptied in place after the forward and refilled before the backward, as
  FSDP2 frees unsharded parameters.
"""

from __future__ import annotations

import functools
import threading
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from snugfit.model.recompute import recompute
from snugfit.runtime.memory import MemoryTracker, local

class _HostCopy:
    """One saved tensor in host memory; `fetch` starts the copy back, `get` waits for it."""

    def __init__(self, t: torch.Tensor, stream: torch.Stream | None):
        self.device = t.device
        self.stream = stream
        self.back: torch.Tensor | None = None
        self.used = False  # handed to autograd: never fetched again
        self.event = None
        pin = stream is not None
        self.host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        if stream is None:
            self.host.copy_(t)
            return
        stream.wait_stream(torch.accelerator.current_stream(t.device))
        with stream:
            self.host.copy_(t, non_blocking=True)
        t.record_stream(stream)  # keep the device memory until the copy is done
        self.event = stream.record_event()

    def fetch(self) -> None:
        if self.back is not None or self.used:
            return
        if self.stream is None:
            self.back = self.host.to(self.device, copy=True)
            return
        self.stream.wait_event(self.event)
        with self.stream:
            self.back = self.host.to(self.device, non_blocking=True)
        self.event = self.stream.record_event()

    def get(self) -> torch.Tensor:
        self.fetch()
        back, self.back, self.used = self.back, None, True  # autograd holds it now, as long as it needs it
        if self.event is not None:
            torch.accelerator.current_stream(self.device).wait_event(self.event)
            back.record_stream(torch.accelerator.current_stream(self.device))
        return back


_last_offloaded: list = [[]]  # the host copies of the offloaded block whose forward ran last (either policy)


def _offload(forward: Callable, x: torch.Tensor, *args: Any) -> torch.Tensor:
    if not (torch.is_grad_enabled() and x.requires_grad):
        return forward(x, *args)
    stream = torch.Stream(device=x.device) if x.device.type != "cpu" and torch.accelerator.is_available() else None
    packed: list[_HostCopy] = []
    before, _last_offloaded[0] = _last_offloaded[0], packed  # the block whose backward follows this one's

    def pack(t: torch.Tensor):
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t  # weights stay where they are
        if t.device != x.device:  # e.g. flash attention's CPU seed and offset: already off the device
            return t
        packed.append(_HostCopy(t, stream))
        return packed[-1]

    def unpack(p):
        return p.get() if isinstance(p, _HostCopy) else p

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = forward(x, *args)
    if out.requires_grad:
        out.register_hook(lambda grad: _fetch_all(packed, before))
    return out


class _StorageOnHost:
    """A tensor's whole storage copied to host and emptied on the device (`empty`), refilled in place (`fetch`),
    so every alias of it -- the checkpoint's argument, autograd's saved tensor -- holds it again at once."""

    def __init__(self, t: torch.Tensor, stream: torch.Stream | None):
        self.tensor, self.stream, self.used, self.event = t, stream, False, None
        self.storage = t.untyped_storage()
        self.nbytes = self.storage.nbytes()
        pin = stream is not None
        self.host = torch.empty(self.nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin)
        if stream is None:
            self.host.copy_(_bytes_of(self.storage))
            return
        stream.wait_stream(torch.accelerator.current_stream(t.device))
        with stream:
            self.host.copy_(_bytes_of(self.storage), non_blocking=True)
        t.record_stream(stream)  # the allocator keeps the bytes until the copy has read them
        self.event = stream.record_event()

    def empty(self) -> None:
        self.storage.resize_(0)

    def fetch(self) -> None:
        if self.used or self.storage.nbytes() == self.nbytes:
            return
        self.storage.resize_(self.nbytes)
        if self.stream is None:
            _bytes_of(self.storage).copy_(self.host)
            return
        self.stream.wait_event(self.event)
        with self.stream:
            _bytes_of(self.storage).copy_(self.host, non_blocking=True)
        self.event = self.stream.record_event()

    def get(self) -> torch.Tensor:
        self.fetch()
        self.used = True
        if self.event is not None:
            current = torch.accelerator.current_stream(self.tensor.device)
            current.wait_event(self.event)
            self.tensor.record_stream(current)
        return self.tensor


def _whole_storage(t: torch.Tensor) -> bool:
    """Whether t is all of its storage: emptying the storage then touches no other tensor's bytes."""
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def _offload_checkpoint(forward: Callable, x: torch.Tensor, *args: Any) -> torch.Tensor:
    """`forward` recomputes the block; the input it keeps waits on host (see the module docstring)."""
    if not (torch.is_grad_enabled() and x.requires_grad and _whole_storage(x)):
        return forward(x, *args)
    stream = torch.Stream(device=x.device) if x.device.type != "cpu" and torch.accelerator.is_available() else None
    held: list[_StorageOnHost] = []
    before, _last_offloaded[0] = _last_offloaded[0], held
    mine = x.untyped_storage()._cdata

    def pack(t: torch.Tensor):
        if t.untyped_storage()._cdata == mine and not held:  # the checkpoint's input, saved by _KeepInput
            held.append(_StorageOnHost(t, stream))
            return held[0]
        return t

    def unpack(p):
        return p.get() if isinstance(p, _StorageOnHost) else p

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = forward(x, *args)
    for h in held:
        h.empty()  # nothing reads the input again before this block's backward
    if out.requires_grad:
        out.register_hook(lambda grad: _restore(held, before))
    return out


def _restore(held: list[_StorageOnHost], ahead: list) -> None:
    """As the block's backward starts: its input back on the device before the recomputation reads it (autograd
    never unpacks it: the checkpoint reads its own reference), then the next block's copies started."""
    for h in held:
        h.get()
    for p in reversed(ahead):
        p.fetch()


def _fetch_all(packed: list, ahead: list) -> None:
    """As a block's backward starts: its own copies (if not yet started), then those of the block whose backward
    comes next, each newest first, as backward uses them."""
    for p in [*reversed(packed), *reversed(ahead)]:
        p.fetch()


def apply_activation_policy(block: nn.Module, policy: str) -> nn.Module:
    """Make `block` keep, recompute (selectively), offload its saved activations, or recompute with its
    checkpoint offloaded (in place)."""
    if policy == "keep":
        return block
    if policy in ("recompute", "selective", "recompute_offload"):
        recompute(block, selective=policy == "selective")
    if policy == "recompute_offload":
        block.forward = functools.partial(_offload_checkpoint, block.forward)
    elif policy == "offload":
        block.forward = functools.partial(_offload, block.forward)
    elif policy not in ("recompute", "selective"):
        raise ValueError(f"unknown activation policy {policy!r}; use keep, recompute, selective, offload or "
                         "recompute_offload")
    return block


class StageActivations:
    """The saved activations a pipeline stage holds, per microbatch, and BPipe's moves of them.

    Wrap each microbatch's forward in `microbatch(key)`: every tensor autograd
    saves there is recorded by its storage (deduplicated; parameters, gathered
    or not, buffers and the step's input batch excluded) and released when autograd frees it.
    Tensors saved under an inner policy (recompute, offload) are that policy's
    business and not seen here, except the block inputs recompute keeps.

    `evict(key)` hands out a microbatch's storages as they are, to be sent and
    then freed in place (`free`), without unpacking anything; `load(key)`
    re-allocates them for the bytes to come back before backward. A partner
    stage holds evicted buffers via `accept`/`release`.
    """

    def __init__(self, modules: list[nn.Module]):
        self._static = {
            _storage_id(t) for m in modules for t in (*m.parameters(), *m.buffers()) if t is not None
        }
        self._external: set[int] = set()
        self._entries: dict[int, list] = {}  # storage id -> [key, nbytes, references, weakref to storage]
        self._key_bytes: dict[object, int] = {}  # microbatch key -> bytes of its entries
        self._evicted: dict[object, int] = {}  # key -> bytes sent away
        self._accepted: dict[object, torch.Tensor] = {}  # partner's microbatches held here
        self._in_flight = 0  # bytes of evict buffers whose send has not finished
        # the engine's MemoryTracker on the steps it counts (its own saved-tensor hooks would not see the stages'
        # activations): told the resident bytes after each microbatch's forward, and whenever a tensor is saved or
        # used, which is when FSDP2's gathered copies are held
        self.tracker: MemoryTracker | None = None
        self._lock = threading.RLock()  # a partner's microbatches arrive on a helper thread
        # off on steps whose accounting nobody reads (no BPipe moves, memory not counted): the hooks cost a Python
        # call and a finalizer per saved tensor (1F1B steps at pp 4 of a dim-128 decoder: 25-28% of the step on CPU)
        self.recording = True
        self.reset()

    def reset(self, external: tuple[torch.Tensor, ...] = ()) -> None:
        """Start a step: clear the stores and peaks; `external` (the batch) is never counted or moved."""
        self._evicted.clear()
        self._accepted.clear()
        self._external = {_storage_id(t) for t in external}
        self.peak_bytes = self.peak_microbatches = self.evictions = self.accepts = 0
        self.peak_own_bytes = self.largest_accepted_bytes = 0
        self._fold()

    # -- accounting --
    def resident_keys(self) -> set:
        return (set(self._key_bytes) - set(self._evicted)) | set(self._accepted)

    def own_bytes(self) -> int:
        """This stage's own saved bytes still here, evict sends not yet finished included."""
        return sum(v for k, v in self._key_bytes.items() if k not in self._evicted) + self._in_flight

    def resident_bytes(self) -> int:
        return self.own_bytes() + sum(t.numel() for t in self._accepted.values())

    def _fold(self) -> None:
        with self._lock:
            self._fold_locked()
            resident = self.resident_bytes()
        if self.tracker is not None:
            self.tracker.fold_activations(resident)

    def _moved(self) -> None:
        if self.tracker is not None:
            with self._lock:
                resident = self.resident_bytes()
            self.tracker.fold_moving(resident)

    def _fold_locked(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.resident_bytes())
        self.peak_own_bytes = max(self.peak_own_bytes, self.own_bytes())
        self.peak_microbatches = max(self.peak_microbatches, len(self.resident_keys()))

    def add_in_flight(self, nbytes: int) -> None:
        self._in_flight += nbytes
        self._fold()

    @contextmanager
    def microbatch(self, key) -> Iterator[None]:
        if not self.recording:
            yield
            return

        def pack(t: torch.Tensor):
            # FSDP2's gathered parameters are new storages on every unshard: recognise them (and views) by type.
            if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or t.device.type == "meta":
                return t
            sid = _storage_id(t)
            if sid in self._static or sid in self._external:
                return t
            with self._lock:
                entry = self._entries.get(sid)
                if entry is None:
                    storage = local(t).untyped_storage()
                    entry = self._entries[sid] = [key, storage.nbytes(), 0, weakref.ref(storage)]
                    self._key_bytes[key] = self._key_bytes.get(key, 0) + entry[1]
                entry[2] += 1
            # Autograd holds the handle exactly as long as it needs the tensor; its death is the release.
            handle = _Saved(t)
            weakref.finalize(handle, self._release, sid)
            self._moved()
            return handle

        def unpack(saved):
            if not isinstance(saved, _Saved):
                return saved
            self._moved()  # backward: catches gathered and prefetched units
            return saved.tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
        self._fold()

    def _release(self, sid: int) -> None:
        with self._lock:
            entry = self._entries.get(sid)
            if entry is not None:
                entry[2] -= 1
                if entry[2] == 0:
                    del self._entries[sid]
                    left = self._key_bytes.pop(entry[0], 0) - entry[1]
                    if left:
                        self._key_bytes[entry[0]] = left

    # -- BPipe moves --
    def _storages(self, key) -> list[torch.UntypedStorage]:
        with self._lock:
            found = [e[3]() for e in self._entries.values() if e[0] == key]
        return [s for s in found if s is not None]

    def evict(self, key) -> list[torch.Tensor]:
        """This microbatch's saved storages as byte tensors to send away, no copy made (a concatenated buffer
        would briefly double the microbatch). Counted as gone from here; `free` them once sent."""
        views = [_bytes_of(s) for s in self._storages(key)]
        self._evicted[key] = sum(v.numel() for v in views)
        self.evictions += 1
        return views

    @staticmethod
    def free(views: list[torch.Tensor]) -> None:
        """Empty the sent storages in place (`storage.resize_(0)`, as FSDP does): every alias -- autograd's saved
        tensors, the stage input kept for its gradient -- at once."""
        for v in views:
            v.untyped_storage().resize_(0)

    def load(self, key) -> list[torch.Tensor]:
        """Re-allocate the storages `evict(key)` emptied, in the same order; returns them as byte tensors for
        the caller to receive into."""
        self._evicted.pop(key)
        with self._lock:
            entries = [e for e in self._entries.values() if e[0] == key]
        views = []
        for e in entries:
            storage = e[3]()
            if storage is not None:
                storage.resize_(e[1])
                views.append(_bytes_of(storage))
        self._fold()
        return views

    def accept(self, key, flat: torch.Tensor) -> None:
        with self._lock:
            self._accepted[key] = flat
            self.accepts += 1
            self.largest_accepted_bytes = max(self.largest_accepted_bytes, flat.numel())
            self._fold_locked()

    def release(self, key) -> torch.Tensor:
        with self._lock:
            return self._accepted.pop(key)


class _Saved:
    """A saved tensor as autograd holds it (the tensor itself may outlive it, e.g. a reused receive buffer)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _storage_id(t: torch.Tensor) -> int:
    """Identity of the storage behind t (a DTensor's: its local shard's, the bytes this rank holds; its own
    `untyped_storage()` reports the global size); stable while it is resized (unlike its data pointer)."""
    return local(t).untyped_storage()._cdata


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))
