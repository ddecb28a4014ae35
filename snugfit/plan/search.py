"""Plan search: the fastest plan that fits (why the others lost: result.py).

Outer candidates (candidates.py): (dp, tp, pp, micro-batch, schedule), with global batch =
micro-batch x microbatches x dp and data-parallel groups only of like GPUs. Each candidate's inner
problem (per-block ZeRO stage, offload, activation policy, and stage sizes) is a
knapsack per pipeline stage (knapsack.py). Candidates are taken best-first: a cheap
lower bound (every block at its fastest option, perfectly balanced) orders them, and
one is solved only while it could still beat the best solved one. The winner is
verified with the full estimate() (verify.py); a plan it says does not fit is never returned
(the candidate is re-solved with the overshoot as slack, or dropped). BPipe is chosen
only when estimate() says it beats the best plan without it.

Assumes blocks alike (true of decoder stacks): the knapsack uses the largest block for
all of them; estimate() checks the actual plan.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
from collections.abc import Iterator
from dataclasses import astuple, replace

from snugfit.hardware.cluster import Cluster
from snugfit.plan.candidates import Candidate, outer_candidates
from snugfit.plan.cpu_ranks import cpu_stage_time, cpu_tp_time
from snugfit.plan.estimate import HOST_USABLE, tensor_parallel_problem
from snugfit.plan.knapsack import (
    BUCKETS, INF, StageCosts, buffer_bytes, fine_resolution, knapsack, resident_microbatches, split, usable,
    with_reserve,
)
from snugfit.plan.optimizer import state_bytes
from snugfit.plan.options import Constraints, block_options, buffer_kinds, may_be_fastest
from snugfit.plan.plan import BlockPlan, OptimizerPlan, Plan
from snugfit.plan.result import NoPlanError, SearchResult, explain_losses
from snugfit.plan.simulate import simulate
from snugfit.plan.timing import TensorParallel, gather_every
from snugfit.plan.verify import best_first, rescue
from snugfit.profile.types import DTYPE_BYTES, ModelProfile

def budget_for(cluster: Cluster, memory_budget: int | None) -> int:
    """The per-GPU limit estimate() applies: the smallest GPU's memory, or less if the user says so."""
    gpu_mem = min(cluster.gpu_of(r).memory_bytes for r in range(cluster.world_size))
    return min(memory_budget, gpu_mem) if memory_budget else gpu_mem


