"""Plan search: the fastest plan that fits, found per pipeline stage by a knapsack, checked by estimate().

Outer loop: (dp, pp, micro-batch, schedule). Inner: every block of a stage picks one option
(ZeRO stage, optimizer/parameter offload, activation policy). An option costs
static bytes + resident microbatches x saved bytes, and microbatches x seconds per
microbatch + seconds per step, each from memory.py / timing.py applied to that block
alone, so the two models cannot drift apart. A multiple-choice knapsack over a
discretised memory budget (numpy) gives, for every block count, the fastest stage;
stage sizes are then chosen to minimise the slowest stage, which yields uneven
splits where the first/last stages carry embedding/head or the GPUs differ. The
best candidates of each schedule are verified with the full estimate(); a plan it
says does not fit is never returned (a failing candidate is re-solved with the
measured overshoot as extra slack).

Assumes blocks alike (true of decoder stacks): a stage's knapsack uses its largest
block as the representative, and estimate() checks the actual plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from snugfit.hardware.catalogue import GPU
from snugfit.hardware.cluster import Cluster
from snugfit.plan.estimate import estimate
from snugfit.plan.memory import FRAGMENTATION, StagePiece, device_bytes, device_saved, param_state
from snugfit.plan.plan import ACTIVATION_POLICIES, BlockPlan, Plan, PlanError
from snugfit.plan.timing import optimizer_time, ring_time, stage_time
from snugfit.profile.types import DTYPE_BYTES, ModelProfile, PieceProfile

BUCKETS = 256  # memory resolution of the knapsack (rounded up: conservative by < n_blocks / BUCKETS of a stage)
VERIFY_PER_SCHEDULE = 3  # candidates per schedule checked with the full estimate()
RETRIES = 2  # re-solves of a candidate that estimate() says overshoots
MAX_MICRO_BATCH = 16
INF = float("inf")


class NoPlanError(PlanError):
    """No candidate fits (or none is consistent with the fixed parts); carries the SearchResult."""

    def __init__(self, message: str, result: "SearchResult"):
        super().__init__(message)
        self.result = result


@dataclass
class Constraints:
    """Parts of the plan the user fixed; None = search it."""

    dp: int | None = None
    pp: int | None = None
    micro_batch: int | None = None
    num_microbatches: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    zero: int | None = None
    activations: str | None = None
    offload_optimizer: bool | None = None  # True: every block (and the root), False: none
    offload_params: bool | None = None
    evict_bound: int | None = None


@dataclass
class Candidate:
    """One outer choice and what its knapsack made of it."""

    dp: int
    pp: int
    mbs: int
    m: int
    schedule: str
    v: int = 1
    plan: Plan | None = None
    score: float = INF  # the knapsack's step-time estimate (seconds), for ranking before estimate()
    need_bytes: int = 0  # least device memory any option assignment needs on its worst rank
    need_static: int = 0  # of which parameters/gradients/optimizer states (for the advice)

    @property
    def family(self) -> str:
        return f"dp {self.dp} x pp {self.pp}"


@dataclass
class Rejection:
    family: str
    reason: str
    need_bytes: int
    have_bytes: int


@dataclass
class SearchResult:
    best: Plan | None
    alternatives: list[Plan] = field(default_factory=list)  # verified, fitting, fastest first (best excluded)
    rejected: list[Rejection] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)  # filled when nothing fits (see explain.advise)
    budget_bytes: int = 0
    candidates: int = 0  # outer candidates solved
    verified: int = 0  # full estimate() calls
    bpipe: Plan | None = None  # the best verified BPipe plan, chosen or not (for --explain-bpipe)
    best_without_bpipe: Plan | None = None


@dataclass
class _Cost:
    static: int  # bytes whatever the schedule
    act: int  # bytes per resident microbatch
    t_mb: float  # seconds per microbatch
    t_step: float  # seconds once per step (optimizer, gradient reduction)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def budget_for(cluster: Cluster, memory_budget: int | None) -> int:
    """The per-device limit estimate() applies (it uses the smallest GPU for every rank)."""
    gpu_mem = min(cluster.gpu_of(r).memory_bytes for r in range(cluster.world_size))
    return min(memory_budget, gpu_mem) if memory_budget else gpu_mem


def usable(gpu: GPU, budget: int) -> float:
    """Bytes the model may account for once the reserve (context + fragmentation) is taken off."""
    if gpu.name == "cpu":
        return float(budget)
    return (budget - gpu.context_bytes) / (1 + FRAGMENTATION)


def block_options(c: Constraints, dp: int, root: bool = False) -> list[BlockPlan]:
    """Every per-block decision the constraints allow; with dp == 1 ZeRO only matters for offload_params."""
    acts = ["keep"] if root else ([c.activations] if c.activations else list(ACTIVATION_POLICIES))
    zeros = [c.zero] if c.zero is not None else [0, 1, 2, 3]
    out = []
    for z in zeros:
        for mode in ("none", "optimizer", "params"):
            if (mode == "params" and z != 3) or (c.offload_params is not None and (mode == "params") != c.offload_params):
                continue
            if c.offload_optimizer is not None and (mode == "optimizer") != c.offload_optimizer:
                continue
            if dp == 1 and c.zero is None and z != (3 if mode == "params" else 0):
                continue
            out += [BlockPlan(z, mode == "optimizer", mode == "params", a) for a in acts]
    return out


class _Stage:
    """Option costs of one kind of stage (GPU, dp, micro-batch) and its knapsack tables."""

    def __init__(self, prof: ModelProfile, cluster: Cluster, rank: int, dp: int, dtype: str, reduce_dtype: str,
                 measured_on: str | None):
        node = cluster.nodes[cluster.node_of(rank)]
        self.node, self.dp, self.dtype, self.rdtype = node, dp, dtype, reduce_dtype
        self.dp_link = cluster.link_for(list(range(rank, rank + dp)))
        self.measured_on = measured_on
        self.stub = Plan(dp=dp, compute_dtype=dtype, reduce_dtype=reduce_dtype)
        self.cache: dict[tuple, _Cost] = {}

    def cost(self, p: PieceProfile, o: BlockPlan) -> _Cost:
        key = (p.name, o.zero, o.offload_optimizer, o.offload_params, o.activations)
        if key not in self.cache:
            self.cache[key] = self._cost(p, o)
        return self.cache[key]

    def _cost(self, p: PieceProfile, o: BlockPlan) -> _Cost:
        sp = StagePiece(p, o, p.num_params)
        dev, _ = param_state(self.stub, sp)
        kw = dict(gpu=self.node.gpu, dtype=self.dtype, reduce_dtype=self.rdtype, dp=self.dp, dp_link=self.dp_link,
                  pcie=self.node.pcie, measured_on=self.measured_on)
        one, two = stage_time([sp], **kw), stage_time([sp, sp], **kw)  # the marginal block: no first-gather
        t_mb = two.f_total + two.b_total - one.f_total - one.b_total
        opt_dev, opt_host = optimizer_time([sp], gpu=self.node.gpu, host=self.node.host, dp=self.dp, dtype=self.dtype,
                                           reduce_dtype=self.rdtype, pcie=self.node.pcie,
                                           ranks_on_host=self.node.count, bwd_last=0.0)
        g, c = DTYPE_BYTES[self.rdtype], DTYPE_BYTES[self.dtype]
        reduce = ring_time("all_reduce" if o.zero <= 1 else "reduce_scatter", sp.n_params * g, self.dp, self.dp_link)
        if o.zero in (1, 2):
            reduce += ring_time("all_gather", sp.n_params * c, self.dp, self.dp_link)
        return _Cost(sum(dev.values()), device_saved(sp), t_mb, opt_dev + opt_host + reduce)


def _working(p: PieceProfile) -> int:
    """The piece's own forward/backward peak above what is held (memory.stage_walk, policy 'keep')."""
    keep = p.saved_bytes["keep"]
    return max(p.input_bytes + p.fwd_peak_bytes, keep + p.output_bytes + p.bwd_peak_bytes)


