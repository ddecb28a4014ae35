"""The Plan: the one contract between planner and runtime.

Plain, JSON-serialisable data. The planner fills it (and its predictions); the
runtime executes exactly what it says and never re-decides. Pure: no torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields, replace

from snugfit.errors import PlanError
from snugfit.plan.facts import ModelFacts
from snugfit.plan.placement import Placement
from snugfit.plan.rules import Parts, parts_of, problem
from snugfit.plan.policies import ACTIVATION_POLICIES, POLICY_NAMES, ActivationPolicy
from snugfit.plan.schedules import SCHEDULES, Action, Schedule, bpipe_bound
from snugfit.plan.shape import SHAPE_FIELDS, RankLayout, Shape, exposes_shape

ZERO_STAGES = (0, 1, 2, 3)  # 0 replicate, 1 shard optimizer states, 2 + gradients, 3 + parameters
DTYPES = ("float32", "bfloat16", "float16")
# How trainable parameters are stored and updated (OptimizerPlan): the dtype of the weights the optimizer updates
# (bf16: no fp32 copy, updated with stochastic rounding), and of AdamW's two states (8bit, 4bit: torchao's blockwise
# quantized states)
MASTER_WEIGHTS = ("fp32", "bf16")
OPTIMIZER_STATES = ("fp32", "bf16", "8bit", "4bit")
PLACEMENTS = tuple(p.value for p in Placement)
# The plan's layout: 1 (no version field) held the shape's fields flat and three booleans per unit, where 2 holds
# its shape (plan.shape) and each unit's placement
PLAN_VERSION = 2


@dataclass(frozen=True)
class BlockPlan:
    """Decisions for one block (or for the root piece: embedding + final norm + head). Frozen and hashable: the
    cost caches key on (piece, option)."""

    zero: int = 0
    placement: Placement = Placement.DEVICE  # where its trainable state lives and is updated (plan.placement)
    activations: str = "keep"  # what happens to the block's saved activations
    # tiles of the sequence its MLP runs in (model.tiled_mlp): its intermediates exist a tile at a time, for one more
    # MLP forward in backward; 1: whole
    mlp_tiles: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.placement, Placement):  # a name, as plan JSON and configs write it
            if self.placement not in PLACEMENTS:
                raise PlanError(f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
            object.__setattr__(self, "placement", Placement(self.placement))

    # what the runtime's readers ask by the names plans had before their placement (read-only)
    @property
    def offload_optimizer(self) -> bool:
        return self.placement is Placement.HOST_STEP

    @property
    def offload_params(self) -> bool:
        return self.placement.params_on_host

    @property
    def stream_states(self) -> bool:
        return self.placement.streams_states

    @property
    def policy(self) -> ActivationPolicy:
        """The activation policy's entry (plan.policies)."""
        return ACTIVATION_POLICIES[self.activations]

    @property
    def offloads_activations(self) -> bool:
        """Whether what the block keeps for backward waits on host (all of it, or its recompute checkpoint)."""
        return self.policy.on_host

    def check(self, where: str) -> None:
        if self.zero not in ZERO_STAGES:
            raise PlanError(f"{where}.zero must be one of {ZERO_STAGES}, got {self.zero}")
        if self.activations not in ACTIVATION_POLICIES:
            raise PlanError(f"{where}.activations must be one of {', '.join(POLICY_NAMES)}, got {self.activations!r}")
        if not isinstance(self.mlp_tiles, int) or self.mlp_tiles < 1:
            raise PlanError(f"{where}.mlp_tiles must be an integer >= 1, got {self.mlp_tiles!r}")


@dataclass
class OptimizerPlan:
    """How the trainable parameters are stored and updated: the user's choice, since each changes the numerics
    (the search never picks one, it models the one given), which the runtime follows (runtime.optimizer)."""

    master_weights: str = "fp32"  # MASTER_WEIGHTS: the dtype of the weights the optimizer updates
    states: str = "fp32"  # OPTIMIZER_STATES: AdamW's two states per parameter
    # each unit steps as soon as its gradient is reduced, and the gradient is freed at once (no step-wide gradient
    # buffer); gradients are then clipped per unit, not by their global norm
    in_backward: bool = False

    def check(self) -> None:
        if self.master_weights not in MASTER_WEIGHTS:
            raise PlanError(f"plan.optimizer.master_weights must be one of {MASTER_WEIGHTS}, "
                            f"got {self.master_weights!r}")
        if self.states not in OPTIMIZER_STATES:
            raise PlanError(f"plan.optimizer.states must be one of {OPTIMIZER_STATES}, got {self.states!r}")

    @property
    def needs_torchao(self) -> bool:
        """Whether torchao's AdamW updates the weights (bf16 weights or states other than fp32); torch's fused
        AdamW does fp32 weights with fp32 states."""
        return (self.master_weights, self.states) != ("fp32", "fp32")