class Searcher:
    """One search's state: option costs shared by candidates, solved candidates, estimate() calls."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, global_batch: int, constraints: Constraints,
                 budget: int, reduce_dtype: str = "float32", optimizer: OptimizerPlan | None = None):
        self.prof, self.cluster, self.gb, self.c, self.budget = profile, cluster, global_batch, constraints, budget
        self.optimizer = optimizer or OptimizerPlan()  # the user's choice, modelled, never searched
        self.rdtype, self.n = reduce_dtype, len(profile.blocks)
        blocks = profile.blocks
        self.rep = max(range(self.n), key=lambda i: (blocks[i].num_params, blocks[i].saved_bytes["keep"]))
        self._scaled: dict[tuple[int, int], ModelProfile] = {}
        self._costs: dict[tuple, StageCosts] = {}
        self._costs_at: dict[tuple, StageCosts] = {}  # by first rank: the links need not be looked up again
        self._buffers_of: dict[tuple[int, int], tuple[float, float, float]] = {}
        self._opts: dict[tuple[int, bool], list[BlockPlan]] = {}
        self._fastest_of: dict[tuple[int, int], tuple[float, float, float]] = {}
        self.verified, self.verify_s = 0, 0.0
        self.cpu_only = all(n.gpu.name == "cpu" for n in cluster.nodes)
        self._node_kind = [next(j for j, other in enumerate(cluster.nodes) if other == n) for n in cluster.nodes]

    def candidates(self) -> list[Candidate]:
        return outer_candidates(self.prof, self.cluster, self.gb, self.c, self.optimizer.in_backward)

    def profile(self, cand: Candidate) -> ModelProfile:
        """The profile at the candidate's micro-batch size, as one of its tensor-parallel ranks holds it."""
        key = (cand.mbs, cand.tp)
        if key not in self._scaled:
            self._scaled[key] = self.prof.scaled(cand.mbs).split(cand.tp)
        return self._scaled[key]

    def costs(self, cand: Candidate, s: int) -> StageCosts:
        first = cand.first_rank(s)
        node = self.cluster.nodes[self.cluster.node_of(first)]
        busy = 1.0
        if cand.pp > 1 and node.gpu.name == "cpu" and node.count > node.host.cores:
            busy = _working_share(cand.pp, cand.m, cand.v)  # crowded CPU ranks: a pipeline's working share
        gathers = gather_every(cand.pp, cand.m)
        rdtype = self.reduce_dtype(cand)
        at = (first, cand.dp, cand.tp, cand.mbs, busy, gathers, cand.grad_reduce, rdtype)
        if at in self._costs_at:
            return self._costs_at[at]
        # stages on like nodes whose groups use like links cost the same: computed once (64 GPUs: 8x fewer); a link
        # is named by all its fields (one across nodes has the bandwidth and node count of the group it serves)
        dp_link = astuple(self.cluster.link_for(list(range(first, first + cand.dp * cand.tp, cand.tp))))
        tp_link = astuple(self.cluster.link_for(list(range(first, first + cand.tp))))
        key = (self._node_kind[self.cluster.node_of(first)], dp_link, tp_link, cand.dp, cand.tp, cand.mbs, busy,
               gathers, cand.grad_reduce, rdtype)
        if key not in self._costs:
            prof = self.profile(cand)
            tensor = None
            if cand.tp > 1:
                tensor = TensorParallel(cand.tp, self.cluster.link_for(list(range(first, first + cand.tp))),
                                        prof.micro_batch_size * prof.seq_len, cpu_tp_time(node))
            self._costs[key] = StageCosts(prof, self.cluster, first, cand.dp, rdtype, busy, tensor, gathers,
                                          cand.grad_reduce, self.optimizer)
        self._costs_at[at] = self._costs[key]
        return self._costs[key]

    def reduce_dtype(self, cand: Candidate) -> str:
        """The candidate's gradient-reduction dtype: the one asked for, but bf16 where one data-parallel rank reduces
        each gradient once, unaccumulated (dp 1, one microbatch or a reduction per microbatch): FSDP2 then only
        casts bf16 gradients into its reduce buffer and back, the same values either way, and an fp32 buffer
        costs twice the bytes (the embedding's and head's unit: 4 GB of a 24 GB card for an 8B model)."""
        if cand.dp == 1 and self.prof.dtype == "bfloat16" and (cand.m == 1 or cand.grad_reduce == "microbatch"):
            return "bfloat16"
        return self.rdtype

    def _stage(self, cand: Candidate, s: int):
        """(costs, representative block, root pieces, block options, root options, resident microbatches)."""
        prof = self.profile(cand)
        roots = ([prof.embed] if s == 0 else []) + ([prof.head] if s == cand.pp - 1 else [])
        r = resident_microbatches(cand.schedule, cand.pp, cand.m, s, cand.v, self.c.evict_bound)
        return (self.costs(cand, s), prof.blocks[self.rep], roots, self.options(cand.dp, cand.tp),
                self.options(cand.dp, cand.tp, True), r)

    def options(self, dp: int, tp: int = 1, root: bool = False) -> list[BlockPlan]:
        """The allowed options; on CPU ranks host and device are one memory, so offloading only costs time, and
        tensor-parallel plans offload nothing (the runtime does not combine them yet). States are streamed only
        where torchao updates them (bf16 weights, low-bit states)."""
        if (dp, tp, root) not in self._opts:
            opts = block_options(self.c, dp, root)
            if not self.optimizer.needs_torchao:
                # fp32 weights with fp32 states: streaming holds the fp32 weight and gradient on the device where host
                # offload holds a compute copy, and moves 16 bytes a parameter a step where host offload moves about
                # 6 and the host's fused AdamW takes about as long (RTX 4090 with a 1.5e9/s host: 0.14 s a block
                # each); left out, it only cost search time (llama-2-7b on 4 RTX 4090s: 0.28 s -> 0.47 s)
                opts = [o for o in opts if not o.stream_states]
            if self.cpu_only or tp > 1:
                lean = [o for o in opts if not (o.states_on_host or o.offloads_activations)]
                opts = lean if lean or tp > 1 else opts
                if self.cpu_only:  # nothing to stream states to: the host is the device
                    opts = [o for o in opts if not o.stream_states]
            self._opts[(dp, tp, root)] = opts
        return self._opts[(dp, tp, root)]

    def lower_bound(self, cand: Candidate) -> float:
        """Every block at its fastest option, perfectly balanced over the fastest GPU kind."""
        best = INF
        for s in {self.cluster.node_of(cand.first_rank(s)): s for s in range(cand.pp)}.values():
            tb, tr, t_mb = self._fastest(cand, s)
            pipe = cpu_stage_time(self.costs(cand, s).node) * cand.v if cand.pp > 1 else 0.0
            best = min(best, (self.n * tb + tr) / cand.pp + cand.m * pipe
                       + (cand.pp - 1) / cand.v * (self.n * t_mb / cand.pp + pipe))
        return best

    def _fastest(self, cand: Candidate, s: int) -> tuple[float, float, float]:
        """(block seconds per step, root seconds per step, block seconds per microbatch) at the fastest options;
        shared by the candidates (schedules) of one kind of stage and microbatch count."""
        st, blk, _, opts, ropts, _ = self._stage(cand, s)
        key = (id(st), cand.m)
        if key not in self._fastest_of:
            prof = self.profile(cand)
            opts, ropts = may_be_fastest(opts), may_be_fastest(ropts)
            self._fastest_of[key] = (
                min(st.cost(blk, o).time(cand.m) for o in opts),
                min(st.root([prof.embed, prof.head], o).time(cand.m) for o in ropts),
                min(st.cost(blk, o).t_mb for o in opts))
        return self._fastest_of[key]

    def _leanest(self, cand: Candidate, s: int, opts: list[BlockPlan],
                 ropts: list[BlockPlan]) -> tuple[BlockPlan, BlockPlan]:
        """(block option, root option) holding the least device memory on stage s with an even split."""
        st, blk, roots, _, _, r = self._stage(cand, s)
        share = math.ceil(self.n / cand.pp)
        b = min(opts, key=lambda o: share * st.cost(blk, o).mem(r, cand.m) + self._extra(cand, o))
        ro = min(ropts, key=lambda o: sum(st.cost(p, o).mem(r, cand.m) for p in roots))
        return b, ro

    def leanest_plan(self, cand: Candidate) -> Plan | None:
        """The candidate's least-memory plan (`_leanest` on every stage, blocks split evenly), for estimate() to
        judge where the knapsack's over-counting rejects the candidate (verify.rescue)."""
        pp, v = cand.pp, cand.v
        if self.n < pp * v:
            return None
        # later pipeline ranks hold fewer microbatches of activations: they take the remainder
        sizes = [self.n // pp + (1 if s >= pp - self.n % pp else 0) for s in range(pp)]
        choices, opts_of, ropts_of = [], [], []
        for s in range(pp):
            opts, ropts = self._stage(cand, s)[3:5]
            b, ro = self._leanest(cand, s, opts, ropts)
            has_root = s in (0, pp - 1)
            choices.append((ropts.index(ro) if has_root else None, [opts.index(b)] * sizes[s]))
            opts_of.append(opts)
            ropts_of.append(ropts)
        return self._build(cand, choices, sizes, opts_of, ropts_of)

    def need(self, cand: Candidate, offload: bool = True) -> tuple[int, int, BlockPlan | None]:
        """(device bytes, of which static, block option) of the least-memory assignment on the worst GPU
        (even split)."""
        worst: tuple[int, int, BlockPlan | None] = (0, 0, None)
        for s in range(cand.pp):
            st, blk, roots, opts, ropts, r = self._stage(cand, s)
            if not offload:
                opts = [o for o in opts if not (o.states_on_host or o.offloads_activations)]
                ropts = [o for o in ropts if not o.states_on_host] or ropts
            if not opts:
                return worst
            share = math.ceil(self.n / cand.pp)
            b, ro = self._leanest(cand, s, opts, ropts)
            static = sum(st.cost(p, ro).static for p in roots) + share * st.cost(blk, b).static
            total = (st.working_peak(blk, roots, opts, ropts, cand.m)
                     + sum(st.cost(p, ro).mem(r, cand.m) for p in roots)
                     + share * st.cost(blk, b).mem(r, cand.m) + self._extra(cand, b))
            at_root_reduce = (static + share * st.cost(blk, b).grads_reduced + st.root_reduce(roots, cand.m)
                              + sum(st.cost(p, ro).at_root for p in roots)
                              + (self._buffers(cand)[0] / 2 if b.zero == 3 else 0))  # one zero-3 block prefetched
            total = max(total, at_root_reduce)
            if with_reserve(st.gpu, total) > worst[0]:
                worst = (with_reserve(st.gpu, total), int(static), b)
        return worst

    def _room(self, cand: Candidate, s: int, slack: float) -> int:
        """Most blocks stage s could hold at all (each at its leanest option); 0 if fewer than v."""
        st, blk, roots, opts, ropts, r = self._stage(cand, s)
        free = usable(st.gpu, self.budget) - st.working_peak(blk, roots, opts, ropts, cand.m) - slack
        free -= min((sum(st.cost(p, o).mem(r, cand.m) for p in roots) for o in ropts), default=0)
        most = max(((free - self._extra(cand, o)) // max(st.cost(blk, o).mem(r, cand.m), 1) for o in opts), default=0)
        return int(most) if most >= cand.v else 0

    def _buffers(self, cand: Candidate) -> tuple[float, float, float, float]:
        """(ZeRO-3 gather buffers, activation-offload window, checkpoint-offload window, streamed states' window):
        two blocks of each, as memory.py counts them (the states unsharded: an upper bound)."""
        key = (cand.mbs, cand.tp)
        if key not in self._buffers_of:
            blk = self.profile(cand).blocks[self.rep]
            states = state_bytes(self.optimizer, blk.matrices, blk.num_trainable, 1)
            self._buffers_of[key] = (2 * blk.num_params * DTYPE_BYTES[self.prof.dtype], 2 * blk.saved_bytes["keep"],
                                     2 * blk.saved_bytes["recompute"], 2 * states)
        return self._buffers_of[key]

    def _extra(self, cand: Candidate, o: BlockPlan) -> float:
        kind = buffer_kinds(o)
        if not kind:
            return 0.0
        return buffer_bytes(self._buffers(cand), kind)

    def solve(self, cand: Candidate, slack: float = 0.0, fine: bool = False) -> None:
        """Fill cand.plan (None if nothing fits the knapsack) and cand.score; fine: at knapsack.fine_resolution."""
        cand.solved, pp = True, cand.pp
        n_max = self.n if pp == 1 else min(self.n - (pp - 1) * cand.v, math.ceil(3 * self.n / pp) + 1)
        buckets = fine_resolution(n_max) if fine else BUCKETS
        if sum(self._room(cand, s, slack) for s in range(pp)) < self.n:
            cand.plan, cand.score = None, INF
            return
        tables, opts_of, ropts_of = [], [], []
        for s in range(pp):
            st, blk, roots, opts, ropts, r = self._stage(cand, s)
            opts = self._host_fits(cand, st, blk, roots, opts, r)
            ropts = self._host_fits(cand, st, None, roots, ropts, r)
            opts_of.append(opts)
            ropts_of.append(ropts)
            rcost = None
            if roots:
                rcost = [st.root(roots, o) for o in ropts]
            cap = usable(st.gpu, self.budget) - st.working_peak(blk, roots, opts, ropts, cand.m) - slack
            tables.append(knapsack(rcost, [st.cost(blk, o) for o in opts], [buffer_kinds(o) for o in opts],
                                   [int(o.zero == 3) for o in ropts], resident=r, m=cand.m, cap=cap, n_max=n_max,
                                   buffers=self._buffers(cand), buckets=buckets))
        sizes = split([t.best for t in tables], self.n, cand.v)
        if sizes is None:
            cand.plan, cand.score = None, INF
            if pp == 1:
                self._solve_uniform(cand, slack, opts_of[0], ropts_of[0])
            return
        # the pipeline runtime's own work per stage and microbatch (CPU ranks), whatever the blocks do
        pipe = max(cpu_stage_time(self.costs(cand, s).node) for s in range(pp)) * cand.v if pp > 1 else 0.0
        bubble = (pp - 1) / cand.v * (max(t.t_mb(k) for t, k in zip(tables, sizes)) + pipe)
        cand.score = max(t.best[k] for t, k in zip(tables, sizes)) + cand.m * pipe + bubble
        cand.plan = self._build(cand, [t.choices(k) for t, k in zip(tables, sizes)], sizes, opts_of, ropts_of)

    def _solve_uniform(self, cand: Candidate, slack: float, opts: list[BlockPlan], ropts: list[BlockPlan]) -> None:
        """Without a pipeline, the fastest plan of one option for every block that fits, counted exactly. The
        knapsack rounds each block's memory up to its resolution, which can lose every plan where the blocks hold
        little beside a large root and working set (long contexts with offloaded checkpoints)."""
        st, blk, roots, _, _, r = self._stage(cand, 0)
        walk = st.working_peak(blk, roots, opts, ropts, cand.m)
        cap = usable(st.gpu, self.budget) - walk - slack
        best = None
        for o in opts:
            for ro in ropts:
                block, root = st.cost(blk, o), st.root(roots, ro)
                mem = (self.n * block.mem(r, cand.m) + root.mem(r, cand.m)
                       + buffer_bytes(self._buffers(cand), buffer_kinds(o) | int(ro.zero == 3)))
                at_root_reduce = (self.n * (block.static + block.grads_reduced) + root.static + root.at_root
                                  + st.root_reduce(roots, cand.m) + (self._buffers(cand)[0] / 2 if o.zero == 3 else 0))
                mem = max(mem, at_root_reduce - walk)
                t = self.n * block.time(cand.m) + root.time(cand.m)
                if mem <= cap and (best is None or t < best[0]):
                    best = (t, o, ro)
        if best is not None:
            cand.score = best[0]
            cand.plan = Plan(world_size=cand.dp * cand.tp, dp=cand.dp, tp=cand.tp, micro_batch_size=cand.mbs,
                             num_microbatches=cand.m, seq_len=self.prof.seq_len, stage_blocks=[self.n],
                             compute_dtype=self.prof.dtype, reduce_dtype=self.reduce_dtype(cand),
                             grad_reduce=cand.grad_reduce, compile=self.prof.compiled,
                             optimizer=replace(self.optimizer), root=replace(best[2]),
                             blocks=[replace(best[1]) for _ in range(self.n)])

    def _host_fits(self, cand: Candidate, st: StageCosts, blk, roots, opts: list[BlockPlan],
                   r: float) -> list[BlockPlan]:
        """The options whose host memory fits this rank's share of its node's RAM even if every block of an
        even split took them (the knapsack weighs device bytes only; estimate() checks host memory)."""
        if self.cpu_only:  # host and device are one memory: the budget already covers it
            return opts
        cap = HOST_USABLE * st.node.host.ram_bytes / st.node.count
        share = math.ceil(self.n / cand.pp)
        if blk is None:  # the root option: its own pieces
            return [o for o in opts if sum(st.cost(p, o).host_mem(r) for p in roots) <= cap]
        return [o for o in opts if share * st.cost(blk, o).host_mem(r) <= cap]

    def _build(self, cand: Candidate, choices, sizes: list[int], opts_of, ropts_of) -> Plan:
        """Lay each rank's chosen options out over its (virtual) stages."""
        pp, v = cand.pp, cand.v
        # Interleaved: a rank's first chunk may hold every resident microbatch at once (its forwards run ahead of
        # the last chunk's backwards), its last chunk about the share the knapsack assumes. So the first chunks
        # take the fewer blocks and the options that save the least; the peak then stays near the knapsack's count.
        chunks = [[k // v + (1 if i >= v - k % v else 0) for i in range(v)] for k in sizes]
        stage_blocks = [chunks[k % pp][k // pp] for k in range(pp * v)]
        blk = self.profile(cand).blocks[self.rep]
        act = [[self.costs(cand, s).cost(blk, o).act for o in opts_of[s]] for s in range(pp)]
        per_rank = [sorted(idx, key=lambda i, s=s: (act[s][i], i)) for s, (_, idx) in enumerate(choices)]
        blocks: list[BlockPlan] = []
        for k, nb in enumerate(stage_blocks):
            take, per_rank[k % pp] = per_rank[k % pp][:nb], per_rank[k % pp][nb:]
            blocks += [replace(opts_of[k % pp][i]) for i in take]
        roots = [ropts_of[s][choices[s][0]] for s in (0, pp - 1) if choices[s][0] is not None]
        root = min(roots, key=lambda o: (not o.offload_params, not o.offload_optimizer, -o.zero))  # the leaner
        return Plan(world_size=cand.dp * cand.tp * pp, dp=cand.dp, tp=cand.tp, pp=pp, micro_batch_size=cand.mbs, num_microbatches=cand.m,
                    seq_len=self.prof.seq_len, schedule=cand.schedule, virtual_stages=v, stage_blocks=stage_blocks,
                    evict_bound=self.c.evict_bound if cand.schedule == "bpipe" else None,
                    compute_dtype=self.prof.dtype, reduce_dtype=self.reduce_dtype(cand), grad_reduce=cand.grad_reduce,
                    compile=self.prof.compiled, optimizer=replace(self.optimizer), root=replace(root), blocks=blocks)


@functools.lru_cache(maxsize=256)
def _working_share(pp: int, m: int, v: int) -> float:
    """SimResult.working_share of a pipeline of like stages (estimate() simulates the plan's own)."""
    return simulate("interleaved" if v > 1 else "1f1b", pp, m, [1.0] * pp * v, [2.0] * pp * v, v=v).working_share()


def _preference(x) -> tuple:
    """Fastest first; among plans the time model cannot tell apart (3 significant digits: it is no finer), the one
    without BPipe, then the one holding the least memory (a compute-bound step hides parameter offload, which
    still costs host memory and PCIe traffic the model may under-count)."""
    p = x.plan.predicted
    return float(f"{p.step_time_s:.3g}"), x.schedule == "bpipe", p.peak_memory_bytes


# Runners-up verified whatever `alternatives` asks: the best must not depend on how many are shown. With none
# (`snugfit train` asks for none), llama-3-8b on 4xRTX4090 at seq 4096 and global batch 32 got a plan of 27.1 s a
# step where `snugfit plan`, verifying 3, chose one of 21.5 s.
EXPLORED = 3


@contextlib.contextmanager
def _without_cyclic_gc() -> Iterator[None]:
    """The search makes millions of short-lived objects (costs, schedule events, memory snapshots), all freed by
    their reference counts; the cyclic collector's passes over them were a fifth of a 70B search on 8x8 H100s
    (bench/plan_latency.py: 1.18-1.28 s with it, 0.91 s without)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def search(profile: ModelProfile, cluster: Cluster, *, global_batch: int, constraints: Constraints | None = None,
           memory_budget: int | None = None, reduce_dtype: str = "float32", alternatives: int = 3,
           compare_bpipe: bool = False, optimizer: OptimizerPlan | None = None) -> SearchResult:
    """The fastest plan estimate() says fits, up to `alternatives` runners-up, and why other families lost.

    profile: for the run's seq_len and dtype, at any micro-batch size (rescaled per candidate).
    compare_bpipe: also verify the best BPipe and best non-BPipe plan (for --explain-bpipe).
    optimizer: how weights are stored and updated (the user's choice, never searched: it changes the numerics).
    Raises NoPlanError (its .result has the rejections) when nothing fits; explain.advise() says what would.
    """
    with _without_cyclic_gc():
        return _search(profile, cluster, global_batch, constraints or Constraints(), memory_budget, reduce_dtype,
                       alternatives, compare_bpipe, optimizer)


def _search(profile: ModelProfile, cluster: Cluster, global_batch: int, c: Constraints, memory_budget: int | None,
            reduce_dtype: str, alternatives: int, compare_bpipe: bool,
            optimizer: OptimizerPlan | None) -> SearchResult:
    budget = budget_for(cluster, memory_budget)
    if c.tp and (problem := tensor_parallel_problem(profile, c.tp)):
        raise NoPlanError(f"{problem}; choose another --tp", SearchResult(None, budget_bytes=budget, candidates=0))
    srch = Searcher(profile, cluster, global_batch, c, budget, reduce_dtype, optimizer)
    cands = srch.candidates()
    res = SearchResult(None, budget_bytes=budget, candidates=len(cands))
    if not cands:
        fixed = ", ".join(f"{k}={v}" for k, v in c.fixed().items()) or "none"
        if optimizer is not None and optimizer.in_backward and c.grad_reduce == "step":
            raise NoPlanError(f"the step in backward needs one microbatch per step or gradients reduced every "
                              f"microbatch, and global batch {global_batch} takes several under --grad-reduce step; "
                              "set --grad-reduce microbatch", res)
        raise NoPlanError(f"global batch {global_batch} is not divisible into micro-batch x microbatches x dp "
                          f"on {cluster.world_size} GPUs with the fixed parts ({fixed})", res)
    for x in cands:
        x.lower = srch.lower_bound(x)
    found = best_first(srch, cands, 1 + max(alternatives, EXPLORED))
    found += rescue(srch, cands, found)
    plain = [x for x in cands if x.schedule != "bpipe"]
    if compare_bpipe or (found and found[0].schedule == "bpipe"):  # BPipe only where it beats the rest
        found += best_first(srch, plain, 1)
    if compare_bpipe:
        found += best_first(srch, [x for x in cands if x.schedule == "bpipe"], 1)
    found = sorted({id(x): x for x in found}.values(), key=_preference)
    plans = [x.plan for x in found]
    for p in plans:
        p.model = profile.summary()
    res.best, res.alternatives = (plans[0] if plans else None), plans[1:1 + alternatives]
    res.bpipe = next((p for p in plans if p.schedule == "bpipe"), None)
    res.best_without_bpipe = next((p for p in plans if p.schedule != "bpipe"), None)
    res.solved, res.verified, res.verify_s = sum(x.solved for x in cands), srch.verified, srch.verify_s
    explain_losses(srch, cands, found, res)
    if res.best is None:
        raise NoPlanError(f"no plan fits {budget / 2**30:.2f} GiB per GPU", res)
    return res
