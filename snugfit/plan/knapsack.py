"""The inner problem of the plan search: per-block option costs and a knapsack per pipeline stage.

Every block of a stage picks one option (ZeRO stage, optimizer/parameter offload,
activation policy). An option costs bytes (static + accumulating gradients + resident
microbatches x saved activations) and seconds (microbatches x per-microbatch time +
per-step time), each taken from memory.py / timing.py applied to that block alone,
so the search and the full estimate() share one model. A multiple-choice knapsack
over a discretised memory budget (numpy, one vectorised layer per block) gives the
fastest stage for every block count; split() then sizes the stages so that the
slowest is as fast as possible (uneven where embedding/head or the GPUs differ).
Pure: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from snugfit.hardware.catalogue import GPU
from snugfit.hardware.cluster import Cluster
from snugfit.plan.memory import (
    FRAGMENTATION, StagePiece, accumulating_grad_bytes, device_saved, gathered_bytes, host_saved, param_state,
)
from snugfit.plan.optimizer import master_bytes
from snugfit.plan.plan import BlockPlan, OptimizerPlan, Plan
from snugfit.plan.corrections import corrected
from snugfit.plan.timing import TensorParallel, grad_reduce_exposed, optimizer_time, reduce_time, stage_time
from snugfit.profile.types import DTYPE_BYTES, ModelProfile, PieceProfile

BUCKETS = 128  # memory resolution (rounded up: conservative by < blocks / BUCKETS of a stage's budget)
FINE_BUCKETS_PER_BLOCK = 8  # `fine_resolution`: rounding within an eighth of a stage's budget
INF = float("inf")


def fine_resolution(blocks: int) -> int:
    """Buckets that keep the rounding within 1 / FINE_BUCKETS_PER_BLOCK of a stage's budget however many blocks it
    holds: at BUCKETS, 80 blocks whose options differ by a fraction of a bucket each lose up to 80/128 of it.
    Costlier in proportion, so the search solves at BUCKETS and re-solves only the plans it polishes so."""
    return max(BUCKETS, FINE_BUCKETS_PER_BLOCK * blocks)


@dataclass
class Cost:
    """One piece under one option."""

    static: int  # device bytes held all step (parameters, states, gathered copies of a zero 0-2 piece)
    # device gradient bytes at the peak: unsharded (accumulating, or fresh in the first backward); the reduced
    # shard where every microbatch reduces (grad_reduce "microbatch")
    grads: int
    grads_reduced: int  # the same with one microbatch: only the reduced shard (sync is on as it is made); none
    # where each unit steps in backward (the stepping unit's is a once-per-stage buffer, StageCosts.stepping)
    act: int  # device bytes per resident microbatch
    t_mb: float  # seconds per microbatch (forward, backward, recompute, exposed transfers)
    t_step: float  # seconds once per step (optimizer, gradient reduction)
    host: int = 0  # host bytes held all step (offloaded parameters, gradients, optimizer states)
    host_act: int = 0  # host bytes per resident microbatch (offloaded activations)
    # the root's: what its reduce and step, the backward's last moment, hold beyond `static` (its streamed states, less
    # its gathered copy, freed before the reduce)
    at_root: int = 0

    def mem(self, resident: float, m: int) -> float:
        return self.static + (self.grads if m > 1 else self.grads_reduced) + resident * self.act

    def time(self, m: int) -> float:
        return m * self.t_mb + self.t_step

    def host_mem(self, resident: float) -> float:
        return self.host + resident * self.host_act


def usable(gpu: GPU, budget: int) -> float:
    """Bytes the model may account for once the reserve (context + fragmentation) is taken off."""
    return float(budget) if gpu.name == "cpu" else (budget - gpu.context_bytes) / (1 + FRAGMENTATION)


def with_reserve(gpu: GPU, nbytes: float) -> int:
    return int(nbytes if gpu.name == "cpu" else nbytes * (1 + FRAGMENTATION) + gpu.context_bytes)


def working(p: PieceProfile) -> int:
    """The piece's own forward/backward peak above what is held (memory.stage_walk, policy 'keep')."""
    keep = p.saved_bytes["keep"]
    return max(p.input_bytes + p.fwd_peak_bytes, keep + p.output_bytes + p.bwd_peak_bytes)


