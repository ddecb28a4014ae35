"""Verification of the search's candidates with the full estimate(): the knapsack's plans are checked in score
order, re-solved with slack when estimate() says they overshoot, and those near the fastest given back the room
the knapsack could not see. A plan estimate() says does not fit is never returned."""

from __future__ import annotations

import time
from dataclasses import replace

from snugfit.plan.candidates import Candidate, nearest_to_fitting
from snugfit.plan.cost_model import CostModel
from snugfit.plan.estimate import estimate
from snugfit.plan.knapsack import BUCKETS, INF
from snugfit.plan.memory import device_bytes
from snugfit.plan.placement import Placement
from snugfit.plan.plan import Plan, Prediction
from snugfit.plan.result import SearchLog
from snugfit.plan.shape import Shape
from snugfit.plan.solve import leanest_plan, solve

RETRIES = 2  # re-solves of a candidate whose estimate() overshoots the budget
SCORE_ERROR = 0.85  # knapsack scores down to this fraction of estimate()'s time are verified before giving up
MAX_EXTRA = 2  # such verifications beyond what was asked for (each is a full estimate())
POLISH_ROOM = (0, 1, 2)  # multiples of the room the knapsack could not see, tried by polish()
RESCUE_MARGIN = 0.5  # rescue(): families whose knapsack need is at most this share over the budget
RESCUES = 4  # rescue(): at most this many leanest plans estimated
# Plans this close in predicted step time are one to the time model (it is no finer): the one with fewer moving
# parts is preferred (`simpler`). Qwen2.5-7B LoRA on one A100-80GB chose its adapters' optimizer offload with 54 GiB
# of headroom: tiny states stepped on the host, for a step the model could not tell from the one on the device.
SIMPLER_MARGIN = 0.01


def verify(model: CostModel, log: SearchLog, cand: Candidate, slack: float = 0.0, fine: bool = False) -> bool:
    """estimate() the candidate's plan (solved with `slack`, `fine`); on a device overshoot re-solve with it as
    more slack."""
    tried = None
    for _ in range(RETRIES + 1):
        if cand.plan is None:
            break
        if _layout(cand.plan) != tried:  # the slack changed the plan: estimate it, else ask for more room
            pred = _logged_estimate(model, log, cand.plan)
            if pred.fits:
                cand.fits = True
                return True
            over = max(device_bytes(m) for m in pred.memory_by_rank) - model.budget
            if over <= 0:  # host memory, which slack on the device cannot fix
                break
            tried = _layout(cand.plan)
        slack += over * 1.25 + model.budget / BUCKETS
        settle(model, cand, slack, fine)
    cand.fits, cand.plan = False, None
    return False


def polish(model: CostModel, log: SearchLog, cand: Candidate, fastest: float, unseen: float = 0.0) -> None:
    """Re-solve a verified candidate finer and with the room the knapsack could not see, and keep the fastest plan
    estimate() says fits. The knapsack rounds every block's memory up to a bucket (a stage of 80 blocks can lose
    most of its budget so) and puts the largest piece's working peak on every stage, so a plan that fits can leave
    room a faster assignment would use. The re-solves run at knapsack.fine_resolution, with that room 0, 1 and 2
    times (while what comes back fits). One is estimated only when its knapsack score beats the plan it would
    replace and the fastest verified time (`fastest`): the score runs below estimate()'s time, so one that does
    not cannot win; one that overshoots is re-solved with more slack, as verify() does. `unseen`: device bytes the
    knapsack is known to over-count for this candidate (rescue()), given back on top."""
    cand.polished = True
    room = model.budget - max(device_bytes(m) for m in cand.plan.predicted.memory_by_rank)
    for factor in POLISH_ROOM:
        if factor and room <= model.budget / BUCKETS:
            return
        trial, slack = replace(cand, plan=None), -factor * room - unseen
        settle(model, trial, slack=slack, fine=True)
        if trial.plan is None or _layout(trial.plan) == _layout(cand.plan) or trial.score >= min(cand.score, fastest):
            continue
        if not verify(model, log, trial, slack, fine=True):
            return
        if trial.plan.predicted.step_time_s < cand.plan.predicted.step_time_s:
            cand.plan, cand.score = trial.plan, trial.score


def best_first(model: CostModel, log: SearchLog, cands: list[Candidate], want: int) -> list[Candidate]:
    """Up to `want` verified fitting candidates, fastest by estimate() first. Candidates are verified in
    knapsack-score order, and (at most MAX_EXTRA more) beyond `want` while their score is within SCORE_ERROR
    of the fastest verified time: the knapsack's additive step time (even stage split, bubble from the
    slowest rank, per-block overlap) approximates estimate()'s. Those that more room could make the fastest are then
    polished (`_could_beat`): the knapsack's first solution can leave a fifth of the step on the table (OPT-175B on
    1024 A100s, dp 512 x tp 2: 11.8 s first, 9.68 s with the room back, where the plan chosen without it took
    9.85)."""
    pending = sorted((x for x in cands if not x.solved), key=lambda x: x.lower)
    found = [x for x in cands if x.fits]
    extra = 0
    while True:
        open_ = [x for x in cands if x.solved and x.plan is not None and x.fits is None]
        top = min(open_, key=lambda x: x.score, default=None)
        while pending and (top is None or pending[0].lower < top.score):
            nxt = pending.pop(0)
            settle(model, nxt)
            if nxt.plan is not None and (top is None or nxt.score < top.score):
                top = nxt
        if top is None:
            break
        if len({_shape(x) for x in found}) >= want:
            if extra == MAX_EXTRA or top.score >= min(x.plan.predicted.step_time_s for x in found) / SCORE_ERROR:
                break
            extra += 1
        if verify(model, log, top):
            found.append(top)
    fastest = min((x.plan.predicted.step_time_s for x in found), default=INF)
    for x in sorted(found, key=lambda x: x.plan.predicted.step_time_s):  # fastest first, then those more room
        if not x.polished and _could_beat(x, fastest):  # could still make the fastest
            polish(model, log, x, fastest)
            fastest = min(fastest, x.plan.predicted.step_time_s)
    return sorted(found, key=lambda x: x.plan.predicted.step_time_s)[:want]


