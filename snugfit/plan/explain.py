"""Say what the search chose and why: the plan, its runners-up, why other families lost, what BPipe
would buy, and, when nothing fits, the smallest change that would. Pure: no torch."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

from snugfit.hardware.cluster import Cluster, with_host_ram
from snugfit.plan.estimate import HOST_USABLE, node_host_need
from snugfit.plan.memory import FRAGMENTATION, device_bytes
from snugfit.plan.optimizer import describe as describe_optimizer
from snugfit.plan.plan import OptimizerPlan, Plan, Prediction
from snugfit.plan.options import Constraints, describe
from snugfit.plan.cost_model import CostModel
from snugfit.plan.search import SPLIT_MARGIN, NoPlanError, SearchResult, budget_for, search
from snugfit.profile.types import ModelProfile

GIB = 2**30
LORA_TRAINABLE = 0.01  # adapters of rank ~16 train about 1% of a block's parameters


def summary(plan: Plan) -> str:
    """One line: degrees, batch split, schedule, and the per-block decisions by count."""
    counts = Counter(describe(b, dp=plan.shard_ranks) for b in plan.blocks)
    blocks = ", ".join(f"{n} x {d}" for d, n in counts.most_common())
    stages = f" stages {plan.stage_blocks}" if plan.pp > 1 else ""
    tp = f" x tp {plan.tp}" if plan.tp > 1 else ""
    cp = f" x cp {plan.cp}" if plan.cp > 1 else ""  # each rank of a cp group holds 1/cp of every sequence
    every = " (gradients reduced every microbatch)" if plan.grad_reduce == "microbatch" else ""
    optimizer = "" if plan.optimizer == OptimizerPlan() else f"; {describe_optimizer(plan.optimizer, clip=False)}"
    return (f"dp {plan.dp}{tp} x pp {plan.pp}{cp} ({plan.schedule}{stages}), micro-batch {plan.micro_batch_size} x "
            f"{plan.num_microbatches}{every}; blocks{' compiled' if plan.compile else ''}: {blocks}; "
            f"root: {describe(plan.root, root=True, dp=plan.shard_ranks)}"
            f"{optimizer}")


def _figures(plan: Plan) -> str:
    p = plan.predicted
    return f"{p.tokens_per_s:,.0f} tokens/s, step {p.step_time_s:.3g} s, peak {p.peak_memory_bytes / GIB:.2f} GiB"


def describe_model(m: dict) -> str:
    """'model llama-2-7b: 6,738,415,616 parameters (4,194,304 trainable), 32 blocks, hidden 4096, vocabulary 32000'."""
    parts = [f"{m['trainable']:,} trainable"] + ([f"{m['quantized_nf4']:,} in NF4"] if m.get("quantized_nf4") else [])
    return (f"model {m['name']}: {m['parameters']:,} parameters ({', '.join(parts)}), {m['blocks']} blocks, "
            f"hidden {m['hidden']}, vocabulary {m['vocabulary']}")


def rank_runs(values: list) -> list[tuple[str, object]]:
    """Consecutive ranks with equal values as ("first-last", value): a 1024-GPU plan has a few kinds of rank."""
    out: list[tuple[str, object]] = []
    start = 0
    for r in range(1, len(values) + 1):
        if r == len(values) or values[r] != values[start]:
            out.append((str(start) if r - 1 == start else f"{start}-{r - 1}", values[start]))
            start = r
    return out


def format_result(res: SearchResult, cluster: Cluster) -> str:
    """What was planned, the chosen plan, its peak memory by category, start-up and host memory, time by phase,
    alternatives and rejected families, and the safety margin."""
    best = res.best
    pred = best.predicted
    lines = [describe_model(best.model)] if best.model else []
    lines += [f"chosen: {summary(best)}", f"  predicted {_figures(best)} (MFU {pred.mfu:.1%})",
              f"  optimizer: {describe_optimizer(best.optimizer)}"]
    faster = [p for p in res.alternatives if p.predicted.step_time_s < pred.step_time_s]
    if faster:  # the search's preference (search._preference) breaks ties at the time model's resolution
        lines.append("  " + why_not_the_fastest(best, min(faster, key=lambda p: p.predicted.step_time_s)))
    lines += ["  " + line for line in memory_lines(pred)]
    lines.append("  " + phases_line(pred))
    if res.alternatives:
        lines.append("alternatives:")
        lines += [f"  {_figures(p)}: {summary(p)}" for p in res.alternatives]
    if res.rejected:
        lines.append("other families:")
        lines += [f"  {r.family}: {r.reason}" for r in res.rejected]
    gpu = cluster.gpu_of(0)
    reserve = ("no reserve on CPU ranks" if gpu.name == "cpu" else
               f"every GPU keeps a reserve of {gpu.context_bytes / GIB:.2f} GiB (CUDA context) + "
               f"{FRAGMENTATION:.0%} of its use (allocator fragmentation, transient peaks)")
    lines.append(f"budget {res.budget_bytes / GIB:.2f} GiB per {'rank' if gpu.name == 'cpu' else 'GPU'}; {reserve}; "
                 f"headroom {(res.budget_bytes - pred.peak_memory_bytes) / GIB:.2f} GiB")
    lines.append(f"searched {res.candidates} candidates, solved {res.solved}, verified {res.verified} with the "
                 f"full estimate")
    return "\n".join(lines)


def why_not_the_fastest(best: Plan, top: Plan) -> str:
    """Why the chosen plan is listed above `top`, a runner-up the time model calls faster (search._preference)."""
    tokens = f"{top.predicted.tokens_per_s:,.0f} tokens/s below"
    mine, its = best.schedule_entry, top.schedule_entry
    if its.splits_backward and not mine.splits_backward:
        return (f"within {SPLIT_MARGIN:.0%} of the fastest ({tokens}), whose split backward the time model may "
                "under-count; chosen without it")
    return f"within rounding of the fastest ({tokens}); chosen for " + (
        "no BPipe" if its.evicts and not mine.evicts else "less memory")


def memory_lines(pred: Prediction) -> list[str]:
    """The peak memory per rank by category (GiB; ranks alike on one row; host categories apart from the device
    total), the start-up peak, and the host memory per node against its RAM: what every report shows."""
    cats = sorted({c for m in pred.memory_by_rank for c in m}, key=lambda c: (c.startswith("host:"), c))
    lines = ["peak memory per rank (GiB):", "  rank  " + "  ".join(f"{c:>16}" for c in cats) + f"  {'device total':>13}"]
    for ranks, m in rank_runs(pred.memory_by_rank):
        lines.append(f"  {ranks:>4}  " + "  ".join(f"{m.get(c, 0) / GIB:>16.3f}" for c in cats)
                     + f"  {device_bytes(m) / GIB:>13.3f}")
    start = pred.startup_bytes
    if start:
        lines.append(f"start-up peak: device {start['device'] / GIB:.2f} GiB per rank: its shards and one whole "
                     "tensor (weights are filled one tensor at a time)")
    host = pred.host_memory
    if host:
        ram = f"{HOST_USABLE:.0%} of {host['ram'] / GIB:.0f} GiB RAM" + (", assumed: --host-ram to change"
                                                                        if host["assumed"] else "")
        lines.append(f"host memory per node: {host['training'] / GIB:.1f} GiB while training, "
                     f"{host['startup'] / GIB:.1f} GiB at start-up; usable {HOST_USABLE * host['ram'] / GIB:.1f} GiB "
                     f"({ram})")
    return lines


def phases_line(pred: Prediction) -> str:
    """'step time by phase (s): compute 5.703, bubble 1.486, ...' at the step's 4 significant digits: a phase
    below half the last digit of the step is not shown (float noise, as a bubble of 4e-16 s without a pipeline)."""
    step = pred.step_time_s
    least = 0.5 * 10 ** (math.floor(math.log10(step)) - 3) if step > 0 else 0.0
    return "step time by phase (s): " + ", ".join(f"{k} {v:.4g}" for k, v in pred.time_by_phase.items()
                                                  if v >= least and v > 0)


def verdict_line(pred: Prediction) -> str:
    """'fits: ...' or 'does NOT fit: ...' naming the binding limit first: GPU memory, or a node's host memory."""
    budget = pred.memory_budget_bytes or 0
    margin = budget - pred.peak_memory_bytes
    gpu = (f"peak {pred.peak_memory_bytes / GIB:.2f} GiB of {budget / GIB:.2f} GiB per GPU "
           f"({'headroom' if margin >= 0 else 'over by'} {abs(margin) / GIB:.2f} GiB)")
    if pred.fits:
        return f"fits: {gpu}"
    limits = []
    start_device = pred.startup_bytes.get("device", 0)
    if margin < 0:
        limits.append(f"GPU memory is the limit: {gpu}")
    elif start_device > budget:
        limits.append(f"GPU memory at start-up is the limit: {start_device / GIB:.2f} GiB of {budget / GIB:.2f} GiB "
                      "(its shards and one whole tensor)")
    host = pred.host_memory
    if host and host["startup"] > HOST_USABLE * host["ram"]:
        limits.append(f"host memory is the limit: node {host['node']} needs {host['startup'] / GIB:.1f} GiB at "
                      f"start-up ({host['training'] / GIB:.1f} GiB while training), over {HOST_USABLE:.0%} of its "
                      f"{host['ram'] / GIB:.0f} GiB RAM (--host-ram to change)")
    if margin >= 0:
        limits.append(f"the GPUs fit: {gpu}")
    return "does NOT fit: " + "; ".join(limits)