class StageCosts:
    """Option costs on one kind of rank (its node's GPU, dp, micro-batch), cached per piece and option."""

    def __init__(self, prof: ModelProfile, cluster: Cluster, rank: int, dp: int, reduce_dtype: str,
                 busy: float = 1.0, tensor: TensorParallel | None = None, gathers: int = 1,
                 grad_reduce: str = "step", replays: int = 1, optimizer: OptimizerPlan | None = None):
        self.node = cluster.nodes[cluster.node_of(rank)]
        self.gpu = self.node.gpu
        self.dp, self.dtype, self.rdtype, self.measured_on = dp, prof.dtype, reduce_dtype, prof.device
        self.busy = busy  # the share of the node's ranks working at once (cpu_ranks.local_ranks)
        self.tensor = tensor  # prof is then one tensor-parallel rank's (ModelProfile.split)
        self.gathers = gathers  # microbatches one gather of a ZeRO-1/2 unit serves (timing.gather_every)
        self.grad_reduce = grad_reduce  # plan.GRAD_REDUCE: when gradients are reduced
        self.replays = replays  # times a backward recomputes what the policy dropped (2 where the schedule splits it)
        tp = tensor.size if tensor else 1
        self.dp_link = cluster.link_for(list(range(rank, rank + dp * tp, tp)))  # plan.RankLayout: tp innermost
        self.stub = Plan(world_size=cluster.world_size, dp=dp, compute_dtype=prof.dtype, reduce_dtype=reduce_dtype,
                         grad_reduce=grad_reduce, optimizer=optimizer or OptimizerPlan())
        # one process whose blocks shard and offload nothing runs the model unwrapped (Plan.runs_unwrapped)
        self.unwrapped = cluster.world_size == 1 and self.stub.optimizer.master_weights == "fp32"
        self._cache: dict[tuple, Cost] = {}
        self._walks: dict[tuple, float] = {}  # working_peak's
        self._computed: dict[tuple, tuple[float, float]] = {}  # piece_compute's, the same for every option

    def working_peak(self, blk: PieceProfile, roots: list[PieceProfile], opts: list[BlockPlan],
                     ropts: list[BlockPlan], m: int) -> float:
        """The largest piece's working peak above the held bytes the knapsack counts, a block's with FSDP2's
        gradient buffers of the backward that syncs (memory.sync_held), at the leanest options. The held bytes
        include the piece's own saved activations of the microbatch in flight, which working() counts too
        (memory.stage_walk counts them once), so they come off, at the piece's leanest option to stay an upper
        bound. Stepping in backward, the stepping unit's gradient comes on top (`stepping`). Cached: the search
        asks for it per candidate and stage (`opts`/`ropts` are the search's own cached lists, so their identity
        names them)."""
        every = m == 1 or self.grad_reduce == "microbatch"  # every backward syncs (Plan.reduces_every_microbatch)
        key = (blk.name, tuple(p.name for p in roots), every, id(opts), id(ropts))
        if key not in self._walks:
            sync = (min(self._reduce_held(blk, o) for o in opts)
                    + (min(self._head_held(roots, ro) for ro in ropts) if every else 0.0))
            self._walks[key] = max(working(p) - min(self.cost(p, o).act for o in (opts if p is blk else ropts))
                                   + (sync if p is blk else 0) for p in [blk, *roots]) + self.stepping(blk, opts)
        return self._walks[key]

    def _reduce_held(self, blk: PieceProfile, block: BlockPlan) -> float:
        """During a block's backward that syncs: the reduce-scatter input of the block reduced before it, less
        that block's gathered copy, freed after its backward (zero 0-2). None on one rank, which runs
        unwrapped (nearly always)."""
        if self.unwrapped:
            return 0.0
        freed = gathered_bytes(self.stub, StagePiece(blk, block, blk.num_params)) if block.zero < 3 else 0
        return max(0.0, DTYPE_BYTES[self.rdtype] * blk.num_trainable - freed)

    def _head_held(self, roots: list[PieceProfile], root: BlockPlan) -> float:
        """Where every backward syncs: the head's unsharded gradient where it exceeds the shard the costs count
        for it (the root is reduced last)."""
        if self.unwrapped:
            return 0.0
        stepped = self.stub.optimizer.in_backward  # its shard is freed once it steps
        shard = 0 if root.offload_optimizer or root.offload_params or stepped else (
            master_bytes(self.stub.optimizer) / (self.dp if root.zero >= 1 else 1))
        return sum(p.num_trainable for p in roots if p.name == "head") * max(0.0, DTYPE_BYTES[self.dtype] - shard)

    def root_reduce(self, roots: list[PieceProfile], m: int) -> float:
        """FSDP2's bytes at the root unit's reduce, the backward's last, beyond the held static bytes: the root's
        unsharded gradients and its reduce-scatter input (memory.rank_memory's last reduce moment)."""
        if self.unwrapped:
            return 0.0
        own = DTYPE_BYTES[self.rdtype if m > 1 and self.grad_reduce == "step" else self.dtype]
        return (own + DTYPE_BYTES[self.rdtype]) * sum(p.num_trainable for p in roots)

    def stepping(self, blk: PieceProfile, opts: list[BlockPlan]) -> float:
        """Stepping in backward: the device gradient of the unit stepping (a block's reduced shard, at its
        leanest option), which the costs leave out (Cost.grads_reduced)."""
        if not self.stub.optimizer.in_backward:
            return 0.0
        return min(param_state(self.stub, StagePiece(blk, o, blk.num_params))[0].get("gradients", 0) for o in opts)

    def cost(self, p: PieceProfile, o: BlockPlan) -> Cost:
        """A block under option o (what one more such block adds to the stage). Called in the search's inner
        loops: the cache lookup is kept to one tuple."""
        key = (p.name, o.zero, o.offload_optimizer, o.offload_params, o.activations, o.stream_states)
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = self._cost((p,), o)
        return found

    def root(self, pieces: list[PieceProfile], o: BlockPlan) -> Cost:
        """The stage's root pieces (embedding, final norm, head) under option o: one FSDP2 unit."""
        key = ("+".join(p.name for p in pieces), o.zero, o.offload_optimizer, o.offload_params, o.activations,
               o.stream_states)
        if key not in self._cache:
            self._cache[key] = self._cost(tuple(pieces), o)
        return self._cache[key]

    def _cost(self, pieces: tuple[PieceProfile, ...], o: BlockPlan) -> Cost:
        sps = [StagePiece(p, o, p.num_params) for p in pieces]
        block = sps[0].is_block
        static = reduced = grads = host_bytes = act = host_act = at_root = 0
        for sp in sps:
            dev, host = param_state(self.stub, sp)
            reduced += dev.pop("gradients", 0)  # the reduced shard: below the unsharded gradients the peak holds
            static += sum(dev.values())
            if not block and o.zero == 3:  # the root's gathered copy stays from forward through backward
                static += gathered_bytes(self.stub, sp)
            if not block:  # at its reduce FSDP2 has freed its gathered copy; its streamed states come for its step
                at_root += host.get("optimizer_states", 0) * o.stream_states - gathered_bytes(self.stub, sp)
            grads += accumulating_grad_bytes(self.stub, sp)
            host_bytes += sum(host.values())
            act += device_saved(sp)
            host_act += host_saved(sp)
        if self.grad_reduce == "microbatch":  # each backward reduces what it made: only the shard accumulates
            grads = reduced
        if self.stub.optimizer.in_backward:  # each unit steps once reduced and frees its gradient
            reduced = 0
        unwrapped = replace(self.stub, root=o, blocks=[o]).runs_unwrapped  # a lone process, nothing sharded
        kw = dict(node=self.node, dtype=self.dtype, reduce_dtype=self.rdtype, dp=self.dp, dp_link=self.dp_link,
                  measured_on=self.measured_on, wrapped=not unwrapped, busy=self.busy, tensor=self.tensor,
                  computed=self._computed, gathers=self.gathers)
        one, two = stage_time(sps, **kw), stage_time(sps + sps, **kw)
        # a block: what one more such unit adds (no first gather to expose); on CPU ranks nothing overlaps, so a unit
        # costs the same wherever it is. The root is one unit per stage, the first to gather: counted whole (the
        # difference dropped its FSDP2 overhead, so on one GPU a sharded root cost what a plain one did)
        t_mb = one.f_total + one.b_total
        if self.gpu.name != "cpu" and block:
            t_mb = two.f_total + two.b_total - t_mb
        # a block's host step hides behind its own backward, as estimate() hides the sum behind the whole one
        opt_dev, opt_host = optimizer_time(sps, gpu=self.gpu, host=self.node.host, dp=self.dp, dtype=self.dtype,
                                           reduce_dtype=self.rdtype, pcie=self.node.pcie,
                                           ranks_on_host=self.node.count, optimizer=self.stub.optimizer,
                                           bwd_last=one.bwd + one.recompute if block else 0.0)
        if self.gpu.name == "cpu":  # CPU ranks: what estimate() charges, the measured FSDP2 cost, all exposed
            reduce = grad_reduce_exposed([(one, sps)], self.dp, self.dp_link, 0.0, cpu=self.node)
        else:  # a block's reduction hides behind the next block's backward (estimate() overlaps the sum)
            reduce = sum(reduce_time(sp, sp.n_trainable * DTYPE_BYTES[self.rdtype], self.dp, self.dp_link)
                         for sp in sps)
            if block:
                reduce = max(0.0, reduce - one.bwd - one.recompute)
        reduce = corrected("dp_comm_exposed", reduce, self.node)
        opt_dev = corrected("optimizer", opt_dev, self.node)
        opt_host = corrected("offload_exposed", opt_host, self.node)
        if self.grad_reduce == "microbatch":  # one reduction per microbatch (timing.reductions)
            t_mb, reduce = t_mb + reduce, 0.0
        if self.replays > 1:  # a split backward's W recomputes again (simulate.split_backward), and its host work
            t_mb += one.recompute + one.split_host
        return Cost(static, grads, reduced, act, t_mb, opt_dev + opt_host + reduce + one.update, host_bytes, host_act,
                    at_root)