@dataclass
class Prediction:
    """What the memory and time models said about this plan (filled by plan/)."""

    peak_memory_bytes: int = 0  # max over ranks
    memory_by_rank: list[dict[str, int]] = field(default_factory=list)  # category -> bytes, per rank
    # what runtime.memory.MemoryTracker should report as its peak, per rank (its keys: "device.total", ...)
    tracked_by_rank: list[dict[str, int]] = field(default_factory=list)
    step_time_s: float = 0.0
    time_by_phase: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    fits: bool = True
    memory_budget_bytes: int | None = None
    notes: list[str] = field(default_factory=list)
    # before the first step: "device" (max over ranks), "host" (max over nodes); plan.estimate
    startup_bytes: dict[str, int] = field(default_factory=dict)
    # the node closest to its host RAM: "node", "training" and "startup" bytes, its "ram", and whether that RAM is
    # "assumed" (a catalogue cluster's default) rather than given or measured
    host_memory: dict = field(default_factory=dict)
    # seconds the first step spends compiling the blocks (Plan.compile; plan.estimate.compile_seconds), outside
    # step_time_s: what the search weighs compiling's faster steps against, and what the run reports it beside
    compile_s: float = 0.0
    # the run-measured factors per term (plan.corrections) the times were corrected by; empty: the model's own. A
    # re-estimate of the plan (the timeline of a traced step) applies the same, so that both show one step
    corrections: dict[str, float] = field(default_factory=dict)
    # the micro-batch the model's profile was taken at (a search's is rescaled to each plan's: estimate's note); a
    # re-estimate takes it there too, for the same figures. 0: not recorded (an older plan)
    profiled_micro_batch: int = 0