def speed_words(ratio: float) -> str:
    """'21.6% faster' or '21.6% slower' for a ratio of the other plan's step time to this one's."""
    gain = ratio - 1
    return f"{gain:.1%} faster" if gain >= 0 else f"{-gain:.1%} slower"


def explain_bpipe(res: SearchResult) -> str:
    """What BPipe's memory buys against what its activation moves cost, from the two best verified plans, and the
    best V schedule's figure beside it."""
    bp, plain = res.bpipe, res.best_without_bpipe
    if bp is None:
        return "BPipe: no BPipe plan fits (it needs pp > 1 and at least pp microbatches)\n" + _v_schedule(res)
    if plain is None:
        return f"BPipe: {_figures(bp)}; no plan without BPipe fits, so BPipe is what makes it fit\n" + _v_schedule(res)
    lines = [f"BPipe:        {_figures(bp)}: {summary(bp)}",
             f"without it:   {_figures(plain)}: {summary(plain)}"]
    rec = lambda p: sum(bool(b.policy.recomputes) for b in p.blocks)  # noqa: E731
    lines.append(f"memory buys: micro-batch {bp.micro_batch_size} vs {plain.micro_batch_size}, "
                 f"{rec(bp)} vs {rec(plain)} blocks recomputing; recompute time "
                 f"{bp.predicted.time_by_phase.get('recompute', 0):.3g} s vs "
                 f"{plain.predicted.time_by_phase.get('recompute', 0):.3g} s")
    bp_time = bp.predicted.time_by_phase
    lines.append(f"moves cost: bubble {bp_time.get('bubble', 0):.3g} s vs "
                 f"{plain.predicted.time_by_phase.get('bubble', 0):.3g} s (evictions hide in the forward of the "
                 f"next microbatch, loads in the wait for the gradient; what they do not hide shows up as bubble)")
    verdict = "chosen" if res.best is bp else "not chosen"
    lines.append(f"verdict: BPipe is {speed_words(plain.predicted.step_time_s / bp.predicted.step_time_s)} -> {verdict}")
    return "\n".join(lines + [_v_schedule(res)])


