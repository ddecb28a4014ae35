"""Memory model: bytes per rank, by category, at the rank's peak moment of a step.

It describes what the runtime (FSDP2 per block, runtime/offload.py) holds. Per
parameter element (c = compute-dtype bytes, g = reduce-dtype bytes, dp = data-parallel
degree; t = trainable elements: frozen ones have no gradient, master or optimizer state):
  parameters  the local shard at rest: trainable elements in the master dtype (plan.optimizer: fp32 4 each, bf16 2;
              FSDP2 casts when it gathers); frozen ones in the compute dtype, c each (no master
              to keep; their own category, frozen_parameters); /dp for zero >= 1 (FSDP2 shards at rest for zero 1-2 too: zero 1 runs
              as zero 2). offload_optimizer units keep trainable shards in c.
  comm_buffers the unsharded compute copies FSDP2 all-gathers (c per element): the root
              unit from forward through backward, zero 0-2 blocks until their backward (FSDP2
              reshards after it; zero 0 too: FSDP2 copies even on a one-rank shard group,
              though not frozen elements, which a zero-0 unit leaves out of FSDP2); a zero-3
              block while it runs, plus, in backward, the one FSDP2 prefetches for the next.
  reduce_buffers in the backward that syncs, FSDP2's reduce-scatter inputs (g per element,
              unsharded) and the head's unsharded gradient (plan.reduce_memory).
  gradients   accumulating (gradient sync off, microbatches after the first): unsharded,
              g per trainable element, whatever the ZeRO stage; after the reduction: the
              shard in the master dtype (/dp for zero >= 1), on host for offloaded units. With grad_reduce
              "microbatch" every backward reduces, so only the shard accumulates. With the step in backward
              (plan.optimizer.in_backward) a unit's shard is freed once it has stepped: no step-wide buffer, but
              the stepping unit's.
  optimizer_states  AdamW's two states (plan.optimizer: fp32, bf16, or torchao's 8- and 4-bit ones with their
              scales), /dp for zero >= 1.
  offload_optimizer: master shard, its gradient and the states on host (and the
              master cast to the compute dtype, staged for the copy back).
  offload_params (zero 3): shard, gradient shard and states on host.
  stream_states: the states on host; the update runs on the device, which holds two units' states around each
              unit's step (the one stepping, the next copied in): `stream_windows`.

Activations: each (stage, microbatch) a rank holds costs the bytes its pieces save
under their policy (profile.saved_bytes; "offload" and "recompute_offload" keep
none on device but a two-block window, and hold on host what the block saves, or
its input). Which ones are held comes from the schedule simulation. On top
comes a walk through the running stage's pieces: saved bytes of earlier pieces of
the same microbatch, the piece's input, and its measured working peak (for the last
piece this is logits and the fp32 loss).

`tracked` predicts what runtime.memory.MemoryTracker reports: it sees tensors held
(parameters, gradients, optimizer states, saved activations, gathered copies), not
transients (logits before the loss, matmul outputs consumed at once), and it samples
gradients only between passes; so its peak is the held part of a step, without the
walk's working memory. Comparing it is how tests check the model on multi-rank CPU
runs, where no allocator sees the transients.
"""

from __future__ import annotations

from dataclasses import dataclass

from snugfit.hardware.catalogue import GPU
from snugfit.plan.optimizer import master_bytes, state_bytes
from snugfit.plan.plan import BlockPlan, Plan
from snugfit.plan.policies import KEEP
from snugfit.plan.schedules import partner
from snugfit.plan.reduce_memory import reduce_moments
from snugfit.plan.simulate import SimResult
from snugfit.profile.types import DTYPE_BYTES, ModelProfile, PieceProfile, nf4_bytes

