"""Per-rank memory accounting kept by the runtime, on CPU too.

CPUs have no device allocator statistics, and on a GPU the allocator cannot say
*why* memory is held; the planner predicts bytes by category, so the runtime
counts the same categories from the tensors it actually holds:

    parameters   local parameter shards at rest (compute copies of offloaded blocks included)
    gradients    local gradient shards, unsharded gradients held during accumulation,
                 host gradient copies of offloaded blocks
    optimizer    optimizer states; fp32 master weights of offloaded blocks
    activations  live tensors saved for backward (saved_tensors_hooks), deduplicated by storage
    buffers      unsharded (all-gathered) parameters in flight, prefetched all-gathers, module buffers

each on "device" or "host" (keys "device.parameters", "host.optimizer", ...,
plus "device.total" and "host.total"). "Host" means held in host memory by
decision (offload), so the split is meaningful on a CPU-only machine too.

Under FSDP2 the parameters at rest are the local shards in their stored dtype
(fp32, or the compute dtype for partially offloaded units), and the compute
copies FSDP2 all-gathers are buffers: a zero 0-2 unit keeps its whole copy from
forward through backward (also at zero 0: FSDP2 copies even on a one-rank shard
group), a zero 3 unit only while it runs or is prefetched. The memory model
predicts these same keys (Prediction.tracked_by_rank). Transient tensors that are neither saved for
backward nor parameters (logits before the loss, matmul outputs consumed at
once) are invisible here: CPUs have no allocator statistics to catch them.

Parameters, gradients, optimizer and buffers are read from the tensors when
`sample()` is called (the engine samples at phase boundaries); activations and
buffers are also updated whenever a tensor is saved (forward) or used (backward),
so the activation peak is exact and the buffer peak sees a zero-3 unit's copy while
it runs and backward prefetch. Pipeline stages count their activations themselves
(runtime.stage_activations.StageActivations) and report them the same way: `fold_activations`
after each microbatch's forward, `fold_moving` for every tensor saved or used.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "buffers")
PLACES = ("device", "host")
KEYS = tuple(f"{w}.{c}" for w in PLACES for c in CATEGORIES)

# A source of extra accounting: returns {"host.optimizer": bytes, ...}. Offload and
# pipeline code register one for what they hold outside the model and optimizer.
Source = Callable[[], dict[str, int]]


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly distributed) tensor this rank holds."""
    return t.to_local() if isinstance(t, DTensor) else t


