"""Solve one candidate: the fastest assignment of options to its blocks and of blocks to its stages that the
cost model says fits, as a Plan.

A multiple-choice knapsack per pipeline stage (knapsack.py) gives each stage's fastest time for every block count;
knapsack.split sizes the stages so that the slowest is as fast as possible; `layout` lays each rank's choices out
over its virtual stages. Without a pipeline, where the knapsack's rounding loses every plan, one option for every
block is tried exactly (`_solve_uniform`). Pure: a function of the cost model and the candidate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from snugfit.plan.candidates import Candidate
from snugfit.plan.cost_model import CostModel
from snugfit.plan.cpu_ranks import cpu_stage_time
from snugfit.plan.footprint import StageBuffers, stage_moments
from snugfit.plan.knapsack import BUCKETS, Table, fine_resolution, knapsack, split
from snugfit.plan.plan import BlockPlan, Plan
from snugfit.plan.schedules import SCHEDULES
from snugfit.plan.stage_costs import Cost, usable


@dataclass
class Solution:
    plan: Plan
    score: float  # the knapsack's step time of the plan (estimate() checks it)


def solve(model: CostModel, cand: Candidate, slack: float = 0.0, fine: bool = False) -> Solution | None:
    """The candidate's fastest plan with `slack` bytes kept free on every stage (None if nothing fits the
    knapsack); fine: at knapsack.fine_resolution."""
    pp, n = cand.pp, model.n_blocks
    n_max = n if pp == 1 else min(n - (pp - 1) * cand.virtual_stages, math.ceil(3 * n / pp) + 1)
    buckets = fine_resolution(n_max) if fine else BUCKETS
    if not _room_for(model, cand, slack, n):
        return None
    tables, opts_of, ropts_of = [], [], []
    for s in range(pp):
        view = model.stage(cand, s)
        st, blk, roots, r = view.costs, view.block, view.roots, view.resident
        # the working peak over every option, not only those the host RAM allows: more RAM (more options) would
        # otherwise leave the knapsack less room for all (and working_peak's cache keys these lists by identity)
        walk = st.working_peak(blk, roots, view.options, view.root_options, cand.num_microbatches)
        cap = usable(st.gpu, model.budget) - walk - slack
        opts = model.host_fits(cand, st, blk, roots, view.options, r)
        ropts = model.host_fits(cand, st, None, roots, view.root_options, r)
        opts_of.append(opts)
        ropts_of.append(ropts)
        rcost = [st.root(roots, o) for o in ropts] if roots else None
        tables.append(_table(model, rcost, [st.cost(blk, o) for o in opts], [StageBuffers.needs(o) for o in opts],
                             [StageBuffers.needs(o, root=True) for o in ropts], resident=r, m=cand.num_microbatches,
                             cap=cap, n_max=n_max, buffers=model.buffers(cand), buckets=buckets))
    sizes = split([t.best for t in tables], n, cand.virtual_stages)
    if sizes is None:
        return _solve_uniform(model, cand, slack, opts_of[0], ropts_of[0]) if pp == 1 else None
    # the pipeline runtime's own work per stage and microbatch (CPU ranks), whatever the blocks do
    pipe = max(cpu_stage_time(model.costs(cand, s).node) for s in range(pp)) * cand.virtual_stages if pp > 1 else 0.0
    bubble = model.bubble(cand) * (max(t.t_mb(k) for t, k in zip(tables, sizes)) + pipe)
    score = max(t.best[k] for t, k in zip(tables, sizes)) + cand.num_microbatches * pipe + bubble
    return Solution(layout(model, cand, [t.choices(k) for t, k in zip(tables, sizes)], sizes, opts_of, ropts_of),
                    score)


def _room_for(model: CostModel, cand: Candidate, slack: float, n: int) -> bool:
    """Whether the stages could hold n blocks at all (CostModel.room), summed until they could."""
    total = 0
    for s in range(cand.pp):
        total += model.room(cand, s, slack)
        if total >= n:
            return True
    return False


def _table(model: CostModel, root: list[Cost] | None, blocks: list[Cost], needs: list[frozenset[str]],
           root_needs: list[frozenset[str]], *, resident: float, m: int, cap: float, n_max: int,
           buffers: StageBuffers, buckets: int) -> Table:
    """knapsack.knapsack, solved once per search for each set of inputs: alike stages of other candidates (the
    same kind of rank and microbatches held) and re-solves at the same slack ask for the same table (70B on 8x8
    H100s: 1321 distinct of 2442). Costs are named by identity: each is StageCosts' cached one for its option."""
    key = (None if root is None else tuple(map(id, root)), tuple(map(id, blocks)), tuple(needs), tuple(root_needs),
           resident, m, cap, n_max, buffers, buckets)
    table = model.tables.get(key)
    if table is None:
        table = model.tables[key] = knapsack(root, blocks, needs, root_needs, resident=resident, m=m, cap=cap,
                                             n_max=n_max, buffers=buffers, buckets=buckets)
    return table