FRAGMENTATION = 0.05  # allocator slack on GPUs (caching allocator rounding, fragmentation)
TRACKER_KEYS = {"parameters": "parameters", "frozen_parameters": "parameters", "comm_buffers": "buffers",
                "gradients": "gradients", "optimizer_states": "optimizer", "master_weights": "optimizer",
                "activations": "activations", "staging": "buffers", "reduce_buffers": "buffers"}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class StagePiece:
    piece: PieceProfile
    decision: BlockPlan
    n_params: int  # parameters this rank holds for the piece (tied weights included on the last stage)
    n_trainable: int = -1  # of which trainable; -1: the piece's trainable count (+ tied weights)

    def __post_init__(self) -> None:
        if self.n_trainable < 0:
            self.n_trainable = self.piece.num_trainable + self.n_params - self.piece.num_params

    @property
    def is_block(self) -> bool:
        return self.piece.name.startswith("block")


def rank_stages(plan: Plan, prof: ModelProfile, pp_rank: int) -> dict[int, list[StagePiece]]:
    """Global stage index -> its pieces, for the stages pipeline rank pp_rank runs."""
    ranges = plan.stage_ranges()
    last = len(ranges) - 1
    out: dict[int, list[StagePiece]] = {}
    for k in plan.stages_of(pp_rank):
        blocks = ranges[k]
        pieces = [StagePiece(prof.embed, plan.root, prof.embed.num_params)] if k == 0 else []
        pieces += [StagePiece(prof.blocks[i], plan.blocks[i], prof.blocks[i].num_params) for i in blocks]
        if k == last:
            # the head needs its own copy of tied weights on another rank than the embedding's
            tied = prof.tied_params if plan.stage_rank(last) != plan.stage_rank(0) else 0
            pieces.append(StagePiece(prof.head, plan.root, prof.head.num_params + tied))
        out[k] = pieces
    return out


def wrapped_params(sp: StagePiece, dp: int) -> int:
    """Elements of the piece FSDP2 manages (runtime/sharding.py): a zero-0 unit leaves its frozen ones out, and
    a unit of one data-parallel rank its NF4 ones (torchao's all-gather hooks need a real all-gather)."""
    if sp.decision.zero == 0:
        return sp.n_trainable
    return sp.n_params - (sp.piece.quantized if dp == 1 else 0)


def gathered_bytes(plan: Plan, sp: StagePiece) -> int:
    """The unsharded copy FSDP2 all-gathers for the piece: the compute dtype, NF4 weights as they are stored (each
    matmul dequantizes its own, a transient). A model that runs unwrapped holds none in fp32, and below it the
    compute copies of its trainable parameters (runtime.precision), what a zero-0 unit gathers."""
    if plan.runs_unwrapped and plan.compute_dtype == "float32":
        return 0
    nf4 = sp.piece.quantized if sp.decision.zero > 0 and plan.dp > 1 else 0
    return (wrapped_params(sp, plan.dp) - nf4) * DTYPE_BYTES[plan.compute_dtype] + nf4_bytes(nf4)


def stored_params(plan: Plan, sp: StagePiece, trainable_bytes: int = 4) -> dict[str, int]:
    """The piece's parameters as stored, unsharded: trainable ones at `trainable_bytes` each ("parameters"),
    frozen ones in the compute dtype ("frozen_parameters"), or in NF4 where quantized (QLoRA: about 0.52 bytes
    each)."""
    out = {"parameters": sp.n_trainable * trainable_bytes}
    if sp.n_params > sp.n_trainable:
        frozen = DTYPE_BYTES[plan.compute_dtype]
        nf4 = sp.piece.quantized
        out["frozen_parameters"] = (sp.n_params - sp.n_trainable - nf4) * frozen + nf4_bytes(nf4)
    return out


def _sharded(part: dict[str, int], div: int) -> dict[str, int]:
    return {k: _ceil_div(v, div) for k, v in part.items()}


def accumulating_grad_bytes(plan: Plan, sp: StagePiece) -> int:
    """Unsharded gradient held while gradient sync is off (microbatches before the last)."""
    return sp.n_trainable * DTYPE_BYTES[plan.reduce_dtype]


