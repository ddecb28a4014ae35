"""Plan search: the fastest plan that fits (why the others lost: result.py).

The driver. Outer candidates (candidates.py): (dp, tp, pp, micro-batch, schedule, gradient reduction), with
global batch = micro-batch x microbatches x dp and data-parallel groups only of like GPUs. The cost model
(cost_model.py) prices each candidate's stages and bounds its step from below; solve.py solves a candidate's
inner problem (per-block ZeRO stage, offload, activation policy, and stage sizes: a knapsack per pipeline stage).
Candidates are taken best-first: the lower bound orders them, and one is solved only while it could still beat
the best solved one. The winner is verified with the full estimate() (verify.py); a plan it says does not fit is
never returned (the candidate is re-solved with the overshoot as slack, or dropped). BPipe is chosen only when
estimate() says it beats the best plan without it; a winner that offloads state is replaced by the same plan with
nothing offloaded where the time model cannot tell their steps apart (verify.simpler).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import replace

from snugfit.hardware.cluster import Cluster
from snugfit.plan.candidates import next_splittable_batch, ranks_word
from snugfit.plan.cost_model import CostModel
from snugfit.plan.facts import ModelFacts
from snugfit.plan.options import Constraints
from snugfit.plan import rules
from snugfit.plan.plan import OptimizerPlan, Plan
from snugfit.plan.policies import SELECTIVE as SELECTIVE_NAMES
from snugfit.plan.result import NoPlanError, SearchLog, SearchResult, explain_losses
from snugfit.plan.schedules import SCHEDULES
from snugfit.plan.verify import best_first, rescue, simpler
from snugfit.profile.types import ModelProfile


def budget_for(cluster: Cluster, memory_budget: int | None) -> int:
    """The per-GPU limit estimate() applies: the smallest GPU's memory, or less if the user says so."""
    gpu_mem = min(cluster.gpu_of(r).memory_bytes for r in range(cluster.world_size))
    return min(memory_budget, gpu_mem) if memory_budget else gpu_mem


# A plan whose schedule splits the backward must be this much faster to be preferred: the time model cannot tell
# plans closer than about 1% apart, and the split runs more of torch's runtime (a Python walk of the stage's
# graph per input pass, an autograd call per group of weights) than the model charges where the host runs ahead.
SPLIT_MARGIN = 0.01


