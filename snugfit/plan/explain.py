"""Say what the search chose and why: the plan, its runners-up, why other families lost, what BPipe
would buy (plan.advice says what would make a plan fit, or pay). Pure: no torch."""

from __future__ import annotations

import math
from collections import Counter

from snugfit.hardware.cluster import Cluster
from snugfit.plan.estimate import HOST_USABLE
from snugfit.plan.memory import FRAGMENTATION, device_bytes
from snugfit.plan.optimizer import describe as describe_optimizer
from snugfit.plan.plan import OptimizerPlan, Plan, Prediction
from snugfit.plan.options import describe
from snugfit.plan.search import SPLIT_MARGIN, SearchResult
from snugfit.plan.verify import SIMPLER_MARGIN
from snugfit.profile.types import kinds_text

GIB = 2**30
# A runner-up more than this many times the chosen plan's step is no alternative a reader would take: it is counted,
# not listed (Qwen2.5-7B LoRA on one A100 listed plans 40x slower than the chosen one)
FAR_SLOWER = 3.0


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
    """'model llama-2-7b: 6,738,415,616 parameters (4,194,304 trainable), 32 blocks, hidden 4096, vocabulary 32000',
    then the trainable parameters by kind on a line of their own where the profile counted them."""
    parts = [f"{m['trainable']:,} trainable"] + ([f"{m['quantized_nf4']:,} in NF4"] if m.get("quantized_nf4") else [])
    parts += [f"{m['active']:,} active a token"] if m.get("active") else []
    kinds = f"\n  trainable by kind: {kinds_text(m['trainable_by_kind'])}" if m.get("trainable_by_kind") else ""
    return (f"model {m['name']}: {m['parameters']:,} parameters ({', '.join(parts)}), {m['blocks']} blocks, "
            f"hidden {m['hidden']}, vocabulary {m['vocabulary']}{kinds}")


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
    lines += [f"  note: {res.note}"] if res.note else []
    faster = [p for p in res.alternatives if p.predicted.step_time_s < pred.step_time_s]
    if faster:  # the search's preference (search._preference) breaks ties at the time model's resolution
        lines.append("  " + why_not_the_fastest(best, min(faster, key=lambda p: p.predicted.step_time_s)))
    lines += ["  " + line for line in memory_lines(pred)]
    lines.append("  " + phases_line(pred))
    near = [p for p in res.alternatives if p.predicted.step_time_s <= FAR_SLOWER * pred.step_time_s]
    if near:
        lines.append("alternatives:")
        lines += [f"  {_figures(p)}: {summary(p)}" for p in near]
    if far := len(res.alternatives) - len(near):
        lines.append(f"{far} more verified plan{'s' if far > 1 else ''}, over {FAR_SLOWER:g}x the chosen step, not "
                     "listed")
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
    if top.offloads_state and not best.offloads_state:  # verify.simpler
        return f"within {SIMPLER_MARGIN:.0%} of the fastest ({tokens}), which offloads state; chosen with nothing offloaded"
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
    """What BPipe's memory buys against what its activation moves cost, weighed against the best 1F1B plan (the
    schedule BPipe changes, the one a user would otherwise run), with the best plan of any other schedule and the
    best V schedule's figure beside it."""
    bp, plain = res.bpipe, res.best_1f1b
    if bp is None:
        return "BPipe: no BPipe plan fits (it needs pp > 1 and at least pp microbatches)\n" + _v_schedule(res)
    if plain is None:
        return f"BPipe: {_figures(bp)}; no 1F1B plan fits, so BPipe is what makes a pipeline fit\n" + _v_schedule(res)
    lines = [f"BPipe:        {_figures(bp)}: {summary(bp)}",
             f"1F1B:         {_figures(plain)}: {summary(plain)}"]
    rec = lambda p: sum(bool(b.policy.recomputes) for b in p.blocks)  # noqa: E731
    lines.append(f"memory buys: micro-batch {bp.micro_batch_size} vs {plain.micro_batch_size}, "
                 f"{rec(bp)} vs {rec(plain)} blocks recomputing; recompute time "
                 f"{bp.predicted.time_by_phase.get('recompute', 0):.3g} s vs "
                 f"{plain.predicted.time_by_phase.get('recompute', 0):.3g} s")
    bp_time = bp.predicted.time_by_phase
    lines.append(f"moves cost: bubble {bp_time.get('bubble', 0):.3g} s vs "
                 f"{plain.predicted.time_by_phase.get('bubble', 0):.3g} s (evictions hide in the forward of the "
                 f"next microbatch, loads in the wait for the gradient; what they do not hide shows up as bubble)")
    other = res.best_without_bpipe
    if other is not None and other is not plain:
        lines.append(f"best other:   {_figures(other)}: {summary(other)} (BPipe "
                     f"{speed_words(other.predicted.step_time_s / bp.predicted.step_time_s)})")
    verdict = "chosen" if res.best is bp else "not chosen"
    lines.append(f"verdict: BPipe is {speed_words(plain.predicted.step_time_s / bp.predicted.step_time_s)} than 1F1B "
                 f"-> {verdict}")
    return "\n".join(lines + [_v_schedule(res)])


def _v_schedule(res: SearchResult) -> str:
    """The best V schedule's figure beside BPipe's: it balances stages' memory by where they sit, not by moves."""
    v = res.best_v
    if v is None:
        return "V schedule:   none fits (it needs pp > 1, two stages per rank and a split backward's options)"
    bp = res.bpipe
    than = f", {speed_words(bp.predicted.step_time_s / v.predicted.step_time_s)} than BPipe" if bp else ""
    return f"V schedule:   {_figures(v)}{than}: {summary(v)}"
