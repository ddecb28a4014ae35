"""What context parallelism (runtime.context_parallel, Ulysses) costs one of its cp ranks: memory and time.

Memory (`context_split`): each rank runs 1/cp of every sequence through every token-wise piece, so activations,
the loss's working set, FLOPs and times divide by cp, as at a micro-batch cp times smaller. So does attention:
it runs over the whole sequence for heads/cp of the heads, whose FLOPs (heads x seq^2) and working set (flash and
memory-efficient kernels: heads x seq; the eager scores: heads x seq^2) are linear in the heads. On top, each
attention holds its all-to-all buffers in forward and again in backward: q, k, v sent and received (and the
output's), `a2a_buffer_bytes`.

Time (`ContextParallel.times`): four all-to-alls per attention layer in forward (q, k, v to the head split, the
output back) and four in backward (their gradients), each rank sending (cp - 1)/cp of the tensor; a recomputed
forward runs its four again. All exposed: attention cannot start before its q, k, v arrive and the output
projection waits for the output's; the runtime issues them in order on the compute stream. Pure: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from snugfit.hardware.cluster import Link
from snugfit.plan.facts import ModelFacts
from snugfit.plan.policies import ActivationPolicy
from snugfit.plan.timing import ring_time
from snugfit.profile.types import ModelProfile, PieceProfile


def kv_share(prof: ModelProfile, cp: int, tp: int = 1) -> float:
    """The key/value tensors' width beside the queries' on one tp rank, once repeated to a multiple of cp."""
    facts = ModelFacts.of_profile(prof)
    heads = max(1, (facts.heads or 1) // tp)
    kv = max(1, (facts.kv_heads or facts.heads or 1) // tp)
    return (kv if kv % cp == 0 else math.lcm(kv, cp)) / heads


def a2a_buffer_bytes(p: PieceProfile, share: float) -> int:
    """A block's all-to-all buffers: q, k, v and the output each sent and received (a block's input on this rank
    is as wide as its local queries and output: the hidden size over this tp rank's heads)."""
    return int(2 * p.input_bytes * (2 + 2 * share))


def context_split(prof: ModelProfile, cp: int, tp: int = 1) -> ModelProfile:
    """`prof` (one micro-batch, one tp rank's) as one of cp context-parallel ranks runs it (the module docstring)."""
    if cp == 1:
        return prof
    # a profile taken at cp x the micro-batch, scaled back to it: everything linear in the tokens divides by cp
    split = replace(prof, micro_batch_size=prof.micro_batch_size * cp).scaled(prof.micro_batch_size)
    share = kv_share(prof, cp, tp)

    def block(p: PieceProfile) -> PieceProfile:
        extra = a2a_buffer_bytes(p, share)
        return replace(p, fwd_peak_bytes=p.fwd_peak_bytes + extra, bwd_peak_bytes=p.bwd_peak_bytes + extra)

    # packed documents' mask covers the whole sequence on every cp rank (runtime.context_parallel): it does not divide
    return replace(split, blocks=[block(b) for b in split.blocks], mask_bytes=prof.mask_bytes)


@dataclass(frozen=True)
class ContextParallel:
    """A rank's context-parallel group, as runtime.context_parallel talks over it."""

    size: int
    link: Link
    kv_share: float  # `kv_share`

    @classmethod
    def of(cls, prof: ModelProfile, cp: int, link: Link, tp: int = 1) -> "ContextParallel":
        return cls(cp, link, kv_share(prof, cp, tp))

    def times(self, p: PieceProfile, policy: ActivationPolicy) -> tuple[float, float]:
        """(forward, backward) seconds of p's all-to-alls per microbatch, p as one cp rank runs it (context_split)."""
        if not p.name.startswith("block"):
            return 0.0, 0.0
        # an all-to-all sends what a ring all-gather of a tensor this size sends: (cp - 1)/cp of it, cp - 1 steps
        q = ring_time("all_gather", p.input_bytes, self.size, self.link)
        kv = ring_time("all_gather", p.input_bytes * self.kv_share, self.size, self.link)
        one = 2 * q + 2 * kv  # q and the output; k and v
        again = one if policy.recomputes_forward else one * policy.selective
        return one, one + again
