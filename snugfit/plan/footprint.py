"""A rank's device memory at the named moments of its step, by category: forward, backward, the gradient
reduce, the optimizer step, and start-up.

Exact, for a plan (`rank_footprint`, which memory.rank_memory and so estimate() read): what each piece holds
under its BlockPlan is piece_memory.py, the peak of one microbatch's pass through a stage walks.py, FSDP2's
gradient buffers at each unit's reduce reduce_memory.py; here they are put together at each moment of the
schedule's simulation, and the busiest of each kind is kept.

Fast, for the search (`stage_moments`): a stage is priced as its root unit plus n alike blocks, each under one
option (stage_costs.Cost), and two moments bound it: the passes (the largest piece's working peak above what is
held) and the root's reduce (the backward's last moment, when the root's unsharded gradients and reduce-scatter
input sit beside every block's reduced shard). CostModel.need and solve._solve_uniform read it; the knapsack
(knapsack.py) and CostModel.room add up the same terms block by block. The once-per-stage buffers options need
are `StageBuffers`, named. Pure: no torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from typing import Protocol

from snugfit.plan.optimizer import state_bytes
from snugfit.plan.piece_memory import (
    StagePiece, accumulating_grad_bytes, device_saved, gathered_bytes, host_saved, output_grad_bytes, param_state,
    prefetched_part, rank_stages, stepping_gradients, stream_windows,
)
from snugfit.plan.plan import BlockPlan, Plan
from snugfit.plan.reduce_memory import reduce_moments, suffix_sums
from snugfit.plan.schedules import partner
from snugfit.plan.simulate import SimResult
from snugfit.plan.walks import stage_walk, sync_held, tracked_walk
from snugfit.profile.types import DTYPE_BYTES, ModelProfile

MOMENTS = ("forward", "backward", "reduce", "step")  # a step's moments, in order; start-up comes before them


@dataclass(frozen=True)
class StageBuffers:
    """Device buffers a stage holds once whichever blocks need them, two blocks' worth of each (the one in use and
    the next), sized on the typical block as rank_footprint counts them; the states unsharded (an upper bound).
    `prefetched` is no buffer of its own: the part of zero3_copies still held at the root's reduce."""

    zero3_copies: float = 0.0  # ZeRO-3: the running block's gathered copy and the unit FSDP2 prefetches of the next
    activation_window: float = 0.0  # a policy whose whole saved activations wait on host: two blocks in flight
    checkpoint_window: float = 0.0  # one whose recomputation checkpoint waits on host
    states_window: float = 0.0  # streamed optimizer states: the stepping unit's and the next one's
    prefetched: float = 0.0  # ZeRO-3: the unit FSDP2 has prefetched of a block while the root is reduced

    @classmethod
    def of_block(cls, plan: Plan, sp: StagePiece) -> "StageBuffers":
        """On block `sp` of `plan` (the search's stub: its ep, compute dtype and optimizer), the copies by parameter
        count; rank_footprint's gathered copies the same way: the block whole and the part it prefetches of the next
        (piece_memory.prefetched_part), two whole blocks where a block is one FSDP2 unit."""
        blk, dtype = sp.piece, DTYPE_BYTES[plan.compute_dtype]
        states = state_bytes(plan.optimizer, blk.matrices, blk.num_trainable, 1)
        prefetched = prefetched_part(plan, sp).n_params * dtype
        return cls(blk.num_params * dtype + prefetched, 2 * blk.saved_bytes["keep"],
                   2 * blk.saved_bytes["recompute"], 2 * states, prefetched)

    @staticmethod
    @functools.lru_cache(maxsize=1 << 12)  # asked for every option of every stage the search weighs
    def needs(o: BlockPlan, root: bool = False) -> frozenset[str]:
        """The buffers an option needs (the root unit's: the ZeRO-3 copies only)."""
        return _needs(o.zero == 3, o.policy.on_host and not root, bool(o.policy.recomputes),
                      o.placement.streams_states and not root)

    def bytes_of(self, names: frozenset[str]) -> float:
        return sum(getattr(self, name) for name in names)

    def extra(self, o: BlockPlan) -> float:
        """The bytes of the buffers a block option needs."""
        return self.bytes_of(self.needs(o))

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def subsets(within: frozenset[str]) -> tuple[frozenset[str], ...]:
        """Every set of buffers drawn from `within`, in one fixed order (the knapsack solves one table for each)."""
        names = [f.name for f in fields(StageBuffers)]
        every = (frozenset(n for j, n in enumerate(names) if mask >> j & 1) for mask in range(1 << len(names)))
        return tuple(chosen for chosen in every if chosen <= within)


@functools.lru_cache(maxsize=None)
def _needs(zero3: bool, on_host: bool, recomputes: bool, streams: bool) -> frozenset[str]:
    """StageBuffers.needs, once per kind of option (the search asks for it per option and solve)."""
    return frozenset(name for name, needed in (
        ("zero3_copies", zero3), ("activation_window", on_host and not recomputes),
        ("checkpoint_window", on_host and recomputes), ("states_window", streams)) if needed)