def storage_leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding t's bytes: its local shard, or a wrapper subclass's inner tensors (torchao's
    NF4Tensor keeps codes and scales in several), which own storages where the wrapper owns none."""
    t = local(t)
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [leaf for name in names for leaf in storage_leaves(getattr(t, name))]


def storage_key(t: torch.Tensor) -> int:
    return storage_leaves(t)[0].untyped_storage().data_ptr()


def tensor_bytes(tensors: Iterable[torch.Tensor], seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (local shards only)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        for leaf in storage_leaves(t):
            s = leaf.untyped_storage()
            if s.data_ptr() == 0 or s.data_ptr() in seen:
                continue
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _fsdp_groups(roots: Iterable[nn.Module]) -> list:
    """FSDP2 parameter groups under `roots`, once each. FSDP2 has no public query of what is unsharded:
    read its state."""
    groups = {}
    for root in roots:
        for m in root.modules():
            if isinstance(m, FSDPModule):
                group = fully_shard.state(m)._fsdp_param_group
                if group is not None:
                    groups[id(group)] = group
    return list(groups.values())


class MemoryTracker:
    """Bytes held by this rank, by category and place; peaks since `reset_peak()`.

    model: the (parallelised) model; optimizers: device optimizers whose state to
    count; sources: extra accounting (see `Source`); units: FSDP2 roots outside `model` that hold
    its parameters (pipeline stages wrap the model's pieces in their own root units); not_saved: storage keys
    that are never activations though autograd saves them (runtime.precision's compute copies, counted as buffers).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizers: Iterable[torch.optim.Optimizer] = (),
        sources: Iterable[Source] = (),
        units: Iterable[nn.Module] = (),
        not_saved: Callable[[], set[int]] = set,
    ):
        self.model = model
        self.not_saved = not_saved  # storages autograd saves that are no activations (compute copies of weights)
        self.optimizers = list(optimizers)
        self.sources = list(sources)
        self._groups = _fsdp_groups([model, *units])
        # While a unit is unsharded, model.parameters() yields its unsharded parameters;
        # the parameters at rest are FSDP2's sharded ones.
        managed = {id(fp.sharded_param) for g in self._groups for fp in g.fsdp_params}
        self._plain = [p for p in model.parameters() if id(p) not in managed]
        self._host_params = {
            id(fp.sharded_param) for g in self._groups for fp in g.fsdp_params if fp.offload_to_cpu
        }
        self._saved: dict[int, list[int]] = {}  # storage ptr -> [nbytes, references]
        self._live_activations = 0
        self._module_buffers = list(model.buffers())
        self._hold(dict.fromkeys(KEYS, 0))
        self._resting: set[int] = set()  # storages of the parameters at rest, as last read
        self._buffers_state: list | None = None  # which units were unsharded when buffers were last counted
        self._peak: dict[str, int] = {}
        self.reset_peak()

    def add_source(self, source: Source) -> None:
        self.sources.append(source)

    def add_optimizers(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        self.optimizers.extend(optimizers)

    # -- what is held now --
    def _place(self, p: torch.Tensor) -> str:
        return "host" if id(p) in self._host_params else "device"

    def _params(self) -> list[torch.Tensor]:
        return [fp.sharded_param for g in self._groups for fp in g.fsdp_params] + self._plain

    def _gathered(self) -> set[int]:
        """Storages of the unsharded DTensor parameters in flight (expert parallelism's experts): what a weight's
        to_local() view that autograd saves holds, counted as buffers, not activations."""
        return {storage_key(fp._unsharded_param) for g in self._groups if g.is_unsharded for fp in g.fsdp_params
                if isinstance(fp._unsharded_param, DTensor)}

    def _buffers(self, resting: set[int] | None = None) -> int:
        """Unsharded parameters in flight and module buffers; `resting`: storages of parameters at rest."""
        seen = set(resting) if resting is not None else {storage_key(p) for p in self._params()}
        live = [fp._unsharded_param for g in self._groups if g.is_unsharded for fp in g.fsdp_params]
        # a prefetched unit's all-gather output exists from the launch, before the unit counts as unsharded
        pending = [g._all_gather_result.all_gather_output for g in self._groups if g._all_gather_result is not None]
        return tensor_bytes(live + pending, seen) + tensor_bytes(self._module_buffers, seen)

    def _measure_static(self) -> dict[str, int]:
        out = dict.fromkeys(KEYS, 0)
        seen: set[int] = set()
        for p in self._params():
            out[f"{self._place(p)}.parameters"] += tensor_bytes([p], seen)
            if p.grad is not None:
                out[f"{self._place(p)}.gradients"] += tensor_bytes([p.grad], seen)
        for g in self._groups:  # unsharded gradients kept while gradient sync is off
            for fp in g.fsdp_params:
                held = [fp.unsharded_accumulated_grad, getattr(getattr(fp, "_unsharded_param", None), "grad", None)]
                out["device.gradients"] += tensor_bytes([t for t in held if t is not None], seen)
        for opt in self.optimizers:
            for p, state in opt.state.items():
                tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
                out[f"{self._place(p)}.optimizer"] += tensor_bytes(tensors, seen)
        self._module_buffers = list(self.model.buffers())  # read again here: a move to a device replaces them
        out["device.buffers"] = self._buffers()
        for source in self.sources:
            for k, v in source().items():
                out[k] += v
        return out

    def snapshot(self) -> dict[str, int]:
        """Bytes held now, by "place.category", plus "device.total" and "host.total"."""
        out = self._measure_static()
        out["device.activations"] = self._live_activations
        return _with_totals(out)

    def sample(self) -> dict[str, int]:
        """Take a snapshot and fold it into the peaks (the engine calls this at phase boundaries)."""
        snap = self.snapshot()
        self._hold(snap)
        self._fold(snap)
        return snap

    def peak(self) -> dict[str, int]:
        """Largest value seen per key since `reset_peak()` (totals: largest simultaneous sum)."""
        return dict(self._peak)

    def fold_activations(self, nbytes: int) -> None:
        """Fold in what is held now with `nbytes` of activations counted elsewhere (pipeline stages, after each
        microbatch's forward), and keep the held part for `fold_moving`."""
        snap = self._measure_static()
        self._resting = {storage_key(p) for p in self._params()}
        self._buffers_state = None
        self._hold(snap)
        snap["device.activations"] = nbytes
        self._fold(_with_totals(snap))

    def fold_moving(self, nbytes: int) -> None:
        """Fold in `nbytes` of saved activations beside the gathered copies held now, the rest as last measured.
        It runs for every tensor saved or used for backward, which is when a zero-3 unit's copy is held (it is
        resharded again before the next phase boundary), so it only updates the three peaks that can move."""
        buffers, peak = self._buffers_now(), self._peak
        peak["device.activations"] = max(peak["device.activations"], nbytes)
        peak["device.buffers"] = max(peak["device.buffers"], buffers)
        peak["device.total"] = max(peak["device.total"], self._held + nbytes + buffers)

    def _hold(self, snap: dict[str, int]) -> None:
        """Keep `snap` as what is held between phase boundaries; `_held`: its device bytes that do not move."""
        self._static = snap
        self._held = sum(snap[f"device.{c}"] for c in CATEGORIES if c not in ("activations", "buffers"))

    def reset_peak(self) -> None:
        self._peak = dict.fromkeys((*KEYS, "device.total", "host.total"), 0)
        self._fold(_with_totals({**self._static, "device.activations": self._live_activations}))

    def _fold(self, snap: dict[str, int]) -> None:
        for k, v in snap.items():
            self._peak[k] = max(self._peak.get(k, 0), v)

    # -- activations --
    @contextmanager
    def track_activations(self) -> Iterator[None]:
        """Count tensors saved for backward while inside (wrap forward; the count falls as backward frees them)."""
        self._resting = {storage_key(p) for p in self._params()}
        static = self._resting | {storage_key(b) for b in self.model.buffers()}
        self._buffers_state = None

        def pack(t: torch.Tensor) -> torch.Tensor | SavedHandle:
            if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or t.device.type == "meta":
                return t
            key = storage_key(t)
            if key in static or key == 0 or key in self.not_saved() or t._base is not None and key in self._gathered():
                return t
            entry = self._saved.setdefault(key, [local(t).untyped_storage().nbytes(), 0])
            if entry[1] == 0:
                self._live_activations += entry[0]
            entry[1] += 1
            saved = SavedHandle(t)  # autograd holds this until it frees the saved tensor
            weakref.finalize(saved, self._release, key)
            self.fold_moving(self._live_activations)
            return saved

        def unpack(x: torch.Tensor | SavedHandle) -> torch.Tensor:
            if not isinstance(x, SavedHandle):
                return x
            self.fold_moving(self._live_activations)  # backward: catches gathered and prefetched units
            return x.tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def _release(self, key: int) -> None:
        entry = self._saved.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self._live_activations -= entry[0]
            del self._saved[key]

    def _buffers_now(self) -> int:
        """_buffers, counted again only when a unit gathered or freed its parameters: it runs for every saved
        tensor, and counting walks every parameter (a tracked step of a 16-block model took 12x an untracked one
        on CPU, 5.8x on an H200 for a 1.1B model)."""
        state = [(g.is_unsharded, g._all_gather_result is not None) for g in self._groups]
        if state != self._buffers_state:
            self._buffers_state, self._buffers_bytes = state, self._buffers(self._resting)
        return self._buffers_bytes

    @property
    def live_activation_bytes(self) -> int:
        return self._live_activations


class SavedHandle:
    """What autograd keeps for a counted tensor: its release ends the count, even while the tensor itself lives on
    (a reused receive buffer, a storage another microbatch saved too).

    It holds the tensor detached: a node's own output, held with its grad_fn, would make a reference cycle through
    autograd's C++ graph (node -> saved handle -> tensor -> node) that only running the node breaks. A backward
    with retain_graph (a split backward's input pass) leaves nodes unrun, and their activations then outlived
    every step (zero-bubble schedules grew by a microbatch's share each step)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor.detach()


def _with_totals(d: dict[str, int]) -> dict[str, int]:
    out = {k: v for k, v in d.items() if not k.endswith(".total")}
    for w in PLACES:
        out[f"{w}.total"] = sum(out[f"{w}.{c}"] for c in CATEGORIES)
    return out
