"""Record one training step of a model, piece by piece, without real memory.

The model runs under FakeTensorMode on a fake "cpu" device (so kernels are chosen
as on a real device: SDPA takes the flash path and keeps O(s), not the s^2
scores a meta-device decomposition would). A dispatch mode sees every aten op,
module hooks say which piece (embedding, block i, last piece) is running, and a
saved-tensors hook sees what autograd keeps. Per piece and phase we record:

- FLOPs of matmul-like ops (torch's flop formulas; SDPA on CPU added here),
- bytes read + written by the other, memory-bound ops that make a tensor (a roofline's second term),
- bytes of the tensors its ops allocate that a CPU rank's allocator maps fresh (runtime.host_alloc), paged in at
  first touch,
- bytes saved for backward, each storage counted once, parameters and buffers skipped,
- the peak of live tensor bytes above the live bytes at the piece's start,
- per selective recomputation policy: bytes of the op outputs it keeps (model.recompute.keeps_output),
- a block's MLP alone (`PhaseStats.mlp`, model.tiled_mlp finds it): live bytes before, at, inside and after it, and
  what it saves, so the memory model can divide its intermediates by a tiled MLP's tiles (PieceProfile.tiled).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from snugfit.model.recompute import GEMM_OPS, SELECTIVE_POLICIES, keeps_output
from snugfit.model.tiled_mlp import mlp_of
from snugfit.hardware.catalogue import MMAP_THRESHOLD_BYTES
from snugfit.profile.grouped import GROUPED_MM
_SDPA_CPU = {"aten._scaled_dot_product_flash_attention_for_cpu": 1.0,
             "aten._scaled_dot_product_flash_attention_for_cpu_backward": 2.5}


# views whose schema does not say so (matmul folds 3-D inputs to 2-D and back through them): they move nothing
_NO_TRAFFIC = frozenset({"aten._unsafe_view"})
# the two matrices of a 2-D matmul, by argument position: what linear layers run (3-D inputs folded to 2-D)
_GEMM_OPERANDS = {"aten.mm": (0, 1), "aten.addmm": (1, 2)}


@dataclass
class PhaseStats:
    flops: float = 0.0
    mem_bytes: float = 0.0  # traffic of non-matmul ops
    fresh_bytes: float = 0.0  # of the tensors its ops allocate, those of MMAP_THRESHOLD_BYTES or more (OpCost)
    ops: int = 0  # operators dispatched: each costs a fixed launch/dispatch time, whatever the batch
    peak_delta: int = 0  # peak live bytes above the live bytes at the piece's start
    gemms: list[list[int]] = field(default_factory=list)  # 2-D matmuls (linear layers) as [M, N, K]
    expert_gemms: list[int] = field(default_factory=list)  # of gemms, the indices of grouped GEMMs' groups (experts)
    # a block's MLP (window from its call to its output; backward: from its output's gradient to its input's), in
    # bytes above the piece's start: "before"/"after" the peak outside it, "at" live at its start, "peak" inside
    # it; its "flops", "mem_bytes", "ops"; forward: its "out"put's bytes, the bytes it "saved" for backward that it
    # made itself, whether its input was saved ("input_kept")
    mlp: dict[str, float] = field(default_factory=dict)


@dataclass
class PieceRecord:
    fwd: PhaseStats = field(default_factory=PhaseStats)
    bwd: PhaseStats = field(default_factory=PhaseStats)
    saved: int = 0
    selective_extra: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SELECTIVE_POLICIES, 0))
    input_bytes: int = 0
    output_bytes: int = 0
    head_dim: int = 0  # of the attention it ran


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _sdpa_flops(args, kwargs, scale: float) -> float:
    q, k = args[0], args[1]
    b, h, sq, d = q.shape
    # forward and backward kernels take is_causal at different positions; it is their only bool
    causal = kwargs.get("is_causal", next((a for a in args if isinstance(a, bool)), False))
    return scale * 4.0 * b * h * sq * k.shape[-2] * d * (0.5 if causal else 1.0)


@dataclass
class OpCost:
    """What one operator costs in a roofline: matmul FLOPs ("gemm", with its [M, N, K] for linear layers),
    attention FLOPs ("attention"), or the bytes a memory-bound operator reads and writes ("memory"); "none": a
    view or metadata query, which moves nothing. fresh_bytes: of the tensors it allocates (not views, not written in
    place), those of MMAP_THRESHOLD_BYTES or more, which a CPU rank's allocator maps afresh for each one
    (runtime.host_alloc) and the kernel pages in as the operator first writes them."""

    kind: str
    flops: float = 0.0
    mem_bytes: float = 0.0
    gemm: list[int] | None = None
    fresh_bytes: float = 0.0
    groups: int = 1  # a grouped GEMM's: `gemm` is each group's, at an equal share of the rows


def op_cost(func, args, kwargs, out) -> OpCost:
    """The roofline cost of one dispatched operator: one classification for the profile (StepRecorder) and for
    what profile-hardware measures in a real step (calibrate.hardware.step_efficiencies)."""
    name = str(func._overloadpacket)
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    makes = bool(outs) and name not in _NO_TRAFFIC and not any(r.alias_info is not None for r in func._schema.returns)
    fresh = sum(n for n in map(_tensor_bytes, outs) if n >= MMAP_THRESHOLD_BYTES) if makes else 0
    # MoE experts (model.moe's op, transformers' aten one; torch has no flop formula for them): 2 M N K, and at
    # balanced routing G GEMMs of M/G rows
    if name in ("snugfit.grouped_mm", GROUPED_MM):
        a, b, offs = args[:3]
        groups = offs.shape[0]
        if b.dim() == 3:  # (M, K) x (G, K, N)
            m, k, n = a.shape[0], a.shape[1], b.shape[-1]
            return OpCost("gemm", 2.0 * m * n * k, gemm=[-(-m // groups), n, k], groups=groups, fresh_bytes=fresh)
        return OpCost("gemm", 2.0 * a.shape[0] * a.shape[1] * b.shape[1], fresh_bytes=fresh)  # the weights' gradient
    if func._overloadpacket in flop_registry:
        gemm = None
        if name in _GEMM_OPERANDS:
            a, b = (args[i] for i in _GEMM_OPERANDS[name])
            gemm = [a.shape[0], b.shape[1], a.shape[1]]
        return OpCost("gemm", flop_registry[func._overloadpacket](*args, **kwargs, out_val=out), gemm=gemm,
                      fresh_bytes=fresh)
    if name in _SDPA_CPU:
        return OpCost("attention", _sdpa_flops(args, kwargs, _SDPA_CPU[name]), fresh_bytes=fresh)
    if makes:
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        return OpCost("memory", mem_bytes=sum(_tensor_bytes(t) for t in ins + outs), fresh_bytes=fresh)
    return OpCost("none")


class StepRecorder(TorchDispatchMode):
    """Attribute ops, saved tensors and live memory to the piece that runs them."""

    def __init__(self, skip_storages: set[int]):
        super().__init__()
        self.skip = skip_storages  # parameters and buffers: counted as parameters, not activations
        self.pieces: dict[str, PieceRecord] = {}
        self.current: tuple[str, str] | None = None
        self.live = 0
        self.base = 0
        self.peak = 0
        self._tracked: set[int] = set()
        self._saved: set[int] = set()
        self._selective: set[int] = set()
        self._gemms = 0  # in the current piece's forward, as the selective policies count them
        self._window: str = ""  # "in" a block's MLP, "after" it, "" neither (PhaseStats.mlp)
        self._window_peak = 0
        self._made: set[int] = set()  # storages the MLP made in its forward
        self._mlp_input = 0  # the MLP input's storage

    # -- piece boundaries --
    def enter(self, piece: str, phase: str) -> None:
        self._close()
        self.pieces.setdefault(piece, PieceRecord())
        self.current = (piece, phase)
        self._gemms = 0
        self.base = self.peak = self.live

    def _close(self) -> None:
        if self.current is not None:
            piece, phase = self.current
            stats = getattr(self.pieces[piece], phase)
            stats.peak_delta = max(stats.peak_delta, self.peak - self.base)
            if self._window == "after":
                stats.mlp["after"] = self._window_peak - self.base
        self._window = ""

    # -- a block's MLP --
    def mlp_enter(self, x: torch.Tensor | None = None) -> None:
        """The block's MLP starts (forward: its input x; backward: its output's gradient arrived)."""
        if self.current is None or not self.current[0].startswith("block"):
            return
        stats = getattr(self.pieces[self.current[0]], self.current[1])
        stats.mlp.update(before=self.peak - self.base, at=self.live - self.base, flops=stats.flops,
                         mem_bytes=stats.mem_bytes, ops=stats.ops)
        self._window, self._window_peak, self._made = "in", self.live, set()
        self._mlp_input = x.untyped_storage()._cdata if x is not None else 0

    def mlp_leave(self, out: torch.Tensor | None = None) -> None:
        """The block's MLP ends (forward: its output; backward: its input's gradient made)."""
        if self._window != "in":
            return
        stats = getattr(self.pieces[self.current[0]], self.current[1])
        m = stats.mlp
        m.update(peak=self._window_peak - self.base, flops=stats.flops - m["flops"],
                 mem_bytes=stats.mem_bytes - m["mem_bytes"], ops=stats.ops - m["ops"])
        if out is not None:
            m.update(out=_tensor_bytes(out), input_kept=float(self._mlp_input in self._saved))
        self._window, self._window_peak = "after", self.live

    def finish(self) -> None:
        self._close()
        self.current = None

    # -- live memory --
    def _track(self, t: torch.Tensor) -> int:
        st = t.untyped_storage()
        key = st._cdata
        if key in self._tracked or key in self.skip:
            return 0
        nbytes = st.nbytes()
        self._tracked.add(key)
        self.live += nbytes
        if self._window == "in" and self.current[1] == "fwd":
            self._made.add(key)
        weakref.finalize(st, self._free, key, nbytes)
        return nbytes

    def _free(self, key: int, nbytes: int) -> None:
        # storage addresses are reused once freed: forget them everywhere
        self._tracked.discard(key)
        self._saved.discard(key)
        self._selective.discard(key)
        self.live -= nbytes

    # -- saved tensors --
    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if self.current and self.current[1] == "fwd" and key not in self.skip and key not in self._saved:
            self._saved.add(key)
            self.pieces[self.current[0]].saved += t.untyped_storage().nbytes()
            if self._window == "in" and key in self._made:
                mlp = self.pieces[self.current[0]].fwd.mlp
                mlp["saved"] = mlp.get("saved", 0) + t.untyped_storage().nbytes()
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.current is None:
            return out
        piece, phase = self.current
        rec = self.pieces[piece]
        stats = getattr(rec, phase)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        # an op that makes no tensor is a metadata query the fake tensors answer (prim.device: two of every three
        # ops counted before); eager runs never dispatch it, so it costs no time there
        stats.ops += bool(outs)
        cost = op_cost(func, args, kwargs, out)
        stats.flops += cost.flops
        stats.mem_bytes += cost.mem_bytes
        stats.fresh_bytes += cost.fresh_bytes
        if cost.gemm is not None:
            if cost.groups > 1:  # a grouped GEMM: the experts'
                stats.expert_gemms.extend(range(len(stats.gemms), len(stats.gemms) + cost.groups))
            stats.gemms.extend([cost.gemm] * cost.groups)
        if cost.kind == "attention":
            rec.head_dim = args[0].shape[-1]
        for t in outs:
            self._track(t)
        if phase == "fwd":
            self._gemms += func in GEMM_OPS
            kept_by = [p for p in SELECTIVE_POLICIES if keeps_output(p, func, self._gemms)]
            for t in outs if kept_by else ():
                key = t.untyped_storage()._cdata
                if key not in self._selective:
                    self._selective.add(key)
                    for policy in kept_by:
                        rec.selective_extra[policy] += t.untyped_storage().nbytes()
        self.peak = max(self.peak, self.live)
        if self._window:
            self._window_peak = max(self._window_peak, self.live)
        return out


@dataclass
class ModelParts:
    """Where the pieces of a model start, and how to run it to a loss.

    embed: the embedding piece's modules (the first one starts the piece); blocks: the
    repeated layers; last: the last piece's modules, in order (final norm or head first).
    """

    embed: list[nn.Module]
    blocks: list[nn.Module]
    last: list[nn.Module]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _first_float_bytes(args, kwargs) -> int:
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return _tensor_bytes(t)
    return 0


def record_step(model: nn.Module, parts: ModelParts, tokens: torch.Tensor,
                held: tuple[torch.Tensor, ...] = ()) -> dict[str, PieceRecord]:
    """Run forward + backward once under a StepRecorder; returns records keyed embed, block.i, head. held: tensors
    made before the step that the model reads and saves (packed documents' mask), charged by the caller, not to the
    pieces (as parameters and buffers are not)."""
    skip = {p.untyped_storage()._cdata for p in model.parameters()}
    skip |= {b.untyped_storage()._cdata for b in [*model.buffers(), *held]}
    rec = StepRecorder(skip)
    named = [("embed", parts.embed[0])] + [(f"block.{i}", b) for i, b in enumerate(parts.blocks)]
    named.append(("head", parts.last[0]))
    handles = []

    def fwd_pre(name):
        def hook(module, args, kwargs):
            rec.enter(name, "fwd")
            rec.pieces[name].input_bytes = _first_float_bytes(args, kwargs)
        return hook

    def fwd_post(name):
        def hook(module, args, kwargs, output):
            # output of a block = input of the next piece; the last piece's output is the loss (tiny)
            rec.pieces[name].output_bytes = _first_float_bytes((output,), {})
        return hook

    def bwd_pre(name):
        return lambda module, grad_output: rec.enter(name, "bwd")

    def mlp_pre(module, args):
        x = args[0]
        rec.mlp_enter(x)
        if x.requires_grad:
            x.register_hook(lambda grad: rec.mlp_leave())  # its gradient made: the MLP's backward is done

    def mlp_post(module, args, output):
        if isinstance(output, tuple):  # some MoE MLPs (gpt-oss) return (hidden states, router scores)
            output = output[0]
        rec.mlp_leave(output)
        if output.requires_grad:
            output.register_hook(lambda grad: rec.mlp_enter())

    for block in parts.blocks:
        if (found := mlp_of(block)) is not None:
            mlp = getattr(*found)
            handles += [mlp.register_forward_pre_hook(mlp_pre), mlp.register_forward_hook(mlp_post)]
    for name, mod in named:
        handles.append(mod.register_forward_pre_hook(fwd_pre(name), with_kwargs=True))
        if name.startswith("block"):
            handles.append(mod.register_forward_hook(fwd_post(name), with_kwargs=True))
        if name != "head":
            handles.append(mod.register_full_backward_pre_hook(bwd_pre(name)))
    try:
        with rec, torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")  # embedding: int inputs
            loss = parts.loss(tokens, tokens)
            rec.enter("head", "bwd")
            loss.backward()
            rec.finish()
    finally:
        for h in handles:
            h.remove()
    embed_out = rec.pieces["block.0"].input_bytes if parts.blocks else 0
    rec.pieces["embed"].output_bytes = embed_out
    return rec.pieces