def _v_schedule(res: SearchResult) -> str:
    """The best V schedule's figure beside BPipe's: it balances stages' memory by where they sit, not by moves."""
    v = res.best_v
    if v is None:
        return "V schedule:   none fits (it needs pp > 1, two stages per rank and a split backward's options)"
    bp = res.bpipe
    than = f", {speed_words(bp.predicted.step_time_s / v.predicted.step_time_s)} than BPipe" if bp else ""
    return f"V schedule:   {_figures(v)}{than}: {summary(v)}"


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
               opt: OptimizerPlan, step_s: float) -> bool:
    """Whether some plan under `opt` could be PAYS times faster than `step_s`, by the search's lower bounds (every
    block at its fastest option, memory aside): a quarter of a search, where a compute-bound step's switches need
    none (Llama-2-70B on 8x8 A100s: their five searches were two thirds of its `snugfit plan`). The plans the
    search finds ran 1.7% and more above them (six catalogue rows, five switches each), so no switch that pays is
    left out."""
    model = CostModel(profile, cluster, global_batch, c, budget_for(cluster, budget), optimizer=opt)
    return any(PAYS * model.lower_bound(x) <= step_s for x in model.candidates())


def switches(profile: ModelProfile, cluster: Cluster, *, global_batch: int, constraints: Constraints | None,
             memory_budget: int | None, result: SearchResult) -> list[str]:
    """Where the fastest plan offloads, the mildest optimizer switch (SWITCHES) that makes it at least PAYS times
    faster, checked by a search: the advice's line, or none."""
    best = result.best
    if best is None or not _offloads(best) or cluster.gpu_of(0).name == "cpu":
        return []
    c = constraints or Constraints()
    for opt in SWITCHES:
        if not _stronger(opt, best.optimizer) or not _could_pay(profile, cluster, global_batch, c, memory_budget,
                                                                   opt, best.predicted.step_time_s):
            continue
        plan = _fits(profile, cluster, global_batch, c, memory_budget, opt)
        if plan is not None and best.predicted.step_time_s >= PAYS * plan.predicted.step_time_s:
            return [f"advice: with {_switch_flags(opt)}: {_switch_effect(best, plan)}; it changes the numerics "
                    f"({describe_optimizer(opt)}), so only you can choose it"]
    return []


def _bigger(cluster: Cluster, factor: int) -> Cluster:
    nodes = [replace(n, count=n.count * factor) for n in cluster.nodes]
    return replace(cluster, nodes=nodes, spec=f"{factor}x the GPUs of {cluster.spec or 'the cluster'}")