def rescue(model: CostModel, log: SearchLog, cands: list[Candidate], found: list[Candidate]) -> list[Candidate]:
    """Candidates that fit in families whose every solved member the knapsack turned down. Near the memory boundary its
    over-counting decides: it rounds each block up to a bucket and puts the largest piece's working peak beside
    everything the stage holds, so Llama-3.1-8B QLoRA r32 on one RTX 4090 stopped at 67,072 tokens where
    estimate() fits the same plan up to 71,424 (the over-count is about a GiB there, and a third of a 2 GiB budget
    elsewhere). So estimate() the leanest plan of each such family's member nearest to fitting, nearest first,
    where the knapsack's own need is within RESCUE_MARGIN of the budget and its lower bound beats the fastest plan
    found (RESCUES at most: each is a full estimate()); each that fits is polished with what the knapsack
    over-counted for it given back. The estimated
    peaks are kept (`Candidate.estimated_need`): the report names estimate()'s figure for what does not fit."""
    # families the knapsack turned down: some member solved, none with a plan (the others were not reached)
    turned_down = {x.family for x in cands if x.solved} - {x.family for x in cands if x.plan is not None or x.fits}
    fastest = min((x.plan.predicted.step_time_s for x in found), default=INF)
    needs: dict[int, float] = {}

    def need(x: Candidate) -> float:
        if id(x) not in needs:
            needs[id(x)] = model.need(x)[0]
        return needs[id(x)]

    families = dict.fromkeys(x.family for x in cands if x.family in turned_down)
    nearest = [nearest_to_fitting([x for x in cands if x.family == fam], need) for fam in families]
    near = [x for x in nearest if x.lower < fastest and need(x) <= model.budget * (1 + RESCUE_MARGIN)]
    rescued = []
    for cand in sorted(near, key=need)[:RESCUES]:
        plan = leanest_plan(model, cand)
        if plan is None:
            continue
        pred = _logged_estimate(model, log, plan)
        cand.estimated_need = max(pred.peak_memory_bytes, pred.startup_bytes["device"])
        if not pred.fits:
            continue
        cand.plan, cand.score, cand.solved, cand.fits = plan, pred.step_time_s, True, True
        polish(model, log, cand, fastest, unseen=max(0.0, need(cand) - pred.peak_memory_bytes))
        rescued.append(cand)
    return rescued


def simpler(model: CostModel, log: SearchLog, plan: Plan) -> Plan | None:
    """The plan with every unit's state on the device (nothing offloaded), where that fits and its step is
    within SIMPLER_MARGIN of the plan's; None where the plan offloads nothing, or where offloading pays."""
    if not plan.offloads_state:
        return None
    units = [plan.root, *plan.blocks]
    home = [replace(u, placement=Placement.DEVICE) if u.placement.states_on_host else u for u in units]
    variant = replace(plan, root=home[0], blocks=home[1:], predicted=None)
    pred = _logged_estimate(model, log, variant)
    return variant if pred.fits and pred.step_time_s <= plan.predicted.step_time_s * (1 + SIMPLER_MARGIN) else None


def _shape(cand: Candidate) -> Shape:
    """What a candidate is apart from its schedule: the schedules of one shape share most of their plan (only
    the bubble and what each rank holds differ), so they fill one of the verified places `best_first` wants, and
    a new schedule does not crowd out the shapes it was verified against."""
    return replace(cand.shape, schedule="none", virtual_stages=1, evict_bound=None)


def _could_beat(cand: Candidate, fastest: float) -> bool:
    """Whether more room could make the candidate's plan the fastest, however far its first solution is: room
    moves its knapsack score at most down to its lower bound, and estimate()'s time at most as far."""
    return cand.plan.predicted.step_time_s - (cand.score - cand.lower) < fastest


def _logged_estimate(model: CostModel, log: SearchLog, plan: Plan) -> Prediction:
    """estimate() the plan, counted and timed in the search's log."""
    t0 = time.perf_counter()
    pred = estimate(plan, model.profile, model.cluster, model.budget)
    log.verified, log.verify_s = log.verified + 1, log.verify_s + time.perf_counter() - t0
    return pred


def settle(model: CostModel, cand: Candidate, slack: float = 0.0, fine: bool = False) -> None:
    """Solve the candidate (solve.solve) into its plan and knapsack score (None and inf when nothing fits)."""
    solution = solve(model, cand, slack, fine)
    cand.solved = True
    cand.plan, cand.score = (solution.plan, solution.score) if solution else (None, INF)


def _layout(plan: Plan) -> tuple:
    """What the knapsack decides: stage sizes and every block's and the root's option."""
    return plan.stage_blocks, plan.blocks, plan.root