@exposes_shape  # plan.dp, plan.schedule, plan.world_size, ...: plan.shape's, read-only
@dataclass
class Plan:
    version: int = PLAN_VERSION  # of the layout (plan JSON); `migrated` reads every earlier one
    shape: Shape = field(default_factory=Shape)  # the degrees, schedule, microbatching, reduction, compile
    seq_len: int = 128
    stage_blocks: list[int] = field(default_factory=list)  # blocks per stage, in order; len = pp * virtual_stages
    compute_dtype: str = "float32"  # dtype of parameters in forward/backward
    reduce_dtype: str = "float32"  # dtype of gradient reduction
    optimizer: OptimizerPlan = field(default_factory=OptimizerPlan)
    root: BlockPlan = field(default_factory=BlockPlan)  # embedding, final norm, head
    blocks: list[BlockPlan] = field(default_factory=list)
    predicted: Prediction | None = None
    model: dict | None = None  # what was planned (ModelProfile.summary): name, exact parameter counts, shape

    # -- derived --
    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def layout(self) -> RankLayout:
        return self.shape.layout

    def stage_ranges(self) -> list[range]:
        """Block indices of each stage, in stage order (stage k runs on pipeline rank `stage_rank(k)`)."""
        out, start = [], 0
        for n in self.stage_blocks:
            out.append(range(start, start + n))
            start += n
        return out

    @property
    def offloads_state(self) -> bool:
        """Whether some unit's trainable state waits on host between steps (plan.placement)."""
        return any(u.placement.states_on_host for u in [self.root, *self.blocks])

    @property
    def runs_unwrapped(self) -> bool:
        """One process with nothing sharded or offloaded: the runtime runs the model as is, without FSDP2, whose
        hooks and per-microbatch copies on one rank cost ~4% of a small model's step on CPU and took the host
        twice a plain loop's time on an H200 (docs/gpu.md); below fp32, runtime.precision casts the compute copies
        once a step."""
        units = [self.root, *self.blocks]
        plain = all(u.zero == 0 and not u.placement.states_on_host for u in units)
        return self.world_size == 1 and plain and self.optimizer.master_weights == "fp32"

    @property
    def reduces_every_microbatch(self) -> bool:
        """Every backward reduces gradients as it makes them, so only the reduced shard accumulates: with
        grad_reduce "microbatch", or with one microbatch, whose backward is the step's only one."""
        return self.grad_reduce == "microbatch" or self.num_microbatches == 1

    @property
    def schedule_entry(self) -> Schedule:
        """The schedule's registry entry (plan.schedules): placement, program, runner."""
        return SCHEDULES[self.schedule]

    def stage_rank(self, stage: int) -> int:
        """The pipeline rank that runs `stage` (looped: stage % pp; V schedules fold back)."""
        return self.schedule_entry.rank_of(stage, self.pp)

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank pp_rank runs, in stage order."""
        return self.schedule_entry.stages_of(pp_rank, self.pp, self.virtual_stages)

    def program(self, pp_rank: int) -> list[Action]:
        """What pipeline rank pp_rank runs in a step, in order (plan.schedules): the time model simulates it and
        the runtime executes it."""
        return self.schedule_entry.program(self.pp, self.virtual_stages, self.num_microbatches, pp_rank,
                                           self.eviction_bound)

    @property
    def eviction_bound(self) -> int | None:
        """Most microbatches a rank whose schedule evicts keeps (BPipe: evict_bound, else ceil((pp+2)/2)); None
        where the schedule moves nothing."""
        return bpipe_bound(self.pp, self.evict_bound) if self.schedule_entry.evicts else None

    # -- construction --
    @classmethod
    def uniform(cls, n_blocks: int, *, block: BlockPlan | None = None, root: BlockPlan | None = None, **kw) -> "Plan":
        """Every block decided alike; stages split as evenly as possible (earlier stages get fewer). kw: Shape's
        fields and Plan's. The schedule defaults to 'none' without a pipeline and '1f1b' with one, virtual_stages to
        what the schedule runs."""
        wide = {name: value for name in SHAPE_FIELDS if (value := kw.pop(name, None)) is not None}
        pp = wide.get("pp", 1)
        schedule = wide.setdefault("schedule", "none" if pp == 1 else "1f1b")
        fixed = SCHEDULES[schedule].stages_per_rank if schedule in SCHEDULES else None
        virtual_stages = wide.setdefault("virtual_stages", fixed or 1)
        n_stages = pp * virtual_stages
        base, extra = divmod(n_blocks, n_stages)
        stage_blocks = [base + (1 if i >= n_stages - extra else 0) for i in range(n_stages)]
        block = block or BlockPlan()
        return cls(shape=Shape(**wide), stage_blocks=stage_blocks, root=root or block, blocks=[block] * n_blocks, **kw)

    # -- checks --
    def validate(self, n_blocks: int | None = None, world_size: int | None = None,
                 facts: ModelFacts | None = None) -> None:
        """Refuse a plan that contradicts itself (its fields, then every rule of plan.rules), the model (its
        blocks; its facts, which the rules read) or the launch."""
        self.shape.check("plan.shape")
        if self.seq_len < 1:
            raise PlanError(f"plan.seq_len must be >= 1, got {self.seq_len}")
        if len(self.stage_blocks) != self.pp * self.virtual_stages:
            raise PlanError(
                f"plan.stage_blocks has {len(self.stage_blocks)} stages, expected pp x virtual_stages = "
                f"{self.pp * self.virtual_stages}"
            )
        if any(n < 1 for n in self.stage_blocks) or sum(self.stage_blocks) != len(self.blocks):
            raise PlanError(
                f"plan.stage_blocks {self.stage_blocks} must be positive and sum to the {len(self.blocks)} blocks"
            )
        for name in ("compute_dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPES:
                raise PlanError(f"plan.{name} must be one of {DTYPES}, got {getattr(self, name)!r}")
        self.root.check("plan.root")
        for i, b in enumerate(self.blocks):
            b.check(f"plan.blocks[{i}]")
        self.optimizer.check()
        broken = self.rule_broken(facts)
        if broken:
            raise PlanError(broken)
        if world_size is not None and world_size != self.world_size:
            raise PlanError(
                f"plan is for {self.world_size} ranks but {world_size} were launched; "
                f"launch with --nproc {self.world_size} or re-plan"
            )
        if n_blocks is not None and len(self.blocks) != n_blocks:
            raise PlanError(f"plan has {len(self.blocks)} block decisions but the model has {n_blocks} blocks; re-plan")

    def rule_broken(self, facts: ModelFacts | None = None) -> str | None:
        """The first compatibility rule (plan.rules) the plan breaks beside the model's facts, naming where, or
        None."""
        for where, parts in self.rule_parts(facts):
            found = problem(parts)
            if found:
                return f"{where}: {found}"
        return None

    def rule_parts(self, facts: ModelFacts | None = None) -> Iterator[tuple[str, Parts]]:
        """What the rules read of this plan: its plan-wide parts, then each distinct unit's beside them."""
        wide = dict(seq_len=self.seq_len, compute_dtype=self.compute_dtype, in_backward=self.optimizer.in_backward,
                    model=facts)
        yield "plan", parts_of(self.shape, **wide)
        units = {}  # each distinct unit once, where it first appears
        for where, u in (("plan.root", replace(self.root, activations="keep", mlp_tiles=1)),  # the root: no policy
                         *((f"plan.blocks[{i}]", b) for i, b in enumerate(self.blocks))):
            units.setdefault(u, where)
        for u, where in units.items():
            yield where, parts_of(self.shape, **wide, zero=u.zero, placement=u.placement, activations=u.activations,
                                  mlp_tiles=u.mlp_tiles)

    # -- serialisation --
    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        d = migrated(d)
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise PlanError(f"plan has unknown fields {sorted(unknown)}; allowed: {sorted(known)}")
        unknown = set(d.get("shape", {})) - set(SHAPE_FIELDS)
        if unknown:
            raise PlanError(f"plan.shape has unknown fields {sorted(unknown)}; allowed: {sorted(SHAPE_FIELDS)}")
        d["shape"] = Shape(**d.get("shape", {}))
        d["root"] = BlockPlan(**d.get("root", {}))
        d["blocks"] = [BlockPlan(**b) for b in d.get("blocks", [])]
        d["optimizer"] = OptimizerPlan(**d.get("optimizer", {}))
        if d.get("predicted") is not None:
            d["predicted"] = Prediction(**d["predicted"])
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))


