"""Whether the blocks compile (Plan.compile): a choice the search weighs where the user leaves it open.

Compiling changes the math only in float order, so it is searched like any other part: the model is profiled
eager and as torch.compile runs its blocks (profile.compiled: what the partitioner saves, the fused kernels'
traffic and launches), both are searched, and the compiled plan is taken when its faster steps repay the
compilation within the run's steps. CPU ranks run eager unless asked (--compile): there inductor builds C++
kernels with the machine's compiler, which a CPU box may lack, and CPU runs are short trials.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from snugfit.hardware.cluster import Cluster
from snugfit.plan.plan import Plan
from snugfit.plan.result import NoPlanError, SearchResult
from snugfit.plan.search import search
from snugfit.profile.types import ModelProfile


@dataclass
class CompileChoice:
    """The search's result for the chosen side (its best plan's `compile` says which), that side's profile, and
    the report's line on the choice (None where compile was not in question)."""

    result: SearchResult
    profile: ModelProfile
    note: str | None = None


def weighs_compiled(compile: bool | None, cluster: Cluster) -> bool:
    """Whether the compiled side is profiled and searched: unless refused, or on CPU ranks where not asked."""
    return not (compile is False or (compile is None and cluster.gpu_of(0).name == "cpu"))


def search_compiled_or_eager(profile_for: Callable[[bool], ModelProfile], cluster: Cluster, *,
                             compile: bool | None, steps: int, **search_args) -> CompileChoice:
    """search() on the eager profile, the compiled one, or both, as `compile` (None: weigh it) and the cluster say.

    profile_for(compiled): the model's profile, eager or compiled (compiled=True gives an eager profile, with the
    reason logged, where the blocks cannot be traced). steps: the run's, over which compiling must pay.
    Raises NoPlanError where nothing fits: the compiled side's where --compile asked for it, else the eager side's.
    """
    eager_profile = profile_for(False)
    if not weighs_compiled(compile, cluster):
        return CompileChoice(search(eager_profile, cluster, **search_args), eager_profile)
    # the other side: weighed against (compile None), the note's comparison (--compile), or the plan where the
    # blocks cannot be traced
    eager = _searched(eager_profile, cluster, search_args)
    compiled_profile = profile_for(True)
    if not compiled_profile.compiled:
        why = "compile: the blocks cannot be traced as torch.compile runs them (the log says why); they run eager"
        if isinstance(eager, NoPlanError):
            raise eager
        return CompileChoice(eager, eager_profile, why)
    compiled = _searched(compiled_profile, cluster, search_args)
    if isinstance(compiled, NoPlanError):
        if compile or isinstance(eager, NoPlanError):
            raise compiled if compile else eager
        return CompileChoice(eager, eager_profile, "compile: only eager blocks fit (no compiled plan does)")
    if isinstance(eager, NoPlanError):
        return CompileChoice(compiled, compiled_profile, "compile: only compiled blocks fit (no eager plan does)")
    take, note = _weigh(compiled.best, eager.best, steps, asked=bool(compile))
    return CompileChoice(compiled, compiled_profile, note) if take else CompileChoice(eager, eager_profile, note)


def _searched(profile: ModelProfile, cluster: Cluster, search_args: dict) -> SearchResult | NoPlanError:
    try:
        return search(profile, cluster, **search_args)
    except NoPlanError as e:
        return e


def _weigh(compiled: Plan, eager: Plan, steps: int, asked: bool) -> tuple[bool, str]:
    """Take the compiled plan (always where asked) when the run's steps repay its predicted compilation
    (Prediction.compile_s): the line says."""
    fast, slow = compiled.predicted.tokens_per_s, eager.predicted.tokens_per_s
    saved = eager.predicted.step_time_s - compiled.predicted.step_time_s
    cost = compiled.predicted.compile_s
    figures = f"{fast:,.0f} tokens/s compiled against {slow:,.0f} for the best eager plan ({fast / slow - 1:+.0%})"
    repaid = math.ceil(cost / saved) if saved > 0 else math.inf
    if asked:
        return True, (f"compile: {figures}; the first step compiles the blocks (~{cost:.0f} s predicted"
                      + (f", repaid in {repaid:.0f} steps)" if saved > 0 else ", never repaid)"))
    if repaid < steps:
        return True, (f"compile: chosen, {figures}; compiling the blocks (~{cost:.0f} s predicted, in the first "
                      f"step) is repaid in {repaid:.0f} of the run's {steps} steps (--compile false runs eager)")
    why = (f"repaid only after {repaid:.0f} steps, and the run has {steps}" if saved > 0
           else "compiled blocks are no faster here")
    return False, f"compile: not chosen, {figures}: {why} (--compile compiles anyway)"