def _solve_uniform(model: CostModel, cand: Candidate, slack: float, opts: list[BlockPlan],
                   ropts: list[BlockPlan]) -> Solution | None:
    """Without a pipeline, the fastest plan of one option for every block that fits, counted exactly. The
    knapsack rounds each block's memory up to its resolution, which can lose every plan where the blocks hold
    little beside a large root and working set (long contexts with offloaded checkpoints)."""
    m = cand.num_microbatches
    view = model.stage(cand, 0)
    st, blk, roots, r, n = view.costs, view.block, view.roots, view.resident, model.n_blocks
    walk = st.working_peak(blk, roots, view.options, view.root_options, m)  # as solve() counts it
    cap, buffers = usable(st.gpu, model.budget) - slack, model.buffers(cand)
    best = None
    for o in opts:
        for ro in ropts:
            block, root = st.cost(blk, o), st.root(roots, ro)
            at = stage_moments(n, block, [root], resident=r, m=m, walk=walk,
                               buffers=buffers.bytes_of(buffers.needs(o) | buffers.needs(ro, root=True)),
                               root_reduce=st.root_reduce(roots, m),
                               prefetched=buffers.prefetched if o.zero == 3 else 0)
            t = n * block.time(m) + root.time(m)
            if at.peak <= cap and (best is None or t < best[0]):
                best = (t, o, ro)
    if best is None:
        return None
    prof = model.profile
    return Solution(Plan(shape=cand.shape, seq_len=prof.seq_len, stage_blocks=[n], compute_dtype=prof.dtype,
                         reduce_dtype=model.reduce_dtype_of(cand), optimizer=replace(model.optimizer), root=best[2],
                         blocks=[best[1]] * n), best[0])


def leanest_plan(model: CostModel, cand: Candidate) -> Plan | None:
    """The candidate's least-memory plan (CostModel.leanest on every stage, blocks split evenly), for estimate()
    to judge where the knapsack's over-counting rejects the candidate (verify.rescue)."""
    pp, v, n = cand.pp, cand.virtual_stages, model.n_blocks
    if n < pp * v:
        return None
    # later pipeline ranks hold fewer microbatches of activations: they take the remainder
    sizes = [n // pp + (1 if s >= pp - n % pp else 0) for s in range(pp)]
    choices, opts_of, ropts_of = [], [], []
    for s in range(pp):
        view = model.stage(cand, s)
        opts, ropts = view.options, view.root_options
        b, ro = model.leanest(cand, s, opts, ropts)
        choices.append((ropts.index(ro) if view.roots else None, [opts.index(b)] * sizes[s]))
        opts_of.append(opts)
        ropts_of.append(ropts)
    return layout(model, cand, choices, sizes, opts_of, ropts_of)


def layout(model: CostModel, cand: Candidate, choices, sizes: list[int], opts_of, ropts_of) -> Plan:
    """Lay each pipeline rank's chosen options (choices[s]: root option index, block option indices) out over its
    (virtual) stages."""
    pp, v = cand.pp, cand.virtual_stages
    # Interleaved: a rank's first chunk may hold every resident microbatch at once (its forwards run ahead of
    # the last chunk's backwards), its last chunk about the share the knapsack assumes. So the first chunks
    # take the fewer blocks and the options that save the least; the peak then stays near the knapsack's count.
    chunks = [[k // v + (1 if i >= v - k % v else 0) for i in range(v)] for k in sizes]
    sched = SCHEDULES[cand.schedule]
    rank_of = [sched.rank_of(k, pp) for k in range(pp * v)]  # looped, or folded back in a V
    chunk_of = [sched.stages_of(rank_of[k], pp, v).index(k) for k in range(pp * v)]  # its place on its rank
    stage_blocks = [chunks[rank_of[k]][chunk_of[k]] for k in range(pp * v)]
    blk = model.profile_at(cand).blocks[model.typical]
    act = [[model.costs(cand, s).cost(blk, o).act for o in opts_of[s]] for s in range(pp)]
    per_rank = [sorted(idx, key=lambda i, s=s: (act[s][i], i)) for s, (_, idx) in enumerate(choices)]
    blocks: list[BlockPlan] = []
    for k, nb in enumerate(stage_blocks):
        r = rank_of[k]
        take, per_rank[r] = per_rank[r][:nb], per_rank[r][nb:]
        blocks += [opts_of[r][i] for i in take]
    roots = [ropts_of[s][choices[s][0]] for s in range(pp) if choices[s][0] is not None]
    # the leaner
    root = min(roots, key=lambda o: (not o.placement.params_on_host, not o.placement.steps_on_host, -o.zero))
    prof = model.profile
    return Plan(shape=cand.shape, seq_len=prof.seq_len, stage_blocks=stage_blocks, compute_dtype=prof.dtype,
                reduce_dtype=model.reduce_dtype_of(cand), optimizer=replace(model.optimizer), root=root, blocks=blocks)