def optimizer_state_bytes(plan: Plan, sp: StagePiece) -> int:
    """This rank's bytes of the piece's optimizer states (plan.optimizer), wherever they live."""
    return state_bytes(plan.optimizer, sp.piece.matrices, sp.n_trainable, plan.dp if sp.decision.zero >= 1 else 1)


def param_state(plan: Plan, sp: StagePiece) -> tuple[dict[str, int], dict[str, int]]:
    """(device, host) bytes of one piece held through a step (see the module docstring).

    Device gradients are the reduced shard; comm_buffers the compute copy a zero 0-2
    piece keeps from forward through backward (a zero-3 one gathers only while it runs).
    """
    t, d, dp = sp.n_trainable, sp.decision, plan.dp
    div = dp if d.zero >= 1 else 1
    mb, states = master_bytes(plan.optimizer), optimizer_state_bytes(plan, sp)
    if d.offload_params:  # host shards serve as master weights; the device only gathers
        host = {**_sharded(stored_params(plan, sp, mb), dp), "gradients": _ceil_div(t * mb, dp),
                "optimizer_states": states}
        if dp == 1 and sp.piece.quantized:  # NF4 weights FSDP2 leaves out (wrapped_params) stay on the device
            nf4 = nf4_bytes(sp.piece.quantized)
            host["frozen_parameters"] -= nf4
            return {"frozen_parameters": nf4}, host
        return {}, host
    dev = {"comm_buffers": gathered_bytes(plan, sp) if d.zero < 3 else 0}
    if d.offload_optimizer:  # trainable shards are stored in the compute dtype; masters, gradients, states on host
        cbytes = DTYPE_BYTES[plan.compute_dtype]
        dev.update(_sharded(stored_params(plan, sp, cbytes), div))
        host = {"master_weights": _ceil_div(t * mb, div), "gradients": _ceil_div(t * mb, div),
                "optimizer_states": states}
        if cbytes != mb:  # the masters cast for the copy back (runtime.offload's staged copies)
            host["staging"] = _ceil_div(t * cbytes, div)
        return dev, host
    dev.update(_sharded(stored_params(plan, sp, mb), div), gradients=_ceil_div(t * mb, div))
    if d.stream_states:
        return dev, {"optimizer_states": states}
    dev["optimizer_states"] = states
    return dev, {}


def unit_pieces(pieces: list[StagePiece]) -> list[list[StagePiece]]:
    """The FSDP2 units (and optimizer units) among a rank's pieces: each block, and the root pieces together."""
    return [[sp] for sp in pieces if sp.is_block] + ([root] if (root := [sp for sp in pieces if not sp.is_block])
                                                      else [])


def stream_windows(plan: Plan, pieces: list[StagePiece]) -> tuple[dict[str, int], dict[str, int]]:
    """Device bytes of streamed optimizer states at each unit's reduce and at its step, by the unit's first
    piece's name (runtime.stream_states): a unit steps with its own states, and the next streamed block's coming
    in; it has them at its reduce already where the unit before it copied them in. Units step in the order
    backward finishes them: the last block first, then the root pieces, whose states (the largest: embedding and
    head) come in only for their own step."""
    units = unit_pieces(pieces)
    order = [u for u in units if u[0].is_block][::-1] + [u for u in units if not u[0].is_block]
    states = [sum(optimizer_state_bytes(plan, sp) for sp in u) if u[0].decision.stream_states else 0 for u in order]
    at_reduce, at_step = {}, {}
    prefetched = 0
    for k, u in enumerate(order):
        name = u[0].piece.name
        at_reduce[name] = prefetched
        later = next((i for i in range(k + 1, len(order)) if states[i]), None)
        prefetched = states[later] if states[k] and later is not None and order[later][0].is_block else 0
        at_step[name] = states[k] + prefetched if states[k] else at_reduce[name]
    return at_reduce, at_step


