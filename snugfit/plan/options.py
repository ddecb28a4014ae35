"""What a block may choose: the user's fixed parts of a plan, and the per-block options they leave open.

Pure: the search enumerates these, the explanation names them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from snugfit.errors import SnugfitError
from snugfit.plan.placement import Placement
from snugfit.plan.rules import Parts, allows, parts_of, problem
from snugfit.plan.plan import ZERO_STAGES, BlockPlan
from snugfit.plan.policies import ACTIVATION_POLICIES, ALIASES, POLICY_NAMES
from snugfit.plan.schedules import SCHEDULE_NAMES, SCHEDULES
from snugfit.plan.shape import GRAD_REDUCE


@dataclass
class Constraints:
    """The parts of a plan a user fixes, named and typed once: the run config's [parallel] section is one
    (config.ParallelConfig adds how the ranks launch), `snugfit plan` and `snugfit train` take them as the same
    options, and the search reads them. None = search it."""

    dp: int | None = None
    tp: int | None = None  # tensor-parallel degree (ranks of one node)
    pp: int | None = None
    cp: int | None = None  # context-parallel degree: each rank of a cp group holds 1/cp of every sequence
    ep: int | None = None  # expert-parallel degree: MoE blocks' experts split over ep of the dp x cp ranks
    schedule: str | None = None  # plan.schedules
    virtual_stages: int | None = None
    num_microbatches: int | None = None
    zero: int | None = None  # 0 | 1 | 2 | 3
    recompute: str | None = None  # every block's activation policy (plan.policies; none = keep, full = recompute)
    offload_optimizer: str | None = None  # all | none (a whole plan, `snugfit plan`, also takes a block count)
    offload_params: bool | None = None
    evict_bound: int | None = None  # BPipe: most microbatches resident per stage
    grad_reduce: str | None = None  # step: once a step | microbatch: every microbatch (holds shards)
    mlp_tiles: int | None = None  # every block's MLP in this many tiles of the sequence (model.tiled_mlp)
    # from the run config's train.micro_batch_size (0 there: searched), not a [parallel] key
    micro_batch: int | None = field(default=None, metadata={"config": False})
    # the fewest data-parallel ranks a candidate may have (search.search sets it: --zero N shards over dp)
    min_dp: int | None = field(default=None, metadata={"config": False})

    @property
    def shards_over_data(self) -> bool:
        """--zero 1-3 with no layout fixed: what a user means is states sharded over data-parallel ranks, so the
        search looks among layouts with dp > 1 first (search.search)."""
        return bool(self.zero) and self.dp is None and self.tp is None and self.pp is None

    @property
    def activations(self) -> str | None:
        """The policy `recompute` names (aliases resolved)."""
        return ALIASES.get(self.recompute, self.recompute)

    @property
    def offloads_optimizer(self) -> bool | None:
        """Whether every unit offloads its optimizer (True), none does (False), or it is searched (None)."""
        return {None: None, "all": True, "none": False, "0": False}.get(self.offload_optimizer, self.offload_optimizer)

    @property
    def placement(self) -> Placement | None:
        """The placement every unit takes where the offload options fix one (None: searched, or only narrowed)."""
        if self.offload_params:
            return Placement.PARAMS_ON_HOST
        return Placement.HOST_STEP if self.offloads_optimizer else None

    def placements(self) -> list[Placement]:
        """The placements a unit may take under the offload options, in the search's order: --offload-params
        false leaves out parameters on host, --offload-optimizer none every placement stepping or keeping the
        states on host but parameter offload (which --offload-params alone decides)."""
        if self.placement is not None:
            return [self.placement]
        return [p for p in Placement if not (p.params_on_host and self.offload_params is False)
                and not (self.offloads_optimizer is False and p.states_on_host and not p.params_on_host)]

    def parts(self, **rest) -> Parts:
        """What the rules read of these fixed parts (plan.rules.parts_of), with `rest` over them."""
        return parts_of(self, **{"zero": self.zero, "placement": self.placement, "activations": self.activations,
                                 "mlp_tiles": self.mlp_tiles, **rest})

    def fixed(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(Constraints) if getattr(self, f.name) is not None}

    def checked(self, world_size: int) -> "Constraints":
        """These fixed parts, refused in one line naming the fix where they cannot work on `world_size` ranks or
        break a rule (plan.rules) among themselves."""
        for flag, v in (("--dp", self.dp), ("--tp", self.tp), ("--pp", self.pp), ("--cp", self.cp), ("--ep", self.ep)):
            if v is not None and (v < 1 or world_size % v):
                raise SnugfitError(f"{flag} {v} does not divide the {world_size} ranks (GPUs) of the launch")
        dp, tp, pp, cp = self.dp or 1, self.tp or 1, self.pp or 1, self.cp or 1
        if self.dp and self.pp and self.tp and self.cp and dp * tp * pp * cp != world_size:
            raise SnugfitError(f"--dp {dp} x --tp {tp} x --pp {pp} x --cp {cp} = {dp * tp * pp * cp}, but the launch "
                               f"has {world_size} ranks (GPUs)")
        if world_size % (dp * tp * pp * cp):
            raise SnugfitError(f"--dp x --tp x --pp x --cp must divide into the launch's {world_size} ranks (GPUs)")
        if self.activations is not None and self.activations not in ACTIVATION_POLICIES:
            raise SnugfitError(f"--recompute must be one of {', '.join(POLICY_NAMES)}, got {self.recompute!r}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise SnugfitError(f"--schedule must be one of {', '.join(SCHEDULE_NAMES)}, got {self.schedule!r}")
        if self.grad_reduce is not None and self.grad_reduce not in GRAD_REDUCE:
            raise SnugfitError(f"--grad-reduce must be one of {', '.join(GRAD_REDUCE)}, got {self.grad_reduce!r}")
        if self.mlp_tiles is not None and self.mlp_tiles < 1:
            raise SnugfitError(f"--mlp-tiles must be >= 1, got {self.mlp_tiles}")
        if self.zero is not None and self.zero not in ZERO_STAGES:
            raise SnugfitError(f"--zero must be 0, 1, 2 or 3, got {self.zero}")
        if self.offloads_optimizer not in (None, True, False):
            raise SnugfitError("--offload-optimizer in a search takes 'all' or 'none'; to offload the first N blocks, "
                               "give the whole plan (--pp, --micro-batch, --zero, --recompute)")
        if self.offload_params and self.offloads_optimizer:
            raise SnugfitError("--offload-params already keeps optimizer states on host; drop --offload-optimizer")
        if pp > 1 and self.num_microbatches and self.num_microbatches < pp:
            raise SnugfitError(f"--num-microbatches {self.num_microbatches} must be >= --pp {pp}")
        broken = problem(self.parts())
        if broken:
            raise SnugfitError(broken)
        return self


def fixed_parts_of(parallel: Constraints, micro_batch_size: int, world_size: int) -> Constraints:
    """A run config's fixed parts (its [parallel] section; train.micro_batch_size 0 = searched), checked."""
    return replace(parallel, micro_batch=micro_batch_size or None).checked(world_size)