def pareto(items: list[tuple[float, float, int]]) -> list[tuple[float, float, int]]:
    """(mem, time, index) items that no other item beats on both memory and time."""
    out: list[tuple[float, float, int]] = []
    for it in sorted(items):
        if not out or it[1] < out[-1][1]:
            out.append(it)
    return out


@dataclass
class Table:
    """A stage's knapsack: best[n] seconds for n blocks (inf: does not fit), and how to rebuild the choice."""

    best: list[float]
    sols: list  # n -> (items, weights, per-layer argmin arrays, root solution) or None
    blocks: list[Cost]
    root: list[Cost] | None
    buckets: int = BUCKETS

    def choices(self, n: int) -> tuple[int | None, list[int]]:
        """(root option index, block option indices) of the n-block solution."""
        items, w, args, root_sol = self.sols[n]
        b, out = self.buckets, []
        for k in range(n - 1, -1, -1):
            j = int(args[k][b])
            out.append(items[j][2])
            b -= w[j]
        if root_sol is None:
            return None, out
        arg, ritems = root_sol
        return ritems[int(arg[b])][2], out

    def t_mb(self, n: int) -> float:
        r, idx = self.choices(n)
        return sum(self.blocks[i].t_mb for i in idx) + (self.root[r].t_mb if r is not None else 0.0)