def _preference(plan: Plan) -> tuple:
    """Fastest first; among plans the time model cannot tell apart (3 significant digits: it is no finer; a
    split backward's plan SPLIT_MARGIN slower than it says), the one without BPipe, then the one holding the least
    memory (a compute-bound step hides parameter offload, which still costs host memory and PCIe traffic the
    model may under-count)."""
    p, entry = plan.predicted, plan.schedule_entry
    step = p.step_time_s * (1 + SPLIT_MARGIN if entry.splits_backward else 1)
    return float(f"{step:.3g}"), entry.evicts, p.peak_memory_bytes


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
    compare_bpipe: also verify the best BPipe, non-BPipe, 1F1B and V-schedule plans (for --explain-bpipe).
    optimizer: how weights are stored and updated (the user's choice, never searched: it changes the numerics).
    Raises NoPlanError (its .result has the rejections) when nothing fits; advice.advise() says what would.
    """
    c = constraints or Constraints()
    with _without_cyclic_gc():
        if not (c.shards_over_data and cluster.world_size > 1):
            return _search_tiled_or_not(profile, cluster, global_batch, c, memory_budget, reduce_dtype,
                                        alternatives, compare_bpipe, optimizer)
        # --zero N on several ranks: sharded over data-parallel ranks where any such layout fits, else say why not
        try:
            return _search_tiled_or_not(profile, cluster, global_batch, replace(c, min_dp=2), memory_budget,
                                        reduce_dtype, alternatives, compare_bpipe, optimizer)
        except NoPlanError as e:
            why = str(e)
        res = _search_tiled_or_not(profile, cluster, global_batch, c, memory_budget, reduce_dtype, alternatives,
                                   compare_bpipe, optimizer)
        res.note = (f"--zero {c.zero} shards nothing here: no plan with data-parallel ranks fits ({why}), so it "
                    f"runs on dp {res.best.dp}; fix --dp and --pp to choose the layout")
        return res


def _search_tiled_or_not(profile: ModelProfile, cluster: Cluster, global_batch: int, c: Constraints, *rest
                         ) -> SearchResult:
    """The search, and where a tiled MLP is worth weighing, the search with every block's MLP tiled beside it:
    the better of the two."""
    tiles = mlp_tiles_worth_trying(profile, c)
    if tiles == 1:
        return _search(profile, cluster, global_batch, c, *rest)
    found, failed = [], None
    for fixed in (c, replace(c, mlp_tiles=tiles)):
        try:
            found.append(_search(profile, cluster, global_batch, fixed, *rest))
        except NoPlanError as err:
            failed = failed or err
    if not found:
        raise failed
    return min(found, key=lambda r: _preference(r.best))


# A tiled MLP is weighed from this sequence length on: below it a block's MLP intermediates rarely decide what fits,
# and a second search would only cost time (bench/plan_latency.py plans shorter sequences)
TILE_FROM_SEQ = 16384


def mlp_tiles_worth_trying(profile: ModelProfile, c: Constraints) -> int:
    """The MLP tiles a search weighs beside none (1: none): at long sequences, the smallest power of two that
    brings a block's MLP intermediates down to one hidden state (more tiles only add operators), dividing the
    sequence; every block alike, since a stage's working peak is its largest block's."""
    blk = max(profile.blocks, key=lambda b: b.mlp_share.get("fwd_inner", 0), default=None)
    if c.mlp_tiles is not None or profile.seq_len < TILE_FROM_SEQ or profile.compiled or blk is None:
        return 1
    if not blk.mlp_share or ModelFacts.of_profile(profile).untileable_mlp or c.activations in SELECTIVE_NAMES:
        return 1
    tiles = 1
    while blk.mlp_share["fwd_inner"] / tiles > blk.input_bytes and profile.seq_len % (2 * tiles) == 0:
        tiles *= 2
    return tiles


def _search(profile: ModelProfile, cluster: Cluster, global_batch: int, c: Constraints, memory_budget: int | None,
            reduce_dtype: str, alternatives: int, compare_bpipe: bool,
            optimizer: OptimizerPlan | None) -> SearchResult:
    budget = budget_for(cluster, memory_budget)
    # the optimizer setup and the model are fixed as the fixed parts are (Constraints.checked): the same rules
    in_backward = optimizer is not None and optimizer.in_backward
    if broken := rules.problem(c.parts(in_backward=in_backward, compute_dtype=profile.dtype, compile=profile.compiled,
                                       seq_len=profile.seq_len, model=ModelFacts.of_profile(profile))):
        raise NoPlanError(broken, SearchResult(None, budget_bytes=budget, candidates=0))
    model = CostModel(profile, cluster, global_batch, c, budget, reduce_dtype, optimizer)
    log = SearchLog()
    cands = model.candidates()
    res = SearchResult(None, budget_bytes=budget, candidates=len(cands))
    if not cands:
        if in_backward and c.grad_reduce == "step":
            raise NoPlanError(f"the step in backward needs one microbatch per step or gradients reduced every "
                              f"microbatch, and global batch {global_batch} takes several under --grad-reduce step; "
                              "set --grad-reduce microbatch", res)
        fixed = ", ".join(f"{k}={v}" for k, v in c.fixed().items())
        larger = next_splittable_batch(profile, cluster, global_batch, c, in_backward)
        fix = f"a global batch of {larger} (--batch-size {larger}) can be" if larger else "drop fixed parts"
        raise NoPlanError(f"global batch {global_batch} cannot be split into micro-batch x microbatches x dp on "
                          f"{cluster.world_size} {ranks_word(cluster)}" + (f" with {fixed}" if fixed else "")
                          + f" (a pipeline needs at least pp microbatches); {fix}, or use fewer {ranks_word(cluster)}",
                          res)
    for x in cands:
        x.lower = model.lower_bound(x)
    found = best_first(model, log, cands, 1 + max(alternatives, EXPLORED))
    found += rescue(model, log, cands, found)
    plain = [x for x in cands if not SCHEDULES[x.schedule].evicts]
    if compare_bpipe or (found and SCHEDULES[found[0].schedule].evicts):  # BPipe only where it beats the rest
        found += best_first(model, log, plain, 1)
    if compare_bpipe:  # and the best V schedule, which balances memory by placement instead of moves
        found += best_first(model, log, [x for x in cands if SCHEDULES[x.schedule].evicts], 1)
        found += best_first(model, log, [x for x in cands if SCHEDULES[x.schedule].v_shaped], 1)
        found += best_first(model, log, [x for x in cands if x.schedule == "1f1b"], 1)
    found = sorted({id(x): x for x in found}.values(), key=lambda x: _preference(x.plan))
    plans = [x.plan for x in found]
    if plans and (home := simpler(model, log, plans[0])) is not None:  # nothing offloaded that need not be
        plans[0] = home
    for p in plans:
        p.model = profile.summary()
    res.best, res.alternatives = (plans[0] if plans else None), plans[1:1 + alternatives]
    res.bpipe = next((p for p in plans if p.schedule_entry.evicts), None)
    res.best_without_bpipe = next((p for p in plans if not p.schedule_entry.evicts), None)
    res.best_v = next((p for p in plans if p.schedule_entry.v_shaped), None)
    res.best_1f1b = next((p for p in plans if p.schedule == "1f1b"), None)
    res.solved, res.verified, res.verify_s = sum(x.solved for x in cands), log.verified, log.verify_s
    explain_losses(model, cands, found, res)
    if res.best is None:
        raise NoPlanError(f"no plan fits {budget / 2**30:.2f} GiB per GPU", res)
    return res