def refuse_fixed_parts_beside(parallel: Constraints) -> None:
    """Fixed parts belong to a searched plan (plan "auto"), not to a plan file or plain data parallelism."""
    fixed = list(parallel.fixed())
    if fixed and parallel.plan != "auto":
        raise SnugfitError(f"--{fixed[0].replace('_', '-')} fixes a part of a searched plan, but --plan is "
                           f"{parallel.plan!r}; drop --plan (auto) or the fixed parts")


def block_options(c: Constraints, dp: int, root: bool = False) -> list[BlockPlan]:
    """Every per-block decision the constraints allow. With dp 1, ZeRO 1 and 2 hold what ZeRO 0 holds, and ZeRO 3
    differs in memory only: FSDP2 gathers a unit's compute copy even on one rank, which ZeRO 3 frees after forward
    (the copy is the whole model again where the weights are stored in the compute dtype: bf16 masters)."""
    acts = ["keep"] if root else ([c.activations] if c.activations else list(ACTIVATION_POLICIES))
    tiles = 1 if root else (c.mlp_tiles or 1)  # searched: per stage of the search (plan.search), all alike
    out = []
    for z in [c.zero] if c.zero is not None else [0, 1, 2, 3]:
        for placement in c.placements():
            if not allows(Parts(zero=z, placement=placement)) or \
                    (dp == 1 and c.zero is None and z not in ((3,) if placement.params_on_host else (0, 3))):
                continue
            # streaming states pays where the device is short of memory, where ZeRO-3 holds the least too (and at
            # dp 1 costs no communication)
            if placement.streams_states and z != 3:
                continue
            out += [BlockPlan(z, placement, a, tiles) for a in acts
                    if allows(Parts(activations=a, mlp_tiles=tiles))]
    return out


def describe(o: BlockPlan, root: bool = False, dp: int | None = None) -> str:
    """'ZeRO-3 + parameter offload + activations kept'. On one data-parallel rank (dp 1) nothing is sharded: ZeRO-1/2
    are replicated, ZeRO-3 frees the gathered copy after forward, and its parameter offload is just that."""
    if dp is None or dp > 1 or o.zero == 0:
        parts = [f"ZeRO-{o.zero}" if o.zero else "replicated"]
    else:
        parts = [] if o.placement.params_on_host else ["copies freed after forward" if o.zero == 3 else "replicated"]
    parts += [o.placement.words] if o.placement.words else []
    tiles = [f"MLP in {o.mlp_tiles} tiles"] if o.mlp_tiles > 1 and not root else []
    return " + ".join(parts + ([] if root else [o.policy.words]) + tiles)


def may_be_fastest(opts: list[BlockPlan]) -> list[BlockPlan]:
    """The options among which the fastest is, for lower bounds: offloading only adds time to the same work
    (copies over PCIe, the optimizer on the host), so where the constraints allow options that offload nothing,
    the fastest of them is as fast as any (tests/test_search.py checks it). Recomputation is not left out: it
    lengthens the backward that hides a block's gradient reduction."""
    lean = [o for o in opts if not (o.placement.states_on_host or o.offloads_activations)]
    return lean or opts
