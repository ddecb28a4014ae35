"""The search's outer candidates: data, tensor, pipeline, context and expert degrees, micro-batch size and schedule.

Every (dp, tp, pp, cp, ep, micro-batch, schedule, gradient reduction) the launch and the fixed parts allow, with global
batch = micro-batch x microbatches x dp, data- and tensor-parallel groups only of like GPUs, and tensor parallelism
within a node.
search.py solves each candidate's per-block decisions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from snugfit.hardware.cluster import Cluster
from snugfit.plan.facts import ModelFacts
from snugfit.plan.knapsack import INF
from snugfit.plan.options import Constraints, block_options
from snugfit.plan.rules import allows, allows_unit, parts_of
from snugfit.plan.plan import Plan
from snugfit.plan.schedules import SCHEDULES
from snugfit.plan.shape import RankLayout, Shape, exposes_shape
from snugfit.profile.types import ModelProfile

MAX_MICRO_BATCH = 8
# context parallelism is searched only where each rank keeps at least this many tokens of a sequence: below it the
# all-to-alls' latency and the smaller matmuls cost more than the memory saved buys (and the search stays as fast)
MIN_CP_TOKENS = 4096


@exposes_shape  # cand.dp, cand.schedule, ...: cand.shape's, read-only
@dataclass
class Candidate:
    shape: Shape  # what the candidate is (the rest is what the search found for it); the cost caches key on it
    lower: float = 0.0  # seconds no plan of this candidate can beat
    score: float = INF  # the knapsack's step time of its solution
    plan: Plan | None = None
    solved: bool = False
    fits: bool | None = None  # estimate()'s verdict once verified
    polished: bool = False  # given back the room the knapsack could not see (verify.polish)
    estimated_need: int | None = None  # estimate()'s device peak of its leanest plan, where verify.rescue took one

    @property
    def family(self) -> str:
        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        ep = f" (ep {self.ep})" if self.ep > 1 else ""
        return (f"dp {self.dp} x tp {self.tp} x pp {self.pp}" if self.tp > 1 else f"dp {self.dp} x pp {self.pp}") + cp + ep


def nearest_to_fitting(members: list[Candidate], need: Callable[[Candidate], float]) -> Candidate:
    """The member of a family that needs the least memory, by `need`: among those of the smallest micro-batch,
    since a larger one never needs less (the one the report names, and verify.rescue estimates)."""
    smallest = min(x.micro_batch_size for x in members)
    return min((x for x in members if x.micro_batch_size == smallest), key=need)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_degrees(prof: ModelProfile, cluster: Cluster, c: Constraints) -> list[int]:
    """Tensor-parallel degrees worth searching: within one node (every node's GPU count divides by it), up to 8,
    that the model splits (heads, key/value heads, MLP, vocabulary, sequence) and the fixed parts allow. Not on
    CPU ranks unless fixed: DTensor's per-operator work costs more there than the split saves (profile-hardware's
    "tp" cost, 20 ms per piece and microbatch at 2 ranks here)."""
    if c.tp:
        return [c.tp]
    if all(n.gpu.name == "cpu" for n in cluster.nodes):
        return [1]
    per_node = math.gcd(*(n.count for n in cluster.nodes))
    facts = ModelFacts.of_profile(prof)
    return [1] + [t for t in (2, 4, 8)
                  if per_node % t == 0 and allows(c.parts(tp=t, seq_len=prof.seq_len, model=facts))]


def cp_degrees(prof: ModelProfile, ranks: int, tp: int, c: Constraints) -> list[int]:
    """Context-parallel degrees worth searching among `ranks` (what tp and pp leave): those dividing them that
    leave each rank MIN_CP_TOKENS of a sequence and that the rules allow beside the model (heads, sequence)."""
    if c.cp:
        return [c.cp] if ranks % c.cp == 0 else []
    facts = ModelFacts.of_profile(prof)
    return [1] + [k for k in divisors(ranks)[1:] if prof.seq_len >= MIN_CP_TOKENS * k
                  and allows(c.parts(cp=k, tp=tp, seq_len=prof.seq_len, model=facts))]


def ep_degrees(prof: ModelProfile, ranks: int, c: Constraints) -> list[int]:
    """Expert-parallel degrees among the dp x cp `ranks`: the fixed one where it divides them, else 1 and those
    dividing them that the rules allow beside the model (its experts, which ep must divide; built-in ones)."""
    if c.ep:
        return [c.ep] if ranks % c.ep == 0 else []
    facts = ModelFacts.of_profile(prof)
    if not facts.n_experts:
        return [1]
    return [1] + [k for k in divisors(ranks)[1:] if allows(c.parts(ep=k, model=facts))]


def grad_reduce_modes(dp: int, m: int, c: Constraints, in_backward: bool = False,
                      to_host: bool = False) -> list[str]:
    """When gradients may be reduced: per microbatch only where it can differ from once a step (accumulation
    over data-parallel ranks; gradients moved to the host, `to_host`, which then never accumulate whole on the
    device, even on one rank; or the step in backward, which needs it where there are several microbatches); the
    same math but for summation order, so searched freely unless fixed. The rules then drop what the schedule
    forbids (a split backward makes gradients in a later weight pass, and takes no compiled blocks)."""
    every = (dp > 1 or in_backward or to_host) and m > 1
    return [c.grad_reduce] if c.grad_reduce else ["step", "microbatch"] if every else ["step"]


def outer_candidates(prof: ModelProfile, cluster: Cluster, global_batch: int, c: Constraints,
                     in_backward: bool = False) -> list[Candidate]:
    """Every outer candidate the launch and the fixed parts allow (unsolved); in_backward: the optimizer steps in
    backward (plan.OptimizerPlan)."""
    w, n, gb, out = cluster.world_size, len(prof.blocks), global_batch, []
    trainable = sum(p.num_trainable for p in prof.pieces)
    degrees = [(tp, pp) for tp in tp_degrees(prof, cluster, c) for pp in ([c.pp] if c.pp else divisors(w))
               if w % (pp * tp) == 0]
    for tp, pp, cp in [(tp, pp, cp) for tp, pp in degrees for cp in cp_degrees(prof, w // (pp * tp), tp, c)]:
        dp = w // (pp * tp * cp)
        if (c.dp and c.dp != dp) or dp < (c.min_dp or 1) or pp > n or gb % dp:
            continue
        layout = RankLayout(pp=pp, dp=dp, tp=tp, cp=cp)
        if any(len({cluster.gpu_of(r).name for r in layout.stage_ranks(s)}) > 1 for s in range(pp)):
            continue  # data- and tensor-parallel groups only of like GPUs
        options = block_options(c, dp * cp)
        # gradients reduced every microbatch at dp 1 only pay where they go to the host and the stage's whole
        # fp32 gradient would crowd the card (a 70B full fine-tune on one 24 GB card holds 262 GiB of them)
        to_host = any(o.placement.states_on_host for o in options) and \
            4 * trainable / (pp * tp) > cluster.gpu_of(0).memory_bytes / 2
        mbss = [c.micro_batch] if c.micro_batch else [d for d in divisors(gb // dp) if d <= MAX_MICRO_BATCH]
        eps = ep_degrees(prof, dp * cp, c)  # the model's facts read once, not per micro-batch and schedule
        for mbs in mbss:
            m = gb // (dp * mbs)
            if gb % (dp * mbs) or (c.num_microbatches and m != c.num_microbatches):
                continue
            for sched in SCHEDULES.values():
                v = sched.stages_per_rank or c.virtual_stages or sched.search_stages_per_rank
                if c.schedule and sched.name != c.schedule:
                    continue
                if sched.problem(pp, v, m) or n < pp * v:
                    continue
                for g, ep in [(g, ep) for g in grad_reduce_modes(dp, m, c, in_backward, to_host)
                              for ep in eps]:
                    shape = Shape(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, schedule=sched.name, virtual_stages=v, micro_batch_size=mbs,
                                  num_microbatches=m, grad_reduce=g, compile=prof.compiled,
                                  evict_bound=c.evict_bound if sched.evicts else None)
                    # no rule forbids it beside the optimizer setup, and some option the fixed parts leave runs
                    # beside it (plan.rules)
                    if allows(parts_of(shape, in_backward=in_backward)) and any(allows_unit(o, shape)
                                                                               for o in options):
                        out.append(Candidate(shape))
    return out


def next_splittable_batch(prof: ModelProfile, cluster: Cluster, global_batch: int, c: Constraints,
                          in_backward: bool = False) -> int | None:
    """The smallest global batch above `global_batch` that the launch and the fixed parts can split into
    micro-batch x microbatches x dp (None when none up to 64x the ranks can): what to suggest instead."""
    return next((b for b in range(global_batch + 1, 64 * cluster.world_size + 1)
                 if outer_candidates(prof, cluster, b, c, in_backward)), None)


def ranks_word(cluster: Cluster) -> str:
    """What the cluster's ranks are called in messages: 'GPUs', or 'ranks' for CPU ranks."""
    return "ranks" if all(node.gpu.name == "cpu" for node in cluster.nodes) else "GPUs"
