"""A pipeline stage's saved activations, counted per microbatch, and BPipe's moves of them.

torch.distributed.pipelining runs each stage's forward and backward; it knows
nothing of what autograd saves in between. The memory model predicts a stage's
activations per resident microbatch, and BPipe sends whole microbatches of them
to the partner stage: both need them recorded by microbatch, which this does.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn as nn

from snugfit.runtime.activations import storage_bytes
from snugfit.runtime.memory import MemoryTracker, SavedHandle, local


class StageActivations:
    """The saved activations a pipeline stage holds, per microbatch, and BPipe's moves of them.

    Wrap each microbatch's forward in `microbatch(key)`: every tensor autograd
    saves there is recorded by its storage (deduplicated; parameters, gathered
    or not, buffers and the step's input batch excluded) and released when autograd frees it.
    Tensors saved under an inner policy (recompute, offload) are that policy's
    business and not seen here, except what recomputation keeps: block inputs,
    and the matmul outputs of selective recomputation (model.recompute).

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
        """A tensor was saved or used: the tracker sees this stage's activations beside what FSDP2 holds now."""
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
            handle = SavedHandle(t)
            weakref.finalize(handle, self._release, sid)
            self._moved()
            return handle

        def unpack(saved):
            if not isinstance(saved, SavedHandle):
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
        views = [storage_bytes(s) for s in self._storages(key)]
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
                views.append(storage_bytes(storage))
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


def _storage_id(t: torch.Tensor) -> int:
    """Identity of the storage behind t (a DTensor's: its local shard's, the bytes this rank holds; its own
    `untyped_storage()` reports the global size); stable while it is resized (unlike its data pointer)."""
    return local(t).untyped_storage()._cdata