def stepping_gradients(plan: Plan, pieces: list[StagePiece]) -> int:
    """With the step in backward, the device gradient of the unit stepping: the largest unit's reduced shard."""
    return max((sum(param_state(plan, sp)[0].get("gradients", 0) for sp in u) for u in unit_pieces(pieces)),
               default=0)


def device_saved(sp: StagePiece) -> int:
    """Bytes of one microbatch's activations this piece keeps on device until its backward."""
    policy = sp.decision.policy if sp.is_block else KEEP
    if policy.on_host:
        return 0
    return sp.piece.saved_bytes.get(policy.keeps, sp.piece.saved_bytes["keep"])


def host_saved(sp: StagePiece) -> int:
    """Bytes of one microbatch's activations this piece keeps on host until its backward: all it saves
    ("offload") or its recomputation checkpoint, the block input ("recompute_offload")."""
    if not (sp.is_block and sp.decision.policy.on_host):
        return 0
    return sp.piece.saved_bytes[sp.decision.policy.keeps]


def output_grad_bytes(plan: Plan, sp: StagePiece) -> int:
    """What a split backward (zero-bubble schedules) holds of one microbatch between its I and its W beyond the
    saved activations: the gradient of each trainable linear layer's output, which torch keeps for the weight
    GEMM (pipelining's stage_backward_input)."""
    share = sp.n_trainable / max(sp.n_params, 1)
    return int(sum(m * n for m, n, _ in sp.piece.gemms) * share) * DTYPE_BYTES[plan.compute_dtype]


@dataclass
class Walk:
    """Extra bytes while one stage computes one microbatch, above everything else held."""

    saved: int  # this microbatch's activations of the stage's earlier pieces
    working: int  # the running piece's input/output and working memory
    piece: str  # which piece peaks
    released: int = 0  # gathered copies FSDP2 has already resharded after their backward (zero 0-2 blocks)
    buffers: int = 0  # FSDP2's gradient buffers held then, in the backward that syncs (plan.reduce_memory)
    gradients: int = 0  # the gradients the stage's later pieces made in this backward (fresh_grads)


def stage_walk(pieces: list[StagePiece], backward: bool, fresh_grads: list[int] | None = None,
               released: list[int] | None = None, held: list[int] | None = None) -> Walk:
    """The peak of a forward (or backward) pass through a stage's pieces.

    fresh_grads[i]: device gradient bytes piece i creates, counted for later pieces'
    backward when gradients are not yet resident (first microbatch without pipelining).
    released[i]: the gathered copy piece i's backward frees (FSDP2 reshards after backward), gone for the
    pieces before it. held[i]: FSDP2's buffers alive during piece i's backward.
    """
    best, best_total = Walk(0, 0, pieces[0].piece.name), 0
    before = 0
    for i, sp in enumerate(pieces):
        p, keep, kept = sp.piece, sp.piece.saved_bytes["keep"], device_saved(sp)
        gone = extra = later = 0
        if backward:
            later = sum(fresh_grads[i + 1:]) if fresh_grads else 0
            gone = sum(released[i + 1:]) if released else 0
            extra = held[i] if held else 0
            working = keep + p.output_bytes + p.bwd_peak_bytes
        else:
            working = p.input_bytes + max(p.fwd_peak_bytes - (keep - kept), p.output_bytes + kept)
        if before + working + later + extra - gone > best_total:
            best = Walk(before, working, p.name, gone, extra, later)
            best_total = before + working + later + extra - gone
        before += kept
    return best