def _pareto(items: list[tuple[float, float, int]]) -> list[tuple[float, float, int]]:
    """(mem, time, index) items no other item beats on both memory and time."""
    out: list[tuple[float, float, int]] = []
    for it in sorted(items):
        if not out or it[1] < out[-1][1]:
            out.append(it)
    return out


@dataclass
class _Table:
    """Knapsack result of one stage: best[n] seconds for n blocks, and the solutions to rebuild choices from."""

    best: list[float]
    sols: list
    blocks: list[_Cost]
    root: list[_Cost] | None

    def t_mb(self, n: int) -> float:
        r, idx = _choices(self.sols[n], n)
        return sum(self.blocks[i].t_mb for i in idx) + (self.root[r].t_mb if self.root is not None else 0.0)


def _knapsack(root: list[_Cost] | None, blocks: list[_Cost], resident: float, m: int, cap: float, n_max: int,
              comm: float, window: float, z3: list[bool], off: list[bool], root_z3: list[bool]) -> _Table:
    """Multiple-choice knapsack over (root item +) up to n_max identical blocks, per variant of the
    two once-per-stage buffers (ZeRO-3 gather buffer, activation-offload window); best of the variants."""
    best = [INF] * (n_max + 1)
    sols: list = [None] * (n_max + 1)
    for use_z3 in (False, True):
        for use_off in (False, True):
            if (use_z3 and not (any(z3) or any(root_z3))) or (use_off and not any(off)):
                continue
            c = cap - (comm if use_z3 else 0) - (window if use_off else 0)
            if c <= 0:
                continue
            unit = c / BUCKETS
            ok = [i for i in range(len(blocks)) if (use_z3 or not z3[i]) and (use_off or not off[i])]
            items = _pareto([(b.static + resident * b.act, m * b.t_mb + b.t_step, i) for i in ok
                             for b in [blocks[i]]])
            w = [math.ceil(mem / unit) for mem, _, _ in items]
            f = np.zeros(BUCKETS + 1)
            root_arg = None
            if root is not None:
                r_ok = [i for i in range(len(root)) if use_z3 or not root_z3[i]]
                ritems = _pareto([(r.static + resident * r.act, m * r.t_mb + r.t_step, i) for i in r_ok
                                  for r in [root[i]]])
                f, root_arg = _layer(np.zeros(BUCKETS + 1), ritems, [math.ceil(x / unit) for x, _, _ in ritems])
                root_arg = (root_arg, ritems, [math.ceil(x / unit) for x, _, _ in ritems])
            args = []
            for n in range(1, n_max + 1):
                f, arg = _layer(f, items, w)
                args.append(arg)
                if not math.isfinite(f[BUCKETS]):
                    break
                if f[BUCKETS] < best[n]:
                    best[n] = float(f[BUCKETS])
                    sols[n] = (items, w, list(args), root_arg)
    return _Table(best, sols, blocks, root)