class Held(Protocol):
    """What stage_costs.Cost gives the footprint: a piece's device bytes under one option."""

    static: int
    grads_reduced: int
    at_root: int

    def mem(self, resident: float, m: int) -> float: ...


@dataclass(frozen=True)
class StageMoments:
    """A stage's device bytes (the reserve left out) at the moments that bound it."""

    passes: float  # forward and backward: held bytes, the once-per-stage buffers and the working peak
    root_reduce: float  # the root unit's reduce, the backward's last moment
    static: float  # of both, what is held all step

    @property
    def peak(self) -> float:
        return max(self.passes, self.root_reduce)


def stage_moments(blocks: int, block: Held, roots: list[Held], *, resident: float, m: int, walk: float,
                  buffers: float, root_reduce: float, prefetched: float) -> StageMoments:
    """Stage memory with `blocks` alike blocks (`block`) and the root pieces' costs (`roots`, none off the first
    and last stages): `walk` the working peak (StageCosts.working_peak), `buffers` the once-per-stage buffers'
    bytes, `root_reduce` the root's unsharded gradients and reduce input at its reduce (StageCosts.root_reduce),
    `prefetched` the ZeRO-3 block copy FSDP2 holds then."""
    static = sum(r.static for r in roots) + blocks * block.static
    passes = walk + sum(r.mem(resident, m) for r in roots) + blocks * block.mem(resident, m) + buffers
    at_reduce = (static + blocks * block.grads_reduced + root_reduce + sum(r.at_root for r in roots)
                 + prefetched)
    return StageMoments(passes, at_reduce, static)


def _add(total: dict[str, int], part: dict[str, int]) -> None:
    for k, v in part.items():
        total[k] = total.get(k, 0) + v


def largest_tensor_bytes(prof: ModelProfile) -> int:
    """fp32 bytes of the model's largest weight (the embedding, the head or an MLP matrix): what a rank holds
    beyond its shards while they are filled, one whole tensor at a time (runtime.apply.read_weights)."""
    c = prof.config
    hidden = prof.summary()["hidden"] or 0
    ffn = c.get("ffn_dim") or c.get("intermediate_size") or c.get("n_inner") or 4 * hidden
    return 4 * hidden * max(c.get("vocab_size") or 0, ffn)


@dataclass
class Moment:
    """What a rank holds at one moment beyond its static bytes, by category, and which piece runs (or is
    reduced) then."""

    cats: dict[str, int]
    piece: str = ""
    total: int = field(init=False)

    def __post_init__(self) -> None:
        self.total = sum(self.cats.values())


@dataclass
class RankFootprint:
    """One rank's device memory through its step: the static bytes, the busiest moment of each kind (MOMENTS;
    "step" is there where the optimizer steps after the backward), start-up, and host bytes."""

    static: dict[str, int]  # device bytes held all step (parameters, states, masters, the root's gathered copy)
    moments: dict[str, Moment]
    startup: Moment  # before the first step: the shards, and one whole fp32 tensor while they are filled
    host: dict[str, int]
    peak: str  # the moment of the device peak
    # the MemoryTracker's view (held tensors only): the busiest pass, and the optimizer's moment
    tracked_pass: dict[str, int]
    tracked_step: dict[str, int]