def sync_held(plan: Plan, pieces: list[StagePiece], shard_grads: dict[str, int], resident: bool) -> list[int]:
    """FSDP2's buffers during each piece's backward in a backward that syncs (plan.reduce_memory): the
    reduce-scatter input of the block reduced just before, and where every backward syncs the head's unsharded
    gradient (the root is reduced last): beyond the shard `fresh_grads` counts for it in the first backward,
    whole once the shards are `resident` (an earlier microbatch left them)."""
    if plan.runs_unwrapped:
        return [0] * len(pieces)
    out = []
    for i, sp in enumerate(pieces):
        after = pieces[i + 1] if i + 1 < len(pieces) else None
        rs = after.n_trainable * DTYPE_BYTES[plan.reduce_dtype] if after is not None and after.is_block else 0
        head = sum(max(0, DTYPE_BYTES[plan.compute_dtype] * h.n_trainable - (0 if resident else
                                                                              shard_grads[h.piece.name]))
                   for h in pieces[i + 1:] if h.piece.name == "head") if plan.reduces_every_microbatch else 0
        out.append(rs + head)
    return out


def tracked_walk(plan: Plan, pieces: list[StagePiece]) -> tuple[int, int]:
    """(saved activations, zero-3 copies) at the held peak of one microbatch through a stage.

    A zero-3 block holds its gathered copy only while it runs (and, in backward,
    the previous zero-3 block's prefetched one), on top of what this and earlier
    pieces saved; the walk's transients are not held.
    """
    best, saved, before = (0, 0), 0, 0
    for sp in pieces:
        saved += device_saved(sp)
        copy = gathered_bytes(plan, sp) if sp.is_block and sp.decision.zero == 3 else 0
        if saved + copy + before > sum(best):
            best = (saved, copy + before)
        before = copy  # prefetched while this block's backward runs
    return best


def _add(total: dict[str, int], part: dict[str, int]) -> None:
    for k, v in part.items():
        total[k] = total.get(k, 0) + v


@dataclass
class Peak:
    """What moves at a rank's busiest moment of the step, by category."""

    activations: int
    gradients: int
    gathered: int  # FSDP2's unsharded parameter copies
    reduce_buffers: int  # FSDP2's reduce-scatter inputs (and the head's unsharded gradient, between reduces)
    working: int
    piece: str  # the piece running (or being reduced)
    states: int = 0  # streamed optimizer states on the device (stepping in backward)


@dataclass
class RankMemory:
    """One rank's prediction: categories at its device peak (plus 'host:*'), notes, and the tracker's view."""

    cats: dict[str, int]
    notes: list[str]
    tracked: dict[str, int]  # MemoryTracker keys ("device.parameters", ..., "device.total", "host.total")


