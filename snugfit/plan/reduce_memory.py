"""Gradient bytes FSDP2 holds at each unit's reduce, in the backward that syncs gradients.

Read from torch 2.13's FSDP2 (`FSDPParamGroup.post_backward`, `_fsdp_collectives.foreach_reduce`) and checked
by a probe of the live tensors at every reduce-scatter copy-in (tests/test_reduce_memory.py). At the copy-in
of a unit, the device holds:
- the unit's unsharded gradients (the compute dtype; the reduce dtype when accumulated over microbatches) and
  its reduce-scatter input (the reduce dtype, unsharded), both at once;
- units reduced before: their gradient shards (the master dtype; nothing when the unit's optimizer or parameters
  are offloaded, whose shards go to host, or when it has stepped in backward and freed them);
- units not reduced yet: their accumulated gradients (several microbatches), or, where every backward reduces
  (one microbatch, or grad_reduce "microbatch"), what their backward has already made, beside the shards
  earlier microbatches left them. That is the root unit's head: its backward runs first but the root is
  reduced last, after the embedding's, so the head's unsharded gradient lives through the whole backward.
Between two copy-ins FSDP2 keeps the last reduce-scatter input alive (one buffer: its
`reduce_scatter_max_input_buffers`), until the next unit's reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

from snugfit.plan.optimizer import master_bytes
from snugfit.plan.plan import Plan
from snugfit.profile.types import DTYPE_BYTES


@dataclass
class ReduceMoment:
    """The copy-in of one unit's reduce."""

    unit: str  # its first piece's name ("block.3", or the root's "embed"/"head")
    gradients: int  # gradient bytes on the device, unsharded and sharded
    reduce_input: int  # the reduce-scatter input
    saved_before: int  # this microbatch's activations of the pieces before the unit, still held
    own: int = 0  # of `gradients`, the unit's own unsharded ones (freed once copied in)
    shard: int = 0  # the unit's reduced shard, which replaces them (where the unit steps in backward, at its step)


def _units(stages: dict) -> list[list]:
    """A rank's FSDP2 units in the order their reduces run: each stage from the last, its blocks from the last,
    then its root pieces (embedding and head together)."""
    out = []
    for k in sorted(stages, reverse=True):
        pieces = stages[k]
        out += [[sp] for sp in reversed(pieces) if sp.is_block]
        root = [sp for sp in pieces if not sp.is_block]
        if root:
            out.append(root)
    return out


def reduce_moments(plan: Plan, stages: dict, saved: dict[str, int]) -> list[ReduceMoment]:
    """The moments of a rank's syncing backward, in order (`stages`: piece_memory.rank_stages; `saved`: each piece's
    device-saved activation bytes by name). None when the model runs unwrapped (no FSDP2)."""
    if plan.runs_unwrapped:
        return []
    compute, reduce = DTYPE_BYTES[plan.compute_dtype], DTYPE_BYTES[plan.reduce_dtype]
    accumulated = not plan.reduces_every_microbatch
    left_before = plan.num_microbatches > 1 and not accumulated  # shards that earlier microbatches reduced
    units = _units(stages)
    trainable = [sum(sp.n_trainable for sp in u) for u in units]
    made_first = [sum(sp.n_trainable for sp in u if sp.piece.name == "head") for u in units]  # before the blocks

    def shard(i: int) -> int:
        d = units[i][0].decision
        if d.placement.steps_on_host:
            return 0
        return -(-master_bytes(plan.optimizer) * trainable[i] // (plan.shard_ranks if d.zero >= 1 else 1))

    def holding(i: int) -> range:
        """The units holding gradient shards at unit i's reduce: those reduced before it, and with shards from
        earlier microbatches all of them; those that stepped in backward have freed theirs."""
        if plan.optimizer.in_backward:
            return range(i, len(units) if left_before else i)
        return range(len(units) if left_before else i)

    order = [sp.piece.name for k in sorted(stages) for sp in stages[k]]
    # running sums, so that a rank of n units costs O(n) (the search's estimate() walks every rank's)
    held_by = [reduce * t if accumulated else compute * f for t, f in zip(trainable, made_first)]
    after = suffix_sums(held_by)  # after[i]: the units reduced after unit i
    shards = [shard(j) for j in range(len(units))]
    shards_up_to = [0, *_prefix_sums(shards)]  # shards_up_to[i]: units 0..i-1's
    saved_before = [0, *_prefix_sums([saved[n] for n in order])]  # saved_before[k]: the pieces before order[k]
    at = {n: k for k, n in enumerate(order)}
    out = []
    for i, unit in enumerate(units):
        pending = after[i + 1]
        own = (reduce if accumulated else compute) * trainable[i]
        before = saved_before[at[unit[0].piece.name]] if unit[0].is_block else 0
        span = holding(i)
        held = shards_up_to[span.stop] - shards_up_to[span.start] if span.stop > span.start else 0
        out.append(ReduceMoment(unit[0].piece.name, held + pending + own, reduce * trainable[i], before, own,
                                shards[i]))
    return out


def _prefix_sums(xs: list[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out


def suffix_sums(xs: list[int]) -> list[int]:
    """out[i] = sum(xs[i:]), for i in 0..len(xs) (whole bytes: the same as the sums, in any order)."""
    return [*reversed(_prefix_sums(list(reversed(xs)))), 0]