def _layer(f: np.ndarray, items, w) -> tuple[np.ndarray, np.ndarray]:
    """One more block: g[b] = min over options j of f[b - w_j] + t_j (vectorised over options)."""
    wj = np.asarray(w)[:, None]
    src = np.arange(BUCKETS + 1)[None, :] - wj
    t = np.array([it[1] for it in items])[:, None]
    cand = np.where(src >= 0, f[np.clip(src, 0, None)] + t, INF)
    arg = cand.argmin(axis=0)
    return cand[arg, np.arange(BUCKETS + 1)], arg


def _choices(sol, n: int) -> tuple[int | None, list[int]]:
    """(root option index, block option indices) of the knapsack solution for n blocks."""
    items, w, args, root_arg = sol
    b, out = BUCKETS, []
    for k in range(n - 1, -1, -1):
        j = int(args[k][b])
        out.append(items[j][2])
        b -= w[j]
    root = None
    if root_arg is not None:
        arg, ritems, rw = root_arg
        root = ritems[int(arg[b])][2]
    return root, out


def resident_microbatches(schedule: str, pp: int, m: int, s: int, v: int = 1, bound: int | None = None) -> float:
    """Microbatches of activations pipeline rank s holds at its peak (the one in flight included)."""
    if schedule == "none":
        return 1.0
    if schedule == "interleaved":  # each (virtual stage, microbatch) pair is 1/v of the rank's blocks
        return min((v - 1) * pp + 2 * (pp - 1 - s) + 1, m * v) / v
    own = min(pp - s, m)
    if schedule == "bpipe":  # own up to the bound, plus what the heavy partner p-1-s evicts here
        bound = bound or math.ceil((pp + 2) / 2)
        return min(own, bound) + max(0, min(s + 1, m) - bound)
    return float(own)


