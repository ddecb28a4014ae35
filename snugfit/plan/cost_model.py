"""The search's cost model: what a candidate's stages could hold and how fast, before any plan exists.

Per candidate (candidates.py) and pipeline stage: the options the fixed parts leave and no rule forbids
(plan.rules), their costs under stage_costs.StageCosts (shared by candidates whose stages are alike: same kind of
node, links, degrees, micro-batch), the microbatches the stage holds (from its schedule's program), and from
those a lower bound on the step, the least memory the candidate needs, and the most blocks a stage could hold.
solve.py turns them into a plan; search.py drives. Blocks are assumed alike (decoder stacks): every block is
priced as the typical one, the largest; estimate() checks the actual plan. Pure: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from snugfit.hardware.catalogue import Link
from snugfit.hardware.cluster import Cluster
from snugfit.plan.candidates import Candidate, outer_candidates
from snugfit.plan.cpu_ranks import cpu_stage_time, cpu_tp_time
from snugfit.plan.estimate import HOST_USABLE
from snugfit.plan.footprint import StageBuffers, stage_moments
from snugfit.plan.knapsack import INF, Table
from snugfit.plan.options import Constraints, block_options, may_be_fastest
from snugfit.plan.plan import BlockPlan, OptimizerPlan
from snugfit.plan.rules import allows_unit
from snugfit.plan.schedules import SCHEDULES
from snugfit.plan.simulate import bubble_microbatches, resident_microbatches, unit_run
from snugfit.plan.stage_costs import SharedCosts, StageCosts, usable, with_reserve
from snugfit.plan.context_parallel import ContextParallel, context_split
from snugfit.plan.expert_parallel import ExpertParallel
from snugfit.plan.timing import TensorParallel, gather_every, weight_share
from snugfit.profile.types import ModelProfile, PieceProfile


def _per_stage(cache: dict, cand: Candidate, s: int, make):
    """cache[(cand.shape, s)], made by make(cand, s) the first time."""
    at = (cand.shape, s)
    found = cache.get(at)
    if found is None:
        found = cache[at] = make(cand, s)
    return found


def _named(link: Link) -> tuple:
    """A link by all its fields, which are flat: dataclasses.astuple's deep copy of them was a quarter of
    _stage_costs (cProfile, advice.switches on 70B)."""
    return tuple(vars(link).values())


@dataclass(frozen=True)
class StageView:
    """One pipeline stage of a candidate as the search prices it."""

    costs: StageCosts
    block: PieceProfile  # the typical block, as which every block is priced
    roots: list[PieceProfile]  # the embedding (first stage) and head (last stage)
    options: list[BlockPlan]  # what a block may choose
    root_options: list[BlockPlan]
    resident: float  # microbatches of activations held at the stage's peak (schedules' programs)


class CostModel:
    """Option costs of every candidate's stages, cached for the search (one instance per search)."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, global_batch: int, constraints: Constraints,
                 budget: int, reduce_dtype: str = "float32", optimizer: OptimizerPlan | None = None):
        self.profile, self.cluster, self.global_batch = profile, cluster, global_batch
        self.constraints, self.budget, self.reduce_dtype = constraints, budget, reduce_dtype
        self.optimizer = optimizer or OptimizerPlan()  # the user's choice, modelled, never searched
        blocks = profile.blocks
        self.n_blocks = len(blocks)
        self.typical = max(range(self.n_blocks), key=lambda i: (blocks[i].num_params, blocks[i].saved_bytes["keep"]))
        self.cpu_only = all(n.gpu.name == "cpu" for n in cluster.nodes)
        self._node_kind = [next(j for j, other in enumerate(cluster.nodes) if other == n) for n in cluster.nodes]
        self._scaled: dict[tuple[int, int], ModelProfile] = {}
        self._costs: dict[tuple, StageCosts] = {}
        self._costs_at: dict[tuple, StageCosts] = {}  # by first rank: the links need not be looked up again
        self._shared: dict[tuple, SharedCosts] = {}
        self._costs_of: dict[tuple, StageCosts] = {}  # by candidate key and stage
        self._views: dict[tuple, StageView] = {}  # the same
        self.tables: dict[tuple, Table] = {}  # knapsack tables by their inputs (solve._table)
        self._buffers_of: dict[tuple[int, int, int], StageBuffers] = {}
        self._options: dict[tuple, list[BlockPlan]] = {}
        self._fastest_of: dict[tuple[int, int], tuple[float, float, float]] = {}

    def candidates(self) -> list[Candidate]:
        return outer_candidates(self.profile, self.cluster, self.global_batch, self.constraints,
                                self.optimizer.in_backward)

    def profile_at(self, cand: Candidate) -> ModelProfile:
        """The profile at the candidate's micro-batch size, as one of its tensor- and context-parallel ranks holds
        it."""
        key = (cand.micro_batch_size, cand.tp, cand.cp)
        if key not in self._scaled:
            self._scaled[key] = context_split(self.profile.scaled(cand.micro_batch_size).split(cand.tp), cand.cp,
                                              cand.tp)
        return self._scaled[key]

    def costs(self, cand: Candidate, s: int) -> StageCosts:
        """Stage s's option costs (cached by the candidate's key and the stage)."""
        return _per_stage(self._costs_of, cand, s, self._stage_costs)

    def _stage_costs(self, cand: Candidate, s: int) -> StageCosts:
        layout = cand.shape.layout
        first = layout.rank(s)
        node = self.cluster.nodes[self.cluster.node_of(first)]
        busy = 1.0
        if cand.pp > 1 and node.gpu.name == "cpu" and node.count > node.host.cores:
            # crowded CPU ranks: the schedule's working share
            busy = unit_run(cand.schedule, cand.pp, cand.num_microbatches, cand.virtual_stages).working_share()
        gathers = gather_every(cand.pp, cand.num_microbatches)
        replays = 2 if SCHEDULES[cand.schedule].splits_backward else 1
        rdtype = self.reduce_dtype_of(cand)
        at = (first, cand.dp, cand.cp, cand.ep, cand.tp, cand.micro_batch_size, busy, gathers, cand.grad_reduce, replays, rdtype)
        if at in self._costs_at:
            return self._costs_at[at]
        # stages on like nodes whose groups use like links cost the same: computed once (64 GPUs: 8x fewer); a link
        # is named by all its fields (one across nodes has the bandwidth and node count of the group it serves)
        dp_group, tp_group = layout.shard_group(first), layout.tp_group(first)
        dp_link, tp_link = _named(self.cluster.link_for(dp_group)), _named(self.cluster.link_for(tp_group))
        alike = (self._node_kind[self.cluster.node_of(first)], dp_link, tp_link, cand.dp, cand.cp, cand.ep, cand.tp,
                 cand.micro_batch_size, busy, gathers, rdtype)  # the stage's costs share their parts (SharedCosts)
        key = alike + (cand.grad_reduce, replays)
        if key not in self._costs:
            prof = self.profile_at(cand)
            tensor = None
            if cand.tp > 1:
                tensor = TensorParallel(cand.tp, self.cluster.link_for(tp_group),
                                        prof.micro_batch_size * prof.seq_len, cpu_tp_time(node))
            context = None
            if cand.cp > 1:
                context = ContextParallel.of(prof, cand.cp, self.cluster.link_for(layout.cp_group(first)), cand.tp)
            experts = None
            if cand.ep > 1:
                experts = ExpertParallel.of(prof, cand.ep, self.cluster.link_for(layout.ep_group(first)))
            shared = self._shared.setdefault(alike, SharedCosts())
            self._costs[key] = StageCosts(prof, self.cluster, dp_group, rdtype, busy, tensor,
                                          gathers, cand.grad_reduce, replays, self.optimizer, shared, context, experts)
        self._costs_at[at] = self._costs[key]
        return self._costs[key]

    def reduce_dtype_of(self, cand: Candidate) -> str:
        """The candidate's gradient-reduction dtype: the one asked for, but bf16 where one data-parallel rank reduces
        each gradient once, unaccumulated (dp 1, one microbatch or a reduction per microbatch): FSDP2 then only
        casts bf16 gradients into its reduce buffer and back, the same values either way, and an fp32 buffer
        costs twice the bytes (the embedding's and head's unit: 4 GB of a 24 GB card for an 8B model)."""
        if cand.shard_ranks == 1 and self.profile.dtype == "bfloat16" and (cand.num_microbatches == 1
                                                                  or cand.grad_reduce == "microbatch"):
            return "bfloat16"
        return self.reduce_dtype

    def stage(self, cand: Candidate, s: int) -> StageView:
        """Pipeline stage s of the candidate, priced (cached by the candidate's key and the stage)."""
        return _per_stage(self._views, cand, s, self._stage)

    def _stage(self, cand: Candidate, s: int) -> StageView:
        prof, on = self.profile_at(cand), SCHEDULES[cand.schedule].rank_of
        last = cand.pp * cand.virtual_stages - 1  # the embedding sits on the first stage's rank, the head on the last's
        roots = ([prof.embed] if on(0, cand.pp) == s else []) + ([prof.head] if on(last, cand.pp) == s else [])
        held = resident_microbatches(cand.schedule, cand.pp, cand.num_microbatches, s, cand.virtual_stages,
                                     self.constraints.evict_bound)
        return StageView(self.costs(cand, s), prof.blocks[self.typical], roots, self.options(cand),
                         self.options(cand, True), held)

    def options(self, cand: Candidate, root: bool = False) -> list[BlockPlan]:
        """The options the fixed parts allow that no rule (plan.rules) forbids beside the candidate's degrees and
        schedule; on CPU ranks host and device are one memory, so offloading only costs time. States are streamed
        only where torchao updates them (bf16 weights, low-bit states)."""
        key = (cand.dp, cand.cp, cand.tp, cand.schedule, cand.grad_reduce, root)
        if key not in self._options:
            opts = [o for o in block_options(self.constraints, cand.shard_ranks, root)
                    if allows_unit(o, cand.shape, root)]
            if not self.optimizer.needs_torchao:
                # fp32 weights with fp32 states: streaming holds the fp32 weight and gradient on the device where host
                # offload holds a compute copy, and moves 16 bytes a parameter a step where host offload moves about
                # 6 and the host's fused AdamW takes about as long (RTX 4090 with a 1.5e9/s host: 0.14 s a block
                # each); left out, it only cost search time (llama-2-7b on 4 RTX 4090s: 0.28 s -> 0.47 s)
                opts = [o for o in opts if not o.placement.streams_states]
            if self.cpu_only:  # nothing to stream states to either: the host is the device
                lean = [o for o in opts if not (o.placement.states_on_host or o.offloads_activations)]
                opts = lean or [o for o in opts if not o.placement.streams_states]
            self._options[key] = opts
        return self._options[key]

    def lower_bound(self, cand: Candidate) -> float:
        """Every block at its fastest option, perfectly balanced over the fastest GPU kind (each kind of stage
        once: stages on alike nodes share their costs)."""
        best, bubble, seen = INF, self.bubble(cand), set()
        for s in {self.cluster.node_of(cand.shape.layout.rank(s)): s for s in range(cand.pp)}.values():
            st = self.costs(cand, s)
            if id(st) in seen:
                continue
            seen.add(id(st))
            block, root, block_mb = self._fastest(cand, s)
            pipe = cpu_stage_time(st.node) * cand.virtual_stages if cand.pp > 1 else 0.0
            best = min(best, (self.n_blocks * block + root) / cand.pp + cand.num_microbatches * pipe
                       + bubble * (self.n_blocks * block_mb / cand.pp + pipe))
        return best

    def floor(self, cand: Candidate) -> float:
        """A bound below lower_bound(cand) under every optimizer setup (advice.switches weighs five): the blocks'
        per-microbatch seconds at their fastest option and the schedule's bubble, without the root and the step's
        once-a-step terms (the optimizer's and reduction's), the only ones the setup changes. 0 where it cannot
        tell: on one rank (whether the model runs unwrapped depends on the master weights), or where every option
        offloads (the setup decides which may stream states)."""
        if self.cluster.world_size == 1:
            return 0.0
        best = INF
        for s in {self.cluster.node_of(cand.shape.layout.rank(s)): s for s in range(cand.pp)}.values():
            lean = [o for o in self.options(cand) if not (o.placement.states_on_host or o.offloads_activations)]
            if not lean:
                return 0.0
            st, blk = self.costs(cand, s), self.profile_at(cand).blocks[self.typical]
            block_mb = min(st.cost(blk, o).t_mb for o in lean)
            pipe = cpu_stage_time(st.node) * cand.virtual_stages if cand.pp > 1 else 0.0
            best = min(best, self.n_blocks * block_mb * cand.num_microbatches / cand.pp
                       + cand.num_microbatches * pipe + self.bubble(cand) * (self.n_blocks * block_mb / cand.pp + pipe))
        return best

    def bubble(self, cand: Candidate) -> float:
        """The candidate's schedule's idle time per rank in microbatches of a rank's work; a split backward's
        moves the weight gradients (their share of the block's backward) into it."""
        return bubble_microbatches(cand.schedule, cand.pp, cand.num_microbatches, cand.virtual_stages,
                                   weight_share(self.profile_at(cand).blocks[self.typical]))

    def _fastest(self, cand: Candidate, s: int) -> tuple[float, float, float]:
        """(block seconds per step, root seconds per step, block seconds per microbatch) at the fastest options;
        shared by the candidates (schedules) of one kind of stage and microbatch count."""
        # not self.stage(): the microbatches a stage holds (its schedule's program walked) are not needed here, and
        # most candidates are never solved (70B on 8x8 H100s: 206 of 463)
        st, prof = self.costs(cand, s), self.profile_at(cand)
        blk = prof.blocks[self.typical]
        key = (id(st), cand.num_microbatches)
        if key not in self._fastest_of:
            opts, ropts = may_be_fastest(self.options(cand)), may_be_fastest(self.options(cand, True))
            self._fastest_of[key] = (
                min(st.cost(blk, o).time(cand.num_microbatches) for o in opts),
                min(st.root([prof.embed, prof.head], o).time(cand.num_microbatches) for o in ropts),
                min(st.cost(blk, o).t_mb for o in opts))
        return self._fastest_of[key]

    def leanest(self, cand: Candidate, s: int, opts: list[BlockPlan],
                ropts: list[BlockPlan]) -> tuple[BlockPlan, BlockPlan]:
        """(block option, root option) holding the least device memory on stage s with an even split."""
        view = self.stage(cand, s)
        st, blk, r = view.costs, view.block, view.resident
        share = math.ceil(self.n_blocks / cand.pp)
        extra = self.buffers(cand).extra
        b = min(opts, key=lambda o: share * st.cost(blk, o).mem(r, cand.num_microbatches) + extra(o))
        ro = min(ropts, key=lambda o: sum(st.cost(p, o).mem(r, cand.num_microbatches) for p in view.roots))
        return b, ro

    def need(self, cand: Candidate, offload: bool = True) -> tuple[int, int, BlockPlan | None]:
        """(device bytes, of which static, block option) of the least-memory assignment on the worst GPU
        (even split)."""
        m = cand.num_microbatches
        worst: tuple[int, int, BlockPlan | None] = (0, 0, None)
        for s in range(cand.pp):
            view = self.stage(cand, s)
            opts, ropts = view.options, view.root_options
            if not offload:
                opts = [o for o in opts if not (o.placement.states_on_host or o.offloads_activations)]
                ropts = [o for o in ropts if not o.placement.states_on_host] or ropts
            if not opts:
                return worst
            st, blk, roots = view.costs, view.block, view.roots
            b, ro = self.leanest(cand, s, opts, ropts)
            at = stage_moments(math.ceil(self.n_blocks / cand.pp), st.cost(blk, b), [st.cost(p, ro) for p in roots],
                               resident=view.resident, m=m, walk=st.working_peak(blk, roots, opts, ropts, m),
                               buffers=self.buffers(cand).extra(b), root_reduce=st.root_reduce(roots, m),
                               prefetched=self.buffers(cand).prefetched if b.zero == 3 else 0)
            if with_reserve(st.gpu, at.peak) > worst[0]:
                worst = (with_reserve(st.gpu, at.peak), int(at.static), b)
        return worst

    def room(self, cand: Candidate, s: int, slack: float) -> int:
        """Most blocks stage s could hold at all (each at its leanest option); 0 if fewer than its virtual stages."""
        m = cand.num_microbatches
        view = self.stage(cand, s)
        st, blk, roots, opts, ropts, r = (view.costs, view.block, view.roots, view.options, view.root_options,
                                          view.resident)
        free = usable(st.gpu, self.budget) - st.working_peak(blk, roots, opts, ropts, m) - slack
        free -= min((sum(st.cost(p, o).mem(r, m) for p in roots) for o in ropts), default=0)
        most = max(((free - self.buffers(cand).extra(o)) // max(st.cost(blk, o).mem(r, m), 1) for o in opts),
                   default=0)
        return int(most) if most >= cand.virtual_stages else 0

    def buffers(self, cand: Candidate) -> StageBuffers:
        """The once-per-stage buffers an option may need, on the candidate's typical block."""
        key = (cand.micro_batch_size, cand.tp, cand.ep)
        if key not in self._buffers_of:
            self._buffers_of[key] = self.costs(cand, 0).buffers(self.profile_at(cand).blocks[self.typical])
        return self._buffers_of[key]

    def host_fits(self, cand: Candidate, st: StageCosts, blk, roots, opts: list[BlockPlan],
                   r: float) -> list[BlockPlan]:
        """The options whose host memory fits this rank's share of its node's RAM even if every block of an
        even split took them (the knapsack weighs device bytes only; estimate() checks host memory)."""
        if self.cpu_only:  # host and device are one memory: the budget already covers it
            return opts
        cap = HOST_USABLE * st.node.host.ram_bytes / st.node.count
        share = math.ceil(self.n_blocks / cand.pp)
        if blk is None:  # the root option: its own pieces
            return [o for o in opts if sum(st.cost(p, o).host_mem(r) for p in roots) <= cap]
        return [o for o in opts if share * st.cost(blk, o).host_mem(r) <= cap]