def _lora(profile: ModelProfile) -> ModelProfile:
    blocks = [replace(b, trainable=int(LORA_TRAINABLE * b.num_params)) for b in profile.blocks]
    return replace(profile, blocks=blocks, embed=replace(profile.embed, trainable=0),
                   head=replace(profile.head, trainable=0))


def advise(profile: ModelProfile, cluster: Cluster, *, global_batch: int, constraints: Constraints | None,
           memory_budget: int | None, result: SearchResult, optimizer: OptimizerPlan | None = None) -> list[str]:
    """The smallest changes that make a plan fit, each checked by a search (so never a plan that won't)."""
    c = constraints or Constraints()
    opt = optimizer or OptimizerPlan()
    out: list[str] = []
    for switch in (s for s in SWITCHES if _stronger(s, opt)):  # the mildest optimizer switch that fits
        plan = _fits(profile, cluster, global_batch, c, memory_budget, switch)
        if plan:
            out.append(f"with {_switch_flags(switch)} (changes the numerics: {describe_optimizer(switch)}): fits "
                       f"as {summary(plan)} ({_figures(plan)})")
            break
    if cluster.gpu_of(0).name != "cpu":  # CPU ranks: host and device are one memory, the budget covers it
        has = max(n.host.ram_bytes for n in cluster.nodes)
        for factor in (2, 4, 8):
            plan = _fits(profile, with_host_ram(cluster, has * factor), global_batch, c, memory_budget, opt)
            if plan:
                # The least RAM the search finds a plan in, from what this one needs (the search's host cap is
                # coarser than the estimate's, so a little more may be needed) up to what it was found with.
                mem = plan.predicted.memory_by_rank
                need = max(max(node_host_need(plan, profile, cluster, mem, i)) for i in range(len(cluster.nodes)))
                least = math.ceil(need / HOST_USABLE / GIB)
                for ram in sorted({least, math.ceil(least * 1.25), math.ceil(least * 1.5), round(has * factor / GIB)}):
                    found = ram * GIB <= has * factor and _fits(profile, with_host_ram(cluster, ram * GIB),
                                                               global_batch, c, memory_budget, opt)
                    if found:
                        plan = found
                        break
                need = max(max(node_host_need(plan, profile, cluster, plan.predicted.memory_by_rank, i))
                           for i in range(len(cluster.nodes)))
                out.append(f"host RAM is the binding limit ({has / GIB:.0f} GiB per node): with --host-ram {ram}GiB "
                           f"it fits as {summary(plan)} ({_figures(plan)}; {need / GIB:.1f} GiB of host memory per "
                           f"node, {HOST_USABLE:.0%} of RAM usable)")
                break
    for key, value in c.fixed().items():
        plan = _fits(profile, cluster, global_batch, replace(c, **{key: None}), memory_budget, opt)
        if plan:
            out.append(f"drop --{key.replace('_', '-')} {value}: fits as {summary(plan)} ({_figures(plan)})")
    if c.micro_batch != 1 and global_batch > 1:
        plan = _fits(profile, cluster, global_batch, replace(c, micro_batch=1, num_microbatches=None), memory_budget,
                     opt)
        if plan and not any(a.startswith("drop --micro-batch") for a in out):
            out.append(f"micro-batch 1: fits as {summary(plan)}")
    for factor in (2, 4, 8):
        plan = _fits(profile, _bigger(cluster, factor), global_batch, replace(c, dp=None, pp=None), memory_budget,
                     opt)
        if plan:
            out.append(f"{cluster.world_size * factor} GPUs ({factor}x): fits as {summary(plan)}")
            break
    need, static = result.least_need
    if need > result.budget_bytes > static:
        gpu = cluster.gpu_of(0)
        room = result.budget_bytes if gpu.name == "cpu" else (result.budget_bytes - gpu.context_bytes) / (
            1 + FRAGMENTATION)
        used = need if gpu.name == "cpu" else (need - gpu.context_bytes) / (1 + FRAGMENTATION)
        seq = int(profile.seq_len * (room - static) / max(used - static, 1)) // 64 * 64
        if seq >= 64:
            out.append(f"sequence length <= about {seq} (activations scale with it; re-run snugfit plan --seq {seq} "
                       f"to check)")
    plan = _fits(_lora(profile), cluster, global_batch, c, memory_budget, opt)
    if plan:
        out.append(f"LoRA fine-tuning (frozen base weights, ~{LORA_TRAINABLE:.0%} trainable): fits as {summary(plan)}")
    return out or ["GPU memory is the binding limit: nothing short of a larger GPU fits, even every block sharded, "
                   "offloaded and recomputed"]
