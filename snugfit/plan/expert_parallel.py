"""What expert parallelism (runtime.expert_parallel) costs one of its ep ranks in time: the all-to-alls.

Each MoE block exchanges its tokens' top-k copies twice in forward (to their experts' ranks, and the experts'
outputs back) and twice in backward (their gradients), again for a recomputed forward; each rank sends (ep - 1)/ep
of its copies (tokens x top_k x hidden, the compute dtype) at balanced routing. All exposed: the experts wait for
their tokens and the combine for their outputs. The counts exchanged first are a few bytes (latency only, in the
ring's steps). Compute is the profile's: at balanced routing a rank's experts run as many copies as at ep 1, in
fewer, larger groups. Memory is plan.piece_memory's (`ep_parts`). Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from snugfit.hardware.cluster import Link
from snugfit.plan.policies import ActivationPolicy
from snugfit.plan.timing import ring_time
from snugfit.profile.types import ModelProfile, PieceProfile


@dataclass(frozen=True)
class ExpertParallel:
    """A rank's expert-parallel group, as runtime.expert_parallel talks over it."""

    size: int
    link: Link
    top_k: int  # the copies of each token dispatched

    @classmethod
    def of(cls, prof: ModelProfile, ep: int, link: Link) -> "ExpertParallel":
        c = prof.config
        return cls(ep, link, c.get("top_k") or c.get("num_experts_per_tok") or 1)

    def times(self, p: PieceProfile, policy: ActivationPolicy) -> tuple[float, float]:
        """(forward, backward) seconds of p's all-to-alls per microbatch."""
        if not p.name.startswith("block"):
            return 0.0, 0.0
        # an all-to-all sends what a ring all-gather of a tensor this size sends: (ep - 1)/ep of it
        one = 2 * ring_time("all_gather", p.input_bytes * self.top_k, self.size, self.link)  # dispatch, combine
        again = one if policy.recomputes_forward else one * policy.selective
        return one, one + again
