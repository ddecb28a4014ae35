"""What a search returns: the plan, the verified runners-up, and why the families it did not choose lost
(slower, or the least memory they need against the budget).

The report's half of the search (search.py finds the plan): what `snugfit plan` prints under "other
families", and what advice.advise() reads when nothing fits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from snugfit.plan.candidates import Candidate, nearest_to_fitting
from snugfit.plan.cost_model import CostModel
from snugfit.plan.knapsack import INF
from snugfit.plan.options import describe
from snugfit.plan.plan import BlockPlan, Plan, PlanError


@dataclass
class SearchLog:
    """What a search did, counted as it goes: full estimate() calls and the seconds they took."""

    verified: int = 0
    verify_s: float = 0.0


@dataclass
class Rejection:
    family: str
    reason: str
    need_bytes: int = 0  # least device bytes per GPU the family needs (0: it fits, but is slower)


@dataclass
class SearchResult:
    best: Plan | None
    alternatives: list[Plan] = field(default_factory=list)  # verified and fitting, fastest first
    rejected: list[Rejection] = field(default_factory=list)
    budget_bytes: int = 0
    candidates: int = 0  # outer candidates
    solved: int = 0  # of which knapsacks were solved
    verified: int = 0  # full estimate() calls
    verify_s: float = 0.0  # seconds spent in them
    least_need: tuple[int, int] = (0, 0)  # (device bytes, of which static) of the least-memory candidate
    bpipe: Plan | None = None  # the best fitting BPipe plan (chosen or not), for --explain-bpipe
    best_without_bpipe: Plan | None = None
    best_1f1b: Plan | None = None  # the best fitting 1F1B plan: the schedule BPipe changes, what --explain-bpipe weighs
    best_v: Plan | None = None  # the best fitting plan of a V schedule (zbv), which --explain-bpipe names too
    note: str = ""  # what the search did other than the user asked (search.search), printed under the choice


class NoPlanError(PlanError):
    """Nothing fits (or nothing matches the fixed parts); .result holds the rejections for the advice."""

    def __init__(self, message: str, result: SearchResult):
        super().__init__(message)
        self.result = result


def explain_losses(model: CostModel, cands: list[Candidate], found: list[Candidate], res: SearchResult) -> None:
    """Fill res.rejected (and res.least_need when nothing fits); `found`: the verified candidates, fastest first."""
    budget = res.budget_bytes
    needs: dict[int, tuple] = {}  # computed for families that fit nowhere only: they are what the report explains

    def need(x: Candidate) -> tuple[int, int, BlockPlan | None]:
        """The knapsack's least need, or estimate()'s where rescue() took it (the knapsack over-counts)."""
        if id(x) not in needs:
            needs[id(x)] = model.need(x)
            if x.estimated_need is not None and x.estimated_need < needs[id(x)][0]:
                needs[id(x)] = (x.estimated_need, *needs[id(x)][1:])
        return needs[id(x)]

    if not found:
        res.least_need = min(need(x)[:2] for x in cands)
    best_time = res.best.predicted.step_time_s if res.best else INF
    for fam in dict.fromkeys(x.family for x in cands if not (found and x.family == found[0].family)):
        members = [x for x in cands if x.family == fam]
        if any(x.fits for x in members):
            t = min(x.plan.predicted.step_time_s for x in members if x.fits)
            res.rejected.append(Rejection(fam, f"fits, but slower: {t:.3g} s/step vs {best_time:.3g}"))
            continue
        least = nearest_to_fitting(members, lambda x: need(x)[0])
        least_bytes, _, option = need(least)
        if least_bytes > budget:
            needs_gib, has_gib = gib_apart(least_bytes, budget)
            reason = (f"needs {needs_gib} GiB per GPU even with micro-batch {least.micro_batch_size} and every block "
                      f"{describe(option, dp=least.dp)}, has {has_gib}")
        else:
            t = min(x.score if x.solved else x.lower for x in members)
            reason = (f"slower: at best {t:.3g} s/step (knapsack) vs {best_time:.3g}" if best_time <= t < INF else
                      "no assignment the knapsack found passed the full estimate()")
        res.rejected.append(Rejection(fam, reason, least_bytes))
    if res.best is not None and any(b.placement.steps_on_host or b.offloads_activations
                                    for b in res.best.blocks):
        plain_need = model.need(found[0], offload=False)[0]
        if plain_need > budget:
            res.rejected.insert(0, Rejection(f"{found[0].family} without offload",
                                             "needs {} GiB per GPU, has {}".format(*gib_apart(plain_need, budget)),
                                             plain_need))


def gib_apart(need: float, has: float) -> tuple[str, str]:
    """Two byte counts in GiB, at the fewest decimals (1 to 3) that show need above has: "needs 24.0, has 24.0"
    read as a contradiction."""
    for decimals in (1, 2, 3):
        a, b = f"{need / 2**30:.{decimals}f}", f"{has / 2**30:.{decimals}f}"
        if float(a) > float(b):
            break
    return a, b