# version 1's unit booleans, each the placement it said (at most one of them was allowed)
_V1_PLACEMENTS = {"offload_optimizer": Placement.HOST_STEP, "offload_params": Placement.PARAMS_ON_HOST,
                  "stream_states": Placement.STREAMED}


def migrated(d: dict) -> dict:
    """A plan dict in the current layout (PLAN_VERSION), from one written in any earlier layout (a copy). Version 1
    (no version field) held the shape's fields flat, with the world size they multiply to, and said a unit's
    placement by three booleans, of which the rules allowed at most one."""
    version = d.get("version", 1)
    if version == PLAN_VERSION:
        return dict(d)
    if version != 1:
        raise PlanError(f"plan version {version!r} is not one this snugfit reads (1 to {PLAN_VERSION}); re-plan or "
                        "upgrade snugfit")
    out = {name: value for name, value in d.items() if name not in (*SHAPE_FIELDS, "world_size")}
    out.update(version=PLAN_VERSION, shape={name: d[name] for name in SHAPE_FIELDS if name in d})
    shape = Shape(**out["shape"])
    if "world_size" in d and d["world_size"] != shape.world_size:
        raise PlanError(f"plan: dp ({shape.dp}) x tp ({shape.tp}) x pp ({shape.pp}) must equal world_size "
                        f"({d['world_size']})")
    if "root" in d:
        out["root"] = _v1_unit(d["root"], "root")
    out["blocks"] = [_v1_unit(b, f"blocks[{i}]") for i, b in enumerate(d.get("blocks", []))]
    return out


def _v1_unit(unit: dict, where: str) -> dict:
    """A version-1 unit with its placement in place of its booleans."""
    unit = dict(unit)
    said = [name for name in _V1_PLACEMENTS if unit.pop(name, False)]
    if len(said) > 1:
        raise PlanError(f"plan.{where} sets {' and '.join(said)}, which place its states apart; keep one")
    if said:
        unit["placement"] = _V1_PLACEMENTS[said[0]].value
    return unit
