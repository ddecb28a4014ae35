"""Memory model: bytes per rank, by category, at the rank's peak moment of a step.

What each piece holds under its BlockPlan (the categories, per parameter element) is piece_memory.py; the
peak of one microbatch's pass through a stage is walks.py; FSDP2's gradient buffers at each unit's reduce
are reduce_memory.py. Here they are put together over the moments of a rank's step (rank_memory).

Activations: each (stage, microbatch) a rank holds costs the bytes its pieces save
under their policy (profile.saved_bytes; "offload" and "recompute_offload" keep
none on device but a two-block window, and hold on host what the block saves, or
its input). Which ones are held comes from the schedule simulation. On top
comes a walk through the running stage's pieces (walks.py).

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
from snugfit.plan.piece_memory import (
    accumulating_grad_bytes, device_saved, gathered_bytes, host_saved, output_grad_bytes, param_state, rank_stages,
    stepping_gradients, stream_windows,
)
from snugfit.plan.plan import Plan
from snugfit.plan.schedules import partner
from snugfit.plan.reduce_memory import reduce_moments
from snugfit.plan.simulate import SimResult
from snugfit.plan.walks import stage_walk, sync_held, tracked_walk
from snugfit.profile.types import ModelProfile

FRAGMENTATION = 0.05  # allocator slack on GPUs (caching allocator rounding, fragmentation)
TRACKER_KEYS = {"parameters": "parameters", "frozen_parameters": "parameters", "comm_buffers": "buffers",
                "gradients": "gradients", "optimizer_states": "optimizer", "master_weights": "optimizer",
                "activations": "activations", "staging": "buffers", "reduce_buffers": "buffers"}


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

