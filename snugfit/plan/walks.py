"""Memory model, per stage: the peak of one microbatch's pass through a stage's pieces.

On top of what a rank holds through the step comes a walk through the running stage's pieces: saved bytes
of earlier pieces of the same microbatch, the piece's input, and its measured working peak (for the last
piece this is logits and the fp32 loss); in a backward that syncs, FSDP2's reduce buffers beside it
(sync_held). tracked_walk is the same pass as runtime.memory.MemoryTracker sees it (held tensors only).
"""

from __future__ import annotations

from dataclasses import dataclass

from snugfit.plan.piece_memory import StagePiece, device_saved, gathered_bytes, prefetched_part
from snugfit.plan.plan import Plan
from snugfit.profile.types import DTYPE_BYTES


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
    what FSDP2 prefetches of the previous zero-3 block: piece_memory.prefetched_part), on top of what this and
    earlier pieces saved; the walk's transients are not held.
    """
    best, saved, before = (0, 0), 0, 0
    for sp in pieces:
        saved += device_saved(sp)
        copy = gathered_bytes(plan, sp) if sp.is_block and sp.decision.zero == 3 else 0
        if saved + copy + before > sum(best):
            best = (saved, copy + before)
        before = gathered_bytes(plan, prefetched_part(plan, sp)) if copy else 0  # while this block's backward runs
    return best
