"""What would make a plan fit, or pay, each change checked by a search and given with the speed it plans at:
the smallest changes when nothing fits (`advise`), and the optimizer switch worth naming when the chosen plan
offloads (`switches`). Pure: no torch; changes that need the model profiled again (another sequence length,
LoRA or QLoRA) come through the caller's `Reprofile`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from snugfit.hardware.cluster import Cluster, with_host_ram
from snugfit.plan.candidates import Candidate, outer_candidates
from snugfit.plan.cost_model import CostModel
from snugfit.plan.estimate import HOST_USABLE, node_host_need
from snugfit.plan.explain import GIB, _figures, summary
from snugfit.plan.optimizer import describe as describe_optimizer
from snugfit.plan.options import Constraints
from snugfit.plan.plan import OptimizerPlan, Plan
from snugfit.plan.search import NoPlanError, SearchResult, budget_for, search
from snugfit.profile.types import ModelProfile


@dataclass(frozen=True)
class Variant:
    """A change to what is planned that needs the model profiled again."""

    seq_len: int | None = None  # None: the planned sequence length
    lora_rank: int = 0  # > 0: LoRA adapters of this rank on the default targets, the base frozen
    nf4: bool = False  # the frozen base stored in NF4 (QLoRA)


Reprofile = Callable[[Variant], ModelProfile]
LORA_RANK = 16  # the adapters' rank the advice plans with (PEFT's and most recipes' default range)
SEQ_STEP = 256  # the sequence limit is searched to this many tokens


def _fits(profile: ModelProfile, cluster: Cluster, global_batch: int, c: Constraints,
          budget: int | None, optimizer: OptimizerPlan | None = None) -> Plan | None:
    try:
        return search(profile, cluster, global_batch=global_batch, constraints=c, memory_budget=budget,
                      alternatives=0, optimizer=optimizer).best
    except NoPlanError:
        return None


# The optimizer setups a user may switch to, from the mildest change of the numerics to the strongest: 8-bit states
# (the default of popular fine-tuning tools), bf16 weights, both, then the step in backward (per-unit clipping), then
# 4-bit states. The search never picks them (plan.OptimizerPlan); the advice names the first that pays.
SWITCHES = (OptimizerPlan(states="8bit"), OptimizerPlan(master_weights="bf16"),
            OptimizerPlan(master_weights="bf16", states="8bit"),
            OptimizerPlan(master_weights="bf16", states="8bit", in_backward=True),
            OptimizerPlan(master_weights="bf16", states="4bit", in_backward=True))
PAYS = 1.2  # a switch worth naming is at least this much faster


def _switch_flags(opt: OptimizerPlan) -> str:
    flags = [f"--optimizer-states {opt.states}"] * (opt.states != "fp32")
    flags += [f"--master-weights {opt.master_weights}"] * (opt.master_weights != "fp32")
    return " ".join(flags + ["--optimizer-in-backward"] * opt.in_backward)


def _stronger(opt: OptimizerPlan, than: OptimizerPlan) -> bool:
    """Whether `opt` goes at least as far as `than` in every respect, and further in one."""
    bits = {"fp32": 32, "bf16": 16, "8bit": 8, "4bit": 4}
    return opt != than and bits[opt.states] <= bits[than.states] and (
        bits[opt.master_weights] <= bits[than.master_weights]) and opt.in_backward >= than.in_backward


def _offloads(plan: Plan) -> bool:
    return any(b.placement.states_on_host for b in [plan.root, *plan.blocks])


def _switch_effect(before: Plan, after: Plan) -> str:
    held = lambda p: sum(not b.placement.params_on_host for b in p.blocks)  # noqa: E731 - blocks whose weights stay
    if held(after) > held(before):
        where = ("every block's parameters stay on the card" if held(after) == len(after.blocks)
                 else f"{held(after)} of {len(after.blocks)} blocks' parameters stay on the card")
    elif not _offloads(after):
        where = "nothing offloaded"
    else:
        where = summary(after)
    ratio = before.predicted.step_time_s / after.predicted.step_time_s
    return f"{where}, {ratio:.1f}x faster ({_figures(after)})"


def _could_pay(profile: ModelProfile, cluster: Cluster, global_batch: int, c: Constraints, budget: int | None,
               opt: OptimizerPlan, step_s: float, floors: CostModel, candidates: list[Candidate]) -> bool:
    """Whether some plan under `opt` could be PAYS times faster than `step_s`, by the search's lower bounds (every
    block at its fastest option, memory aside): a quarter of a search, where a compute-bound step's switches need
    none (Llama-2-70B on 8x8 A100s: their five searches were two thirds of its `snugfit plan`). The plans the
    search finds ran 1.7% and more above them (six catalogue rows, five switches each), so no switch that pays is
    left out. `floors` (any setup's model) gives CostModel.floor, a bound below every setup's lower bound, shared
    by the five: a candidate it rules out is not priced under `opt` (the 70B's: all ~300). `candidates`: the outer
    candidates under `opt` (they depend on it only through its step in backward)."""
    kept = [x for x in candidates if PAYS * floors.floor(x) <= step_s * (1 + 1e-9)]
    if not kept:
        return False
    model = CostModel(profile, cluster, global_batch, c, budget_for(cluster, budget), optimizer=opt)
    return any(PAYS * model.lower_bound(x) <= step_s for x in kept)


def switches(profile: ModelProfile, cluster: Cluster, *, global_batch: int, constraints: Constraints | None,
             memory_budget: int | None, result: SearchResult) -> list[str]:
    """Where the fastest plan offloads, the mildest optimizer switch (SWITCHES) that makes it at least PAYS times
    faster, checked by a search: the advice's line, or none."""
    best = result.best
    if best is None or not _offloads(best) or cluster.gpu_of(0).name == "cpu":
        return []
    c = constraints or Constraints()
    floors = CostModel(profile, cluster, global_batch, c, budget_for(cluster, memory_budget))
    candidates = {in_backward: outer_candidates(profile, cluster, global_batch, c, in_backward)
                  for in_backward in {opt.in_backward for opt in SWITCHES}}
    for opt in SWITCHES:
        if not _stronger(opt, best.optimizer) or not _could_pay(profile, cluster, global_batch, c, memory_budget,
                                                                   opt, best.predicted.step_time_s, floors,
                                                                   candidates[opt.in_backward]):
            continue
        plan = _fits(profile, cluster, global_batch, c, memory_budget, opt)
        if plan is not None and best.predicted.step_time_s >= PAYS * plan.predicted.step_time_s:
            return [f"advice: with {_switch_flags(opt)}: {_switch_effect(best, plan)}; it changes the numerics "
                    f"({describe_optimizer(opt)}), so only you can choose it"]
    return []


def _bigger(cluster: Cluster, factor: int) -> Cluster:
    nodes = [replace(n, count=n.count * factor) for n in cluster.nodes]
    spec = "+".join(f"{n.count}x{n.gpu.name}" for n in nodes)
    return replace(cluster, nodes=nodes, spec=spec)


def _longest_sequence(reprofile: Reprofile, fits: Callable[[ModelProfile], Plan | None],
                      seq: int) -> tuple[int, Plan] | None:
    """The longest sequence below `seq`, to SEQ_STEP tokens, at which a plan fits: searched by bisection (the
    memory need grows with the sequence), not extrapolated from one need."""
    found = None
    lo, hi = 0, (seq - 1) // SEQ_STEP  # in steps; hi * SEQ_STEP < seq
    while lo < hi:  # each probe profiles the model again (seconds for a catalogue model)
        mid = (lo + hi + 1) // 2
        plan = fits(reprofile(Variant(seq_len=mid * SEQ_STEP)))
        if plan:
            lo, found = mid, plan
        else:
            hi = mid - 1
    return (lo * SEQ_STEP, found) if found else None


def advise(profile: ModelProfile, cluster: Cluster, *, global_batch: int, constraints: Constraints | None,
           memory_budget: int | None, optimizer: OptimizerPlan | None = None,
           reprofile: Reprofile | None = None) -> list[str]:
    """The changes that make a plan fit, each checked by a search, as '<the options to add>: fits as <plan>
    (<its speed>)', most useful first: what keeps the run as asked (the layout, then more host RAM, then an
    optimizer switch), then more GPUs, then what trains less of the model (LoRA, QLoRA), then shorter sequences.
    `reprofile` profiles the model under a Variant (None: the changes that need it are not weighed)."""
    c = constraints or Constraints()
    opt = optimizer or OptimizerPlan()
    out: list[str] = []

    def fits(prof: ModelProfile, cl: Cluster = cluster, cons: Constraints = c,
             with_opt: OptimizerPlan = opt) -> Plan | None:
        return _fits(prof, cl, global_batch, cons, memory_budget, with_opt)

    def say(change: str, plan: Plan, more: str = "") -> None:
        out.append(f"{change}: fits as {summary(plan)} ({_figures(plan)}{more})")

    for key, value in c.fixed().items():
        if plan := fits(profile, cons=replace(c, **{key: None})):
            say(f"drop --{key.replace('_', '-')} {value}", plan)
    if c.micro_batch != 1 and global_batch > 1 and not any(a.startswith("drop --micro-batch") for a in out):
        if plan := fits(profile, cons=replace(c, micro_batch=1, num_microbatches=None)):
            say("--micro-batch 1", plan)
    if cluster.gpu_of(0).name != "cpu":  # CPU ranks: host and device are one memory, the budget covers it
        out += _more_host_ram(profile, cluster, fits)
    for switch in (s for s in SWITCHES if _stronger(s, opt)):  # the mildest optimizer switch that fits
        if plan := fits(profile, with_opt=switch):
            say(f"{_switch_flags(switch)} (changes the numerics: {describe_optimizer(switch)})", plan)
            break

    def on_more_gpus(prof: ModelProfile, change: str = "", what: str = "") -> bool:
        for factor in (2, 4, 8):
            bigger = _bigger(cluster, factor)
            if plan := fits(prof, cl=bigger, cons=replace(c, dp=None, pp=None)):
                say(f"{change}--cluster {bigger.spec} ({what}{factor}x the GPUs)", plan)
                return True
        return False

    on_more_gpus(profile)
    if reprofile is not None:
        full = all(p.num_trainable == p.num_params for p in profile.pieces)
        nf4 = any(p.quantized for p in profile.pieces)
        if full and (plan := fits(reprofile(Variant(lora_rank=LORA_RANK)))):
            say(f"--lora-rank {LORA_RANK} (LoRA: the base frozen, adapters trained)", plan)
        if not nf4:
            qlora = reprofile(Variant(lora_rank=LORA_RANK, nf4=True))
            flags = f"--lora-rank {LORA_RANK} --quantize-base nf4"
            if plan := fits(qlora):
                say(f"{flags} (QLoRA: the frozen base in 4 bits)", plan)
            else:  # the least a model can hold, on more cards of the kind
                on_more_gpus(qlora, f"{flags} ", "QLoRA, ")
        if (longest := _longest_sequence(reprofile, fits, profile.seq_len)) is not None:
            say(f"--seq {longest[0]} (the longest sequence that fits, to {SEQ_STEP} tokens)", longest[1])
    return out or ["GPU memory is the binding limit: nothing short of a larger GPU fits, even every block sharded, "
                   "offloaded and recomputed"]


def _more_host_ram(profile: ModelProfile, cluster: Cluster, fits: Callable[..., Plan | None]) -> list[str]:
    """Where offloading to more host RAM would fit: the least RAM the search finds a plan in, from what the plan
    needs (the search's host cap is coarser than the estimate's, so a little more may be needed) up to what it
    was found with."""
    has = max(n.host.ram_bytes for n in cluster.nodes)
    for factor in (2, 4, 8):
        plan = fits(profile, cl=with_host_ram(cluster, has * factor))
        if not plan:
            continue
        need = max(max(node_host_need(plan, profile, cluster, plan.predicted.memory_by_rank, i))
                   for i in range(len(cluster.nodes)))
        least = math.ceil(need / HOST_USABLE / GIB)
        for ram in sorted({least, math.ceil(least * 1.25), math.ceil(least * 1.5), round(has * factor / GIB)}):
            found = ram * GIB <= has * factor and fits(profile, cl=with_host_ram(cluster, ram * GIB))
            if found:
                plan = found
                break
        need = max(max(node_host_need(plan, profile, cluster, plan.predicted.memory_by_rank, i))
                   for i in range(len(cluster.nodes)))
        return [f"--host-ram {ram}GiB (host RAM is the binding limit, {has / GIB:.0f} GiB per node): fits as "
                f"{summary(plan)} ({_figures(plan)}; {need / GIB:.1f} GiB of host memory per node, "
                f"{HOST_USABLE:.0%} of RAM usable)"]
    return []