def rank_memory(plan: Plan, prof: ModelProfile, gpu: GPU, rank: int, sim: SimResult) -> RankMemory:
    """Categories of bytes on `rank` at its peak (device) plus 'host:*' categories, notes, and tracked peak."""
    pp_rank = plan.layout.coords(rank)[0]
    stages = rank_stages(plan, prof, pp_rank)
    all_pieces = [sp for k in sorted(stages) for sp in stages[k]]
    static: dict[str, int] = {}
    host: dict[str, int] = {}
    shard_grads: dict[str, int] = {}  # each piece's reduced gradient on device
    for sp in all_pieces:
        dev, h = param_state(plan, sp)
        shard_grads[sp.piece.name] = dev.get("gradients", 0)
        _add(static, dev)
        _add(host, h)
    reduced = static.pop("gradients", 0)
    # gathered from forward through backward: zero 0-2 blocks and the root unit (FSDP2 never reshards the root
    # after forward); zero-3 blocks while they run, plus the one prefetched in backward
    copies = static.pop("comm_buffers", 0)
    copies += sum(gathered_bytes(plan, sp) for sp in all_pieces if not sp.is_block and sp.decision.zero == 3)
    zero3 = [gathered_bytes(plan, sp) for sp in all_pieces if sp.is_block and sp.decision.zero == 3]
    fresh = {sp.piece.name: accumulating_grad_bytes(plan, sp) for sp in all_pieces}
    if plan.reduces_every_microbatch:  # each piece's gradient is reduced as it is made: only shards accumulate
        fresh = shard_grads
    in_backward = plan.optimizer.in_backward
    if in_backward and plan.num_microbatches == 1:  # each unit steps and frees its gradient once it is reduced
        fresh = dict.fromkeys(fresh, 0)
    accum = sum(fresh.values())
    at_reduce_states, at_step = stream_windows(plan, all_pieces)
    # the optimizer's moment: every reduced gradient (or, stepping in backward, the unit's that steps) and the
    # streamed states around it
    step = {"gradients": stepping_gradients(plan, all_pieces) if in_backward else reduced,
            "optimizer_states": max(at_step.values(), default=0)}
    offloaded = [host_saved(sp) for sp in all_pieces if host_saved(sp)]
    window = 2 * max(offloaded) if offloaded else 0
    per_mb = {k: sum(device_saved(sp) for sp in sps) for k, sps in stages.items()}
    if offloaded:
        m_held = max(sim.max_resident(pp_rank), 1)
        host["activations"] = m_held * sum(offloaded)
    # stage bytes held per microbatch on the partner (BPipe) come from other ranks' stages
    if plan.schedule_entry.evicts:
        held_for = rank_stages(plan, prof, partner(plan.pp, pp_rank))
        per_mb.update({k: sum(device_saved(sp) for sp in sps) for k, sps in held_for.items()})
    # between a split backward's I and W: each trainable linear layer's output gradient (not saved tensors: the
    # tracker does not see them)
    awaiting_w = {k: sum(output_grad_bytes(plan, sp) for sp in sps) for k, sps in stages.items()}

    # what each piece's backward frees for the pieces before it: a zero 0-2 block's gathered copy
    copy_of = {sp.piece.name: gathered_bytes(plan, sp) if sp.is_block and sp.decision.zero < 3 else 0
               for sp in all_pieces}
    walks = {}
    for k, sps in stages.items():
        released = [copy_of[sp.piece.name] for sp in sps]
        made = [fresh[sp.piece.name] for sp in sps]
        walks[(k, "F", False)] = walks[(k, "F", True)] = stage_walk(sps, False)
        walks[(k, "B", False)] = stage_walk(sps, True, made, released)
        walks[(k, "B", True)] = stage_walk(sps, True, None, released)
        walks[(k, "sync", False)] = stage_walk(sps, True, made, released, sync_held(plan, sps, fresh, False))
        walks[(k, "sync", True)] = stage_walk(sps, True, None, released, sync_held(plan, sps, fresh, True))
        walks[(k, "tracked")] = tracked_walk(plan, sps)
    gathered = copies + 2 * max(zero3, default=0)
    best_total, best, tracked_best, tracked_at = -1, None, -1, None
    grads_resident = False  # gradients exist from the rank's first backward on
    last_backward_held = 0
    for snap in sim.snapshots[pp_rank]:
        ev = snap.event
        g = accum if grads_resident else 0
        syncs = plan.grad_reduce == "microbatch" or ev.mb == plan.num_microbatches - 1
        makes_grads = ev.kind in ("B", "W")  # a split backward's I makes only the input's gradient
        kind = "F" if ev.kind == "F" else "sync" if makes_grads and syncs else "B"
        walk = walks[(ev.stage, kind, grads_resident)]
        held = sum(per_mb[s] * n for s, n in snap.resident.items() if n)
        pending = sum(awaiting_w[s] * n for s, n in (snap.awaiting_weight or {}).items() if n)
        total = (held + pending + walk.saved + walk.working + g + walk.gradients + gathered - walk.released
                 + walk.buffers)
        if total > best_total:
            best_total, best = total, Peak(held + pending + walk.saved + window, g + walk.gradients,
                                           gathered - walk.released,
                                           walk.buffers, walk.working, walk.piece)
        saved, copy = walks[(ev.stage, "tracked")]
        if held + saved + copies + copy + g > tracked_best:
            tracked_best, tracked_at = held + saved + copies + copy + g, (held + saved, copies + copy, g)
        grads_resident = grads_resident or makes_grads
        last_backward_held = held if makes_grads else last_backward_held
    # the copies of reduce: FSDP2 reshards a unit before reducing it, and has prefetched the next zero-3 block
    order = [sp.piece.name for sp in all_pieces]
    root_copy = sum(gathered_bytes(plan, sp) for sp in all_pieces if not sp.is_block)
    for m in reduce_moments(plan, stages, {sp.piece.name: device_saved(sp) for sp in all_pieces}):
        start = order.index(m.unit) if m.unit.startswith("block") else 0
        at_reduce = copies - sum(copy_of[n] for n in order[start:]) + max(zero3, default=0)
        if not m.unit.startswith("block"):  # the root unit too is resharded before its reduce (reshard_after_backward)
            at_reduce -= root_copy
        # stepping in backward, the unit steps right after its reduce: its own gradients copied in and freed, its
        # shard and the streamed states beside it
        moments = [(m.gradients, at_reduce_states.get(m.unit, 0) if in_backward else 0)]
        if in_backward:
            moments.append((m.gradients - m.own + m.shard, at_step.get(m.unit, 0)))
        for grads, states in moments:
            total = last_backward_held + m.saved_before + grads + m.reduce_input + at_reduce + states
            if total > best_total:
                best_total, best = total, Peak(last_backward_held + m.saved_before + window, grads, at_reduce,
                                               m.reduce_input, 0, m.unit, states)
        if in_backward:  # the tracker samples each unit's step (FSDP2's reduce buffers are out of its sight)
            held = {"activations": last_backward_held + m.saved_before, "gradients": moments[-1][0],
                    "buffers": at_reduce, "optimizer_states": moments[-1][1]}
            if sum(held.values()) > sum(step.values()):
                step = held
    cats = dict(static)
    notes: list[str] = []
    if not in_backward and sum(step.values()) >= best_total + window:
        _add(cats, step)
        notes.append(f"rank {rank}: peak at the optimizer step")
    else:
        cats.update(gradients=best.gradients, activations=best.activations, comm_buffers=best.gathered,
                    reduce_buffers=best.reduce_buffers)
        cats["logits_loss" if best.piece == "head" else "working"] = best.working
        cats["optimizer_states"] = cats.get("optimizer_states", 0) + best.states
    if gpu.name != "cpu":
        cats["reserve"] = gpu.context_bytes + int(FRAGMENTATION * sum(cats.values()))
    cats = {k: v for k, v in cats.items() if v}
    cats.update({f"host:{k}": v for k, v in host.items() if v})
    return RankMemory(cats, notes, _tracked(static, host, step, tracked_at))


def _tracked(static: dict[str, int], host: dict[str, int], step: dict[str, int],
             at: tuple[int, int, int]) -> dict[str, int]:
    """The MemoryTracker's peak: the held part of the step's busiest moment, or the optimizer step's."""
    saved, copy, g = at
    moving = {"activations": saved, "buffers": copy, "gradients": g}
    if sum(step.values()) >= saved + copy + g:
        moving = dict(step)
    out: dict[str, int] = {}
    # offloaded activations live under their policy's own saved-tensor hooks, out of the tracker's sight
    host = {k: v for k, v in host.items() if k != "activations"}
    for place, cats in (("device", static), ("device", moving), ("host", host)):
        for k, v in cats.items():
            key = f"{place}.{TRACKER_KEYS.get(k, k)}"
            out[key] = out.get(key, 0) + v
    for place in ("device", "host"):
        out[f"{place}.total"] = sum(v for k, v in out.items() if k.startswith(place + "."))
    return out


def device_bytes(cats: dict[str, int]) -> int:
    return sum(v for k, v in cats.items() if not k.startswith("host:"))


def host_bytes(cats: dict[str, int]) -> int:
    return sum(v for k, v in cats.items() if k.startswith("host:"))