class _Layer:
    """Adds one item to a knapsack table: g[b] = min over options j of f[b - w_j] + t_j.

    The gather indices depend only on the weights, so they are built once per item set
    and reused for every block added (the search adds thousands of layers).
    """

    def __init__(self, items: list[tuple[float, float, int]], w: list[int], buckets: int):
        src = np.arange(buckets + 1)[None, :] - np.asarray(w)[:, None]
        self.src = np.maximum(src, 0)
        # out-of-range sources cost infinity: added as a penalty row to the item times
        self.t = np.where(src >= 0, np.array([it[1] for it in items])[:, None], INF)
        self.cols = np.arange(buckets + 1)

    def __call__(self, f: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cand = f[self.src] + self.t
        arg = cand.argmin(axis=0)
        return cand[arg, self.cols], arg


def buffer_bytes(buffers: tuple[float, ...], mask: int) -> float:
    """The once-per-stage buffers a set of option kinds (bit j: buffers[j]) needs."""
    return sum(b for j, b in enumerate(buffers) if mask >> j & 1)


def knapsack(root: list[Cost] | None, blocks: list[Cost], kinds: list[int], root_kinds: list[int], *,
             resident: float, m: int, cap: float, n_max: int, buffers: tuple[float, ...],
             buckets: int = BUCKETS) -> Table:
    """Fastest (root +) n identical blocks within cap, for n = 1..n_max.

    kinds[i]: bit j set if option i needs once-per-stage buffer j (`buffers[j]`: the ZeRO-3 prefetch copies,
    the activation-offload window, the checkpoint-offload window); these are paid once per stage, so the
    knapsack is solved once per set of them (reserved up front, options needing others left out).
    """
    best, sols = [INF] * (n_max + 1), [None] * (n_max + 1)
    every = 0
    for k in [*kinds, *root_kinds]:
        every |= k

    for mask in [x for x in range(1 << len(buffers)) if x & ~every == 0]:
        c = cap - buffer_bytes(buffers, mask)
        if c <= 0:
            continue
        unit = c / buckets
        items = pareto([(b.mem(resident, m), b.time(m), i) for i, b in enumerate(blocks) if kinds[i] & ~mask == 0])
        items = [it for it in items if it[0] <= c]
        if not items:
            continue
        w = [math.ceil(x / unit) for x, _, _ in items]
        f, root_sol, ritems = np.zeros(buckets + 1), None, []
        if root is not None:
            ritems = pareto([(r.mem(resident, m), r.time(m), i) for i, r in enumerate(root)
                             if root_kinds[i] & ~mask == 0])
            ritems = [it for it in ritems if it[0] <= c]
            if not ritems:
                continue
        used = 0
        for it in items:
            used |= kinds[it[2]]
        for it in ritems:
            used |= root_kinds[it[2]]
        if used != mask:  # a buffer no option worth taking needs: the mask without it does better
            continue
        if root is not None:
            f, arg = _Layer(ritems, [math.ceil(x / unit) for x, _, _ in ritems], buckets)(f)
            root_sol = (arg, ritems)
        args, layer = [], _Layer(items, w, buckets)
        for n in range(1, n_max + 1):
            f, arg = layer(f)
            args.append(arg)
            if not math.isfinite(f[buckets]):
                break
            if f[buckets] < best[n]:
                best[n], sols[n] = float(f[buckets]), (items, w, list(args), root_sol)
    return Table(best, sols, blocks, root, buckets)


def split(best: list[list[float]], n: int, v: int) -> list[int] | None:
    """Blocks per pipeline rank (each >= v) minimising the slowest rank's time, or None if none fits."""
    if len(best) == 1:
        return [n] if len(best[0]) > n and math.isfinite(best[0][n]) else None

    def caps(tau: float) -> list[int]:
        return [max((k for k in range(v, len(b)) if b[k] <= tau), default=0) for b in best]

    def ok(tau: float) -> bool:
        cs = caps(tau)
        return min(cs) >= v and sum(cs) >= n

    taus = sorted({t for b in best for t in b[v:] if math.isfinite(t)})
    if not taus or not ok(taus[-1]):
        return None
    lo, hi = 0, len(taus) - 1  # feasible thresholds form a suffix: bisect for its start
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(taus[mid]) else (mid + 1, hi)
    out = caps(taus[lo])
    extra = sum(out) - n
    for s in sorted(range(len(best)), key=lambda s: -best[s][out[s]]):  # trim the slowest first
        cut = min(extra, out[s] - v)
        out[s] -= cut
        extra -= cut
    return out