def rank_footprint(plan: Plan, prof: ModelProfile, pp_rank: int, sim: SimResult, staging: int) -> RankFootprint:
    """The footprint of a rank of pipeline rank pp_rank; prof at the plan's micro-batch size, `staging` the
    model's largest tensor in fp32 (`largest_tensor_bytes`)."""
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
    # after forward); a zero-3 block while it runs, whole, plus in backward the unit it prefetches of the next
    copies = static.pop("comm_buffers", 0)
    copies += sum(gathered_bytes(plan, sp) for sp in all_pieces if not sp.is_block and sp.decision.zero == 3)
    zero3 = [sp for sp in all_pieces if sp.is_block and sp.decision.zero == 3]
    running = max((gathered_bytes(plan, sp) for sp in zero3), default=0)
    prefetched = max((gathered_bytes(plan, prefetched_part(plan, sp)) for sp in zero3), default=0)
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
    window = 2 * max(offloaded) if offloaded else 0  # offloaded activations in flight: two blocks' on the device
    per_mb = {k: sum(device_saved(sp) for sp in sps) for k, sps in stages.items()}
    if offloaded:
        host["activations"] = max(sim.max_resident(pp_rank), 1) * sum(offloaded)
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
        forward = stage_walk(sps, False)
        for resident in (False, True):  # whether earlier microbatches left their gradients
            walks["forward", k, resident] = forward
            walks["backward", k, resident] = stage_walk(sps, True, None if resident else made, released)
            walks["sync", k, resident] = stage_walk(sps, True, None if resident else made, released,
                                                    sync_held(plan, sps, fresh, resident))
    gathered = copies + running + prefetched
    tracked_of = {k: tracked_walk(plan, sps) for k, sps in stages.items()}
    best: dict[str, Moment] = {}
    first_at: dict[str, int] = {}  # where in the step each kind's busiest moment is: the earliest wins a tie
    tracked_pass, tracked_total = {}, -1

    def busier(name: str, total: int) -> bool:
        return name not in best or total > best[name].total

    grads_resident = False  # gradients exist from the rank's first backward on
    last_backward_held = 0
    # snapshots alike in what they hold share its dicts (simulate), and one alike to an earlier one in those and in
    # its walk is no busier than it (the earliest wins a tie): 1F1B at 256 microbatches repeats a few all step
    held_of: dict[int, int] = {}  # by the id of a snapshot's resident counts
    seen: set[tuple] = set()
    for at, snap in enumerate(sim.snapshots[pp_rank]):
        ev = snap.event
        g = accum if grads_resident else 0
        syncs = plan.grad_reduce == "microbatch" or ev.mb == plan.num_microbatches - 1
        makes_grads = ev.kind in ("B", "W")  # a split backward's I makes only the input's gradient
        kind = "forward" if ev.kind == "F" else "sync" if makes_grads and syncs else "backward"
        held = held_of.get(id(snap.resident))
        if held is None:
            held = held_of[id(snap.resident)] = sum(per_mb[s] * n for s, n in snap.resident.items() if n)
        alike = (kind, ev.stage, grads_resident, id(snap.resident), id(snap.awaiting_weight))
        if alike not in seen:
            seen.add(alike)
            walk = walks[kind, ev.stage, grads_resident]
            pending = sum(awaiting_w[s] * n for s, n in (snap.awaiting_weight or {}).items() if n)
            name = "forward" if kind == "forward" else "backward"
            activations = held + pending + walk.saved + window
            total = activations + walk.working + g + walk.gradients + gathered - walk.released + walk.buffers
            if busier(name, total):
                best[name], first_at[name] = Moment({
                    "gradients": g + walk.gradients, "activations": activations,
                    "comm_buffers": gathered - walk.released, "reduce_buffers": walk.buffers,
                    "logits_loss" if walk.piece == "head" else "working": walk.working}, walk.piece), at
            saved, copy = tracked_of[ev.stage]
            if held + saved + copies + copy + g > tracked_total:
                tracked_total = held + saved + copies + copy + g
                tracked_pass = {"activations": held + saved, "comm_buffers": copies + copy, "gradients": g}
        grads_resident = grads_resident or makes_grads
        last_backward_held = held if makes_grads else last_backward_held
    # the copies of reduce: FSDP2 reshards a unit before reducing it, and has prefetched (a unit of) the next
    # zero-3 block
    order = [sp.piece.name for sp in all_pieces]
    copies_from = dict(zip(order, suffix_sums([copy_of[n] for n in order])))  # of the pieces from each on
    root_copy = sum(gathered_bytes(plan, sp) for sp in all_pieces if not sp.is_block)
    tracked_step = step
    for at, m in enumerate(reduce_moments(plan, stages, {sp.piece.name: device_saved(sp) for sp in all_pieces}),
                           start=len(sim.snapshots[pp_rank])):
        at_reduce = copies - copies_from[m.unit if m.unit.startswith("block") else order[0]] + prefetched
        if not m.unit.startswith("block"):  # the root unit too is resharded before its reduce (reshard_after_backward)
            at_reduce -= root_copy
        # stepping in backward, the unit steps right after its reduce: its own gradients copied in and freed, its
        # shard and the streamed states beside it
        moments = [(m.gradients, at_reduce_states.get(m.unit, 0) if in_backward else 0)]
        if in_backward:
            moments.append((m.gradients - m.own + m.shard, at_step.get(m.unit, 0)))
        for grads, states in moments:
            activations = last_backward_held + m.saved_before + window
            if busier("reduce", activations + grads + m.reduce_input + at_reduce + states):
                best["reduce"], first_at["reduce"] = Moment({
                    "gradients": grads, "activations": activations, "comm_buffers": at_reduce,
                    "reduce_buffers": m.reduce_input, "optimizer_states": states}, m.unit), at
        if in_backward:  # the tracker samples each unit's step (FSDP2's reduce buffers are out of its sight)
            held = {"activations": last_backward_held + m.saved_before, "gradients": moments[-1][0],
                    "comm_buffers": at_reduce, "optimizer_states": moments[-1][1]}
            if sum(held.values()) > sum(tracked_step.values()):
                tracked_step = held
    peak = min(best, key=lambda name: (-best[name].total, first_at[name]))
    if not in_backward:
        best["step"] = Moment(step)
        if best["step"].total >= best[peak].total:
            peak = "step"
    startup = Moment({"parameters": static.get("parameters", 0),
                      "frozen_parameters": static.get("frozen_parameters", 0),
                      "staging": staging})
    return RankFootprint(static, {k: best[k] for k in MOMENTS if k in best}, startup, host, peak, tracked_pass,
                         tracked_step)