def _describe(o: BlockPlan) -> str:
    parts = [f"ZeRO-{o.zero}"] if o.zero else ["replicated"]
    parts += ["optimizer offload"] if o.offload_optimizer else []
    parts += ["parameter offload"] if o.offload_params else []
    return " + ".join(parts + [o.activations if o.activations != "keep" else "activations kept"])


class Searcher:
    """Holds the per-(GPU, dp, micro-batch) option costs so that candidates share them."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, global_batch: int, constraints: Constraints,
                 budget: int, reduce_dtype: str = "float32"):
        self.prof, self.cluster, self.gb, self.c, self.budget = profile, cluster, global_batch, constraints, budget
        self.rdtype = reduce_dtype
        self.n = len(profile.blocks)
        self.rep = max(range(self.n), key=lambda i: (profile.blocks[i].num_params, profile.blocks[i].saved_bytes["keep"]))
        self._scaled: dict[int, ModelProfile] = {}
        self._stages: dict[tuple, _Stage] = {}
        self._tables: dict[tuple, _Table] = {}

    def candidates(self) -> list[Candidate]:
        c, w, out = self.c, self.cluster.world_size, []
        for pp in [c.pp] if c.pp else divisors(w):
            dp = w // pp
            if w % pp or (c.dp and c.dp != dp) or pp > self.n or self.gb % dp:
                continue
            if any(len({self.cluster.gpu_of(r).name for r in range(s * dp, (s + 1) * dp)}) > 1 for s in range(pp)):
                continue  # data-parallel groups only of like devices
            mbss = [c.micro_batch] if c.micro_batch else [d for d in divisors(self.gb // dp) if d <= MAX_MICRO_BATCH]
            for mbs in mbss:
                if self.gb % (dp * mbs):
                    continue
                m = self.gb // (dp * mbs)
                if c.num_microbatches and m != c.num_microbatches:
                    continue
                for sched in (["none"] if pp == 1 else ["1f1b", "interleaved", "bpipe"]):
                    v = (c.virtual_stages or 2) if sched == "interleaved" else 1
                    if (c.schedule and sched != c.schedule) or (pp > 1 and m < pp):
                        continue
                    if sched == "interleaved" and (m % pp or self.n < pp * v):
                        continue
                    out.append(Candidate(dp, pp, mbs, m, sched, v))
        return out

    def _stage(self, rank: int, dp: int, mbs: int) -> _Stage:
        key = (self.cluster.node_of(rank), dp, mbs)
        if key not in self._stages:
            if mbs not in self._scaled:
                self._scaled[mbs] = self.prof.scaled(mbs)
            self._stages[key] = _Stage(self._scaled[mbs], self.cluster, rank, dp, self.prof.dtype, self.rdtype,
                                       self.prof.device)
        return self._stages[key]

    def solve(self, cand: Candidate, slack: float = 0.0) -> None:
        """Fill cand.plan (None if no assignment fits the knapsack), cand.score and cand.need_*."""
        prof = self._scaled.get(cand.mbs) or self.prof.scaled(cand.mbs)
        self._scaled[cand.mbs] = prof
        pp, n, c = cand.pp, self.n, self.c
        blk = prof.blocks[self.rep]
        opts, ropts = block_options(c, cand.dp), block_options(c, cand.dp, root=True)
        itemsize = DTYPE_BYTES[prof.dtype]
        comm, window = 2 * blk.num_params * itemsize, 2 * blk.saved_bytes["keep"]
        n_max = n if pp == 1 else min(n - pp + 1, math.ceil(3 * n / pp) + 1)
        tables, needs, statics = [], [], []
        for s in range(pp):
            st = self._stage(s * cand.dp, cand.dp, cand.mbs)
            R = resident_microbatches(cand.schedule, pp, cand.m, s, cand.v, c.evict_bound)
            roots = ([prof.embed] if s == 0 else []) + ([prof.head] if s == pp - 1 else [])
            bcost = [st.cost(blk, o) for o in opts]
            rcost = None
            if roots:
                rcost = []
                for o in ropts:
                    parts = [st.cost(p, o) for p in roots]
                    extra = max(0, 2 * max(p.num_params for p in roots) * itemsize - comm) if o.zero == 3 else 0
                    rcost.append(_Cost(sum(x.static for x in parts) + extra, sum(x.act for x in parts),
                                       sum(x.t_mb for x in parts), sum(x.t_step for x in parts)))
            working = max(_working(p) for p in [blk, *roots])
            cap = usable(st.node.gpu, self.budget) - working - slack
            key = (id(st), R, s == 0, s == pp - 1, cand.m, n_max, slack)
            if key not in self._tables:
                self._tables[key] = _knapsack(rcost, bcost, R, cand.m, cap, n_max, comm, window,
                                              [o.zero == 3 for o in opts], [o.activations == "offload" for o in opts],
                                              [o.zero == 3 for o in ropts])
            tables.append(self._tables[key])
            share = math.ceil(n / pp)
            mem = lambda x, o: x.static + R * x.act + (comm if o.zero == 3 else 0) + (window if o.activations == "offload" else 0)  # noqa: E731
            bmin = min(range(len(opts)), key=lambda i: mem(bcost[i], opts[i]))
            rmin = min((rc.static + R * rc.act for rc in rcost or []), default=0)
            needs.append(working + rmin + share * mem(bcost[bmin], opts[bmin]))
            statics.append(rmin + share * bcost[bmin].static)
        worst = max(range(pp), key=lambda s: needs[s])
        gpu = self.cluster.gpu_of(worst * cand.dp)
        reserve = (lambda b: b) if gpu.name == "cpu" else (lambda b: b * (1 + FRAGMENTATION) + gpu.context_bytes)
        cand.need_bytes, cand.need_static = int(reserve(needs[worst])), int(statics[worst])
        split = _split([t.best for t in tables], n, cand.v)
        if split is None:
            cand.plan, cand.score = None, INF
            return
        times = [tables[s].best[k] for s, k in enumerate(split)]
        bubble = (pp - 1) / cand.v * max(tables[s].t_mb(k) for s, k in enumerate(split))
        cand.score = max(times) + bubble
        cand.plan = self._build(cand, [_choices(tables[s].sols[k], k) for s, k in enumerate(split)], split,
                                opts, ropts)

    def _build(self, cand: Candidate, choices, split: list[int], opts, ropts) -> Plan:
        """The Plan of a solved candidate: per-rank option lists laid out over its (virtual) stages."""
        pp, v = cand.pp, cand.v
        chunks = [[k // v + (1 if i < k % v else 0) for i in range(v)] for k in split]  # rank -> blocks per chunk
        stage_blocks = [chunks[k % pp][k // pp] for k in range(pp * v)]
        per_rank = [sorted(idx, key=lambda i: (opts[i].zero, opts[i].activations)) for _, idx in choices]
        blocks: list[BlockPlan] = []
        for k, nb in enumerate(stage_blocks):
            take, per_rank[k % pp] = per_rank[k % pp][:nb], per_rank[k % pp][nb:]
            blocks += [replace(opts[i]) for i in take]
        roots = [ropts[r] for r, _ in (choices[0], choices[-1]) if r is not None]
        root = min(roots, key=lambda o: (not o.offload_params, not o.offload_optimizer, -o.zero))
        return Plan(world_size=cand.dp * pp, dp=cand.dp, pp=pp, micro_batch_size=cand.mbs, num_microbatches=cand.m,
                    seq_len=self.prof.seq_len, schedule=cand.schedule, virtual_stages=v, stage_blocks=stage_blocks,
                    evict_bound=self.c.evict_bound if cand.schedule == "bpipe" else None,
                    compute_dtype=self.prof.dtype, reduce_dtype=self.rdtype, root=replace(root), blocks=blocks)


def _split(best: list[list[float]], n: int, v: int) -> list[int] | None:
    """Blocks per pipeline rank minimising the slowest rank (each rank >= v blocks), or None."""
    if len(best) == 1:
        return [n] if math.isfinite(best[0][n]) else None
    def caps(tau: float) -> list[int]:
        return [max((k for k in range(v, len(b)) if b[k] <= tau), default=0) for b in best]

    def ok(tau: float) -> bool:
        cs = caps(tau)
        return min(cs) >= v and sum(cs) >= n

    taus = sorted({t for b in best for t in b if math.isfinite(t)})
    if not taus or not ok(taus[-1]):
        return None
    lo, hi = 0, len(taus) - 1  # the feasible thresholds are a suffix: bisect for its start
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(taus[mid]) else (mid + 1, hi)
    split = caps(taus[lo])
    extra = sum(split) - n
    for s in sorted(range(len(best)), key=lambda s: -best[s][split[s]]):  # trim the slowest first
        cut = min(extra, split[s] - v)
        split[s] -= cut
        extra -= cut
    return split


def search(profile: ModelProfile, cluster: Cluster, *, global_batch: int, constraints: Constraints | None = None,
           memory_budget: int | None = None, reduce_dtype: str = "float32") -> SearchResult:
    """The fastest plan that estimate() says fits, its runners-up, and why the other families lost.

    profile: for the run's seq_len and dtype, any micro-batch size (rescaled here).
    Raises NoPlanError (with .result) when nothing fits; explain.advise() says what would.
    """
    c = constraints or Constraints()
    budget = budget_for(cluster, memory_budget)
    srch = Searcher(profile, cluster, global_batch, c, budget, reduce_dtype)
    cands = srch.candidates()
    res = SearchResult(None, budget_bytes=budget, candidates=len(cands))
    if not cands:
        raise NoPlanError(f"no dp x pp x micro-batch x microbatches gives global batch {global_batch} on "
                          f"{cluster.world_size} GPUs with the fixed parts {_fixed(c)}", res)
    for cand in cands:
        srch.solve(cand)
    fitting: list[tuple[float, Candidate]] = []
    for sched in sorted({x.schedule for x in cands}):
        ranked = sorted((x for x in cands if x.schedule == sched and x.plan), key=lambda x: x.score)
        for cand in ranked[:VERIFY_PER_SCHEDULE]:
            pred = _verify(srch, cand, res)
            if pred is not None:
                fitting.append((pred, cand))
    fitting.sort(key=lambda pc: pc[0])
    plans = [cd.plan for _, cd in fitting]
    res.best_without_bpipe = next((p for p in plans if p.schedule != "bpipe"), None)
    res.bpipe = next((p for p in plans if p.schedule == "bpipe"), None)
    # BPipe only where it pays: strictly faster than the best plan without it
    if res.bpipe is not None and res.best_without_bpipe is not None and \
            res.bpipe.predicted.step_time_s >= res.best_without_bpipe.predicted.step_time_s:
        plans = [p for p in plans if p.schedule != "bpipe"] + [p for p in plans if p.schedule == "bpipe"]
    res.best = plans[0] if plans else None
    res.alternatives = plans[1:]
    fit_families = {cd.family for _, cd in fitting}
    for fam in sorted({x.family for x in cands} - fit_families, key=lambda f: tuple(map(int, f.split()[1::3]))):
        least = min((x for x in cands if x.family == fam), key=lambda x: x.need_bytes)
        res.rejected.append(Rejection(fam, _reason(least, budget, srch), least.need_bytes, budget))
    if res.best is None:
        raise NoPlanError(f"no plan fits {budget / 2**30:.1f} GiB per GPU", res)
    return res


def _verify(srch: Searcher, cand: Candidate, res: SearchResult) -> float | None:
    """estimate() the candidate; re-solve with the overshoot as slack until it fits (or give up)."""
    slack = 0.0
    for _ in range(RETRIES + 1):
        if cand.plan is None:
            return None
        pred = estimate(cand.plan, srch.prof, srch.cluster, srch.budget)
        res.verified += 1
        if pred.fits:
            return pred.step_time_s
        over = max(device_bytes(m) for m in pred.memory_by_rank) - srch.budget
        if over <= 0:  # host memory, not device memory: slack cannot help
            return None
        slack += over * 1.25 + srch.budget / BUCKETS
        srch.solve(cand, slack)
    return None


def _reason(cand: Candidate, budget: int, srch: Searcher) -> str:
    gib = 2**30
    opts = block_options(srch.c, cand.dp)
    least = "every block " + _describe(min(opts, key=lambda o: (-o.offload_params, -o.zero, -o.offload_optimizer,
                                                              o.activations != "recompute")))
    if cand.need_bytes > budget:
        return (f"needs {cand.need_bytes / gib:.1f} GiB per GPU even with micro-batch {cand.mbs} and {least}, "
                f"has {budget / gib:.1f}")
    return "fits in the knapsack model but the full estimate() put every candidate over budget"


def _fixed(c: Constraints) -> str:
    given = {k: v for k, v in vars(c).items() if v is not None}
    return ", ".join(f"{k}={v}" for k, v in given.items()) or "(none)"
