"""The plan-wide layout (Shape), carried whole by a Plan and by the search's candidates, and the one place ranks,
groups and strides are computed (RankLayout). Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from operator import attrgetter

from snugfit.errors import PlanError
from snugfit.plan.schedules import SCHEDULE_NAMES, SCHEDULES

# When FSDP2 reduces gradients over data-parallel ranks: once a step, after the last microbatch (the unsharded
# gradient accumulates through the step), or after every microbatch (only the fp32 shard accumulates)
GRAD_REDUCE = ("step", "microbatch")


@dataclass(frozen=True)
class RankLayout:
    """Where each rank sits on the pp x dp x cp x tp grid, and every group read off it. tp is innermost, so a
    rank's tensor-parallel peers are its neighbours (one node: NVLink), then its context-parallel peers (the
    all-to-alls around attention), then its data-parallel peers, then the pipeline stages:
    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank. FSDP2 shards over dp x cp (the ranks of one
    pipeline rank and tensor-parallel rank); expert-parallel groups sit within those dp x cp ranks, each ep
    consecutive ones of them (in shard_group's order). The one place these formulas are written."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank (its cp_rank: `cp_rank`)."""
        return rank // (self.dp * self.cp * self.tp), rank // (self.cp * self.tp) % self.dp, rank % self.tp

    def cp_rank(self, rank: int) -> int:
        return rank // self.tp % self.cp

    def rank(self, pp_rank: int, dp_rank: int = 0, tp_rank: int = 0, cp_rank: int = 0) -> int:
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def stage_ranks(self, pp_rank: int) -> list[int]:
        """Every rank that holds pipeline rank pp_rank's stages."""
        per = self.dp * self.cp * self.tp
        return list(range(pp_rank * per, (pp_rank + 1) * per))

    def dp_group(self, rank: int) -> list[int]:
        """The data-parallel peers of `rank` (itself among them), in dp order."""
        pp_rank, _, tp_rank = self.coords(rank)
        return [self.rank(pp_rank, d, tp_rank, self.cp_rank(rank)) for d in range(self.dp)]

    def shard_group(self, rank: int) -> list[int]:
        """The ranks FSDP2 shards `rank`'s parameters over and reduces its gradients over: its dp x cp peers
        (itself among them), in rank order (contiguous: cp sits inside dp)."""
        pp_rank, _, tp_rank = self.coords(rank)
        return [self.rank(pp_rank, d, tp_rank, c) for d in range(self.dp) for c in range(self.cp)]

    def ep_group(self, rank: int) -> list[int]:
        """The expert-parallel peers of `rank` (itself among them), in ep order: its MoE layers' experts are split
        over them, rank i of them holding the i-th E/ep."""
        shard = self.shard_group(rank)
        first = shard.index(rank) // self.ep * self.ep
        return shard[first:first + self.ep]

    def expert_shard_group(self, rank: int) -> list[int]:
        """The ranks holding the same experts as `rank` (itself among them): its dp x cp peers at its place in
        their ep groups; FSDP2 shards and reduces the experts over them."""
        shard = self.shard_group(rank)
        return shard[shard.index(rank) % self.ep::self.ep]

    def cp_group(self, rank: int) -> list[int]:
        """The context-parallel peers of `rank` (itself among them), in cp order: the all-to-alls' group."""
        pp_rank, dp_rank, tp_rank = self.coords(rank)
        return [self.rank(pp_rank, dp_rank, tp_rank, c) for c in range(self.cp)]

    def tp_group(self, rank: int) -> list[int]:
        """The tensor-parallel peers of `rank` (itself among them), in tp order."""
        pp_rank, dp_rank, _ = self.coords(rank)
        return [self.rank(pp_rank, dp_rank, t, self.cp_rank(rank)) for t in range(self.tp)]

    def pipeline_group(self, rank: int) -> list[int]:
        """The pipeline ranks that share `rank`'s dp, cp and tp coordinates, in pp order."""
        _, dp_rank, tp_rank = self.coords(rank)
        return [self.rank(s, dp_rank, tp_rank, self.cp_rank(rank)) for s in range(self.pp)]


@dataclass(frozen=True)
class Shape:
    """The plan-wide layout: the degrees, the schedule, the microbatching, when gradients are reduced, whether the
    blocks are compiled. One object, carried whole by a Plan and by each of the search's candidates (which it also
    names: the cost caches key on it); the rules read its all-optional twin (plan.rules.Parts).

    Not in it: the sequence length and the dtypes. They are the workload's and the numerics' (the profile is
    taken at one sequence length and dtype, and every candidate of a search shares them), not a way of laying a
    step out over ranks; so is the optimizer setup (plan.OptimizerPlan), the user's choice, never searched.
    """

    dp: int = 1
    tp: int = 1  # tensor-parallel degree: each block's linears split over tp ranks of one node
    pp: int = 1
    cp: int = 1  # context-parallel degree: each rank of a cp group holds 1/cp of every sequence
    ep: int = 1  # expert-parallel degree: a Mixture-of-Experts block's experts split over ep of the dp x cp ranks
    schedule: str = "none"  # plan.schedules
    virtual_stages: int = 1  # stages per pipeline rank (interleaved 1F1B)
    micro_batch_size: int = 1
    num_microbatches: int = 1  # per data-parallel rank per optimizer step
    grad_reduce: str = "step"  # GRAD_REDUCE: reduce once a step, or every microbatch (ZeRO-2/3 then hold shards)
    # each block compiled once (torch.compile, runtime.compile): fused kernels, what the partitioner saves; the math
    # is the same up to float order, so the search weighs it as any other choice (its profile: profile.compiled)
    compile: bool = False
    evict_bound: int | None = None  # BPipe: most microbatches' activations resident on one stage

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def shard_ranks(self) -> int:
        """The ranks FSDP2 shards over and reduces over: dp x cp (context-parallel ranks hold the same weights)."""
        return self.dp * self.cp

    @property
    def layout(self) -> RankLayout:
        return RankLayout(pp=self.pp, dp=self.dp, tp=self.tp, cp=self.cp, ep=self.ep)

    def check(self, where: str = "plan") -> None:
        """Refuse values no layout has (what may not go together is plan.rules')."""
        for f in fields(self):
            if f.type == "int" and getattr(self, f.name) < 1:
                raise PlanError(f"{where}.{f.name} must be >= 1, got {getattr(self, f.name)}")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"{where}.schedule must be one of {', '.join(SCHEDULE_NAMES)}, got {self.schedule!r}")
        if self.grad_reduce not in GRAD_REDUCE:
            raise PlanError(f"{where}.grad_reduce must be one of {GRAD_REDUCE}, got {self.grad_reduce!r}")


SHAPE_FIELDS = tuple(f.name for f in fields(Shape))


def exposes_shape(cls: type) -> type:
    """Give `cls`, which holds a Shape as `shape`, read-only attributes of the shape's fields and world size
    (plan.dp is plan.shape.dp): its readers need not know the layout is one object, and none can change a part of
    it alone (a new layout is `replace(plan.shape, ...)`)."""
    for name in (*SHAPE_FIELDS, "world_size", "shard_ranks"):
        setattr(cls, name, property(attrgetter(f"shape.{name}"), doc=f"shape.{name}"))
    return cls
