"""A stage's device memory at the named moments of a step, for the search's fast path.

The search prices a stage as its root unit plus n alike blocks, each under one option (stage_costs.Cost), and
two moments bound it: the passes (forward and backward: the largest piece's working peak above what is held) and
the root's reduce (the backward's last moment, when the root's unsharded gradients and reduce-scatter input sit
beside every block's reduced shard). `stage_moments` writes them once for CostModel.need, CostModel.room,
solve._solve_uniform; the knapsack (knapsack.py) adds up the same terms, block by block. Once-per-stage buffers
that options need are `StageBuffers`, named. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

from snugfit.plan.optimizer import state_bytes
from snugfit.plan.plan import BlockPlan, OptimizerPlan
from snugfit.profile.types import DTYPE_BYTES, PieceProfile


@dataclass(frozen=True)
class StageBuffers:
    """Device buffers a stage holds once whichever blocks need them, two blocks' worth of each (the one in use and
    the next), sized on the typical block as memory.py counts them; the states unsharded (an upper bound)."""

    zero3_copies: float = 0.0  # ZeRO-3: the running block's gathered copy and the one FSDP2 prefetches
    activation_window: float = 0.0  # a policy whose whole saved activations wait on host: two blocks in flight
    checkpoint_window: float = 0.0  # one whose recomputation checkpoint waits on host
    states_window: float = 0.0  # streamed optimizer states: the stepping unit's and the next one's

    @classmethod
    def of_block(cls, blk: PieceProfile, dtype: str, optimizer: OptimizerPlan) -> "StageBuffers":
        states = state_bytes(optimizer, blk.matrices, blk.num_trainable, 1)
        return cls(2 * blk.num_params * DTYPE_BYTES[dtype], 2 * blk.saved_bytes["keep"],
                   2 * blk.saved_bytes["recompute"], 2 * states)

    @property
    def prefetched(self) -> float:
        """One ZeRO-3 block's gathered copy: the one prefetched while the root is reduced."""
        return self.zero3_copies / 2

    @staticmethod
    def needs(o: BlockPlan, root: bool = False) -> frozenset[str]:
        """The buffers an option needs (the root unit's: the ZeRO-3 copies only)."""
        on_host = o.policy.on_host and not root
        return frozenset(name for name, needed in (
            ("zero3_copies", o.zero == 3), ("activation_window", on_host and not o.policy.recomputes),
            ("checkpoint_window", on_host and bool(o.policy.recomputes)),
            ("states_window", o.stream_states and not root)) if needed)

    def bytes_of(self, names: frozenset[str]) -> float:
        return sum(getattr(self, name) for name in names)

    def extra(self, o: BlockPlan) -> float:
        """The bytes of the buffers a block option needs."""
        return self.bytes_of(self.needs(o))

    def subsets(self, within: frozenset[str]) -> list[frozenset[str]]:
        """Every set of buffers drawn from `within`, in one fixed order (the knapsack solves one table for each)."""
        names = [f.name for f in fields(self)]
        out = []
        for mask in range(1 << len(names)):
            chosen = frozenset(n for j, n in enumerate(names) if mask >> j & 1)
            if chosen <= within:
                out.append(chosen)
        return out


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
