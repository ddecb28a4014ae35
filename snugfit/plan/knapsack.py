"""The inner problem of the plan search: a knapsack per pipeline stage.

Every block of a stage picks one option (ZeRO stage, optimizer/parameter offload,
activation policy), at its cost (stage_costs.py: bytes and seconds). A multiple-choice knapsack
over a discretised memory budget (numpy, one vectorised layer per block) gives the
fastest stage for every block count; split() then sizes the stages so that the
slowest is as fast as possible (uneven where embedding/head or the GPUs differ).
Pure: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from snugfit.plan.footprint import StageBuffers
from snugfit.plan.stage_costs import Cost

BUCKETS = 128  # memory resolution (rounded up: conservative by < blocks / BUCKETS of a stage's budget)
FINE_BUCKETS_PER_BLOCK = 8  # `fine_resolution`: rounding within an eighth of a stage's budget
INF = float("inf")


def fine_resolution(blocks: int) -> int:
    """Buckets that keep the rounding within 1 / FINE_BUCKETS_PER_BLOCK of a stage's budget however many blocks it
    holds: at BUCKETS, 80 blocks whose options differ by a fraction of a bucket each lose up to 80/128 of it.
    Costlier in proportion, so the search solves at BUCKETS and re-solves only the plans it polishes so."""
    return max(BUCKETS, FINE_BUCKETS_PER_BLOCK * blocks)


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
    sols: list  # n -> (items, block layer, tables entering each block layer, root solution) or None
    blocks: list[Cost]
    root: list[Cost] | None
    buckets: int = BUCKETS

    def choices(self, n: int) -> tuple[int | None, list[int]]:
        """(root option index, block option indices) of the n-block solution."""
        items, layer, entering, root_sol = self.sols[n]
        b, out = self.buckets, []
        for k in range(n - 1, -1, -1):
            j = layer.choice(entering[k], b)
            out.append(items[j][2])
            b -= layer.w[j]
        if root_sol is None:
            return None, out
        root_layer, ritems = root_sol
        return ritems[root_layer.choice(np.zeros(self.buckets + 1), b)][2], out

    def t_mb(self, n: int) -> float:
        r, idx = self.choices(n)
        return sum(self.blocks[i].t_mb for i in idx) + (self.root[r].t_mb if r is not None else 0.0)


class _Layer:
    """Adds one item to a knapsack table: g[b] = min over options j of f[b - w_j] + t_j.

    The gather indices depend only on the weights, so they are built once per item set and reused for every
    block added (a 70B search on 8x8 H100s adds 300,000 layers). A layer gives the minima only, one pass down a
    row per option; the option taken at a bucket is found again, from the table the layer was given, for the few
    buckets a solution is rebuilt from (`choice`). Its argument at every bucket, then the minimum at it, took
    twice as long (an argmin along each bucket's few options).
    """

    def __init__(self, items: list[tuple[float, float, int]], w: list[int], buckets: int):
        self.w = w
        src = np.arange(buckets + 1)[None, :] - np.asarray(w)[:, None]  # one row per option
        self.src = np.maximum(src, 0)
        # out-of-range sources cost infinity: added as a penalty to the item times
        self.t = np.where(src >= 0, np.array([it[1] for it in items])[:, None], INF)
        self._work = np.empty(self.src.shape)  # every call's candidates, in one buffer

    def __call__(self, f: np.ndarray) -> np.ndarray:
        cand = f.take(self.src, out=self._work)
        cand += self.t
        return np.minimum.reduce(cand, axis=0)  # ndarray.min's Python wrapper costs a tenth of the call

    def choice(self, f: np.ndarray, b: int) -> int:
        """The option the layer took at bucket b given table f: the first of the least time, as a minimum is."""
        return int((f.take(self.src[:, b]) + self.t[:, b]).argmin())


def knapsack(root: list[Cost] | None, blocks: list[Cost], needs: list[frozenset[str]],
             root_needs: list[frozenset[str]], *, resident: float, m: int, cap: float, n_max: int,
             buffers: StageBuffers, buckets: int = BUCKETS) -> Table:
    """Fastest (root +) n identical blocks within cap, for n = 1..n_max.

    needs[i]: the once-per-stage buffers option i needs (StageBuffers.needs); these are paid once per stage, so
    the knapsack is solved once per set of them (reserved up front, options needing others left out).
    """
    best, sols = [INF] * (n_max + 1), [None] * (n_max + 1)
    # each option's (bytes, seconds, index), priced once for every set of buffers below
    priced = [(b.mem(resident, m), b.time(m), i) for i, b in enumerate(blocks)]
    rpriced = [(r.mem(resident, m), r.time(m), i) for i, r in enumerate(root or [])]
    for reserved in buffers.subsets(frozenset().union(*needs, *root_needs)):
        c = cap - buffers.bytes_of(reserved)
        if c <= 0:
            continue
        unit = c / buckets
        items = pareto([it for it in priced if needs[it[2]] <= reserved])
        items = [it for it in items if it[0] <= c]
        if not items:
            continue
        w = [math.ceil(x / unit) for x, _, _ in items]
        f, root_sol, ritems = np.zeros(buckets + 1), None, []
        if root is not None:
            ritems = pareto([it for it in rpriced if root_needs[it[2]] <= reserved])
            ritems = [it for it in ritems if it[0] <= c]
            if not ritems:
                continue
        used = frozenset().union(*(needs[it[2]] for it in items), *(root_needs[it[2]] for it in ritems))
        if used != reserved:  # a buffer no option worth taking needs: the set without it does better
            continue
        if root is not None:
            root_layer = _Layer(ritems, [math.ceil(x / unit) for x, _, _ in ritems], buckets)
            f, root_sol = root_layer(f), (root_layer, ritems)
        entering, layer = [], _Layer(items, w, buckets)  # the table each block layer was given: its solution's
        for n in range(1, n_max + 1):
            entering.append(f)
            f = layer(f)
            top = float(f[buckets])
            if not math.isfinite(top):
                break
            if top < best[n]:  # the n-block solution reads entering[:n], which later layers only extend
                best[n], sols[n] = top, (items, layer, entering, root_sol)
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
