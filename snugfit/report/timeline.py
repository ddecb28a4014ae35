"""Gantt chart of one training step as the plan predicts it (and as it was measured), with memory beneath.

The picture is drawn from the same event simulation the time model uses, so what it shows
is exactly what the step-time prediction assumed: where each rank computes, recomputes,
moves activations, waits (bubbles), reduces gradients and steps the optimizer.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from snugfit.hardware.cluster import Cluster
from snugfit.plan.estimate import StepEstimate, estimate_step
from snugfit.plan.memory import device_bytes
from snugfit.plan.piece_memory import device_saved
from snugfit.plan.plan import Plan
from snugfit.plan.schedules import COMPUTE
from snugfit.plan.simulate import Event, SimResult
from snugfit.profile.types import ModelProfile
from snugfit.report.trace import StepTrace

COLOURS = {
    "F": "#4C72B0", "B": "#DD8452", "I": "#DD8452", "W": "#E8B04A", "recompute": "#8172B3", "evict": "#55A868",
    "load": "#64B5CD", "offload": "#CCB974", "collective": "#C44E52", "host optimizer": "#937860",
    "optimizer": "#DA8BC3", "bubble": "#EEEEEE",
}
LABELS = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weights)",
          "recompute": "recompute", "evict": "BPipe evict", "load": "BPipe load", "offload": "activation offload",
          "collective": "collective (exposed)", "host optimizer": "host optimizer", "optimizer": "optimizer step",
          "bubble": "bubble (idle)"}
TRANSFERS = ("evict", "load", "offload")  # overlap compute: drawn in a thin lane under it
TRANSIENT = ("activations", "working", "logits_loss")  # prediction categories that change during the step
GiB = 2**30


@dataclass
class StageDetail:
    """What the time and memory models know beyond the simulated events; lists are per global stage
    unless they say per pipeline rank."""

    recompute: list[float]  # seconds at the start of each backward
    comm_f: list[float]  # exposed ZeRO-3 gathers per forward / backward
    comm_b: list[float]
    offload_f: list[float]  # exposed activation offload per forward / backward
    offload_b: list[float]
    offload_move: list[float]  # one microbatch's activation offload transfer (overlapped), 0 if none
    act_bytes: list[int]  # device bytes one microbatch's saved activations hold
    static_bytes: list[int]  # per pipeline rank: device bytes held all step
    peak_bytes: list[int]  # per pipeline rank: predicted peak
    budget_bytes: int | None
    tail: list[dict[str, float]]  # per pipeline rank: seconds after the pipeline drains, in order
    step_s: float = 0.0  # the predicted step (Prediction.step_time_s): what the chart's title names


def timeline_for(plan: Plan, profile: ModelProfile, cluster: Cluster,
                 memory_budget_bytes: int | None = None) -> tuple[SimResult, StageDetail]:
    """The time model's simulation and what the chart splits its events by, as estimate() computed them (of a
    copy of the plan: its own predictions stay what it was planned with, which the run's log reports)."""
    est = estimate_step(replace(plan, predicted=None), profile, cluster, memory_budget_bytes)
    return est.sim, stage_detail(est, plan)


# steps this far apart are one: the estimate is a float computation of the same inputs
SAME_STEP = 1e-3


def differs_why(plan: Plan, step_s: float) -> str | None:
    """Why a re-estimate of the plan on this machine (the timeline of a traced step) predicts another step than
    the plan's own prediction, in one line; None where both agree, or the plan carries none."""
    if plan.predicted is None or abs(step_s - plan.predicted.step_time_s) <= SAME_STEP * plan.predicted.step_time_s:
        return None
    from snugfit.hardware.catalogue import hardware_cache_path, load_local

    now = ("has none now (set aside as measured under load, or of an older snugfit): the next run measures it again"
           if load_local() is None else f"was measured again since ({hardware_cache_path()})")
    return (f"predicted step {step_s:.4g} s here against the plan's {plan.predicted.step_time_s:.4g} s: the plan was "
            f"predicted with another measurement of this machine, which {now}")


def stage_detail(est: StepEstimate, plan: Plan) -> StageDetail:
    """What the chart draws beyond the events, read from the estimate: each stage's times as the rank that sets
    its pace has them, each pipeline rank's row as its first rank (plan.RankLayout) has it."""
    n = plan.pp * plan.virtual_stages
    st = [est.stage_time(k) for k in range(n)]
    rows = [est.rank(plan.layout.rank(pr)) for pr in range(plan.pp)]
    cats = [row.memory.cats for row in rows]
    return StageDetail(
        recompute=[s.recompute for s in st], comm_f=[s.comm_exposed / 2 for s in st],
        comm_b=[s.comm_exposed / 2 for s in st], offload_f=[s.offload_exposed / 2 for s in st],
        offload_b=[s.offload_exposed / 2 for s in st], offload_move=list(est.offload_move),
        act_bytes=[sum(device_saved(sp) for sp in est.stages[plan.stage_rank(k)][k]) for k in range(n)],
        static_bytes=[sum(v for k, v in c.items() if not k.startswith("host:") and k not in TRANSIENT) for c in cats],
        peak_bytes=[device_bytes(c) for c in cats], budget_bytes=est.prediction.memory_budget_bytes,
        tail=[dict(row.tail) for row in rows], step_s=est.prediction.step_time_s,
    )


def _segments(ev: Event, d: StageDetail | None) -> list[tuple[str, float, float]]:
    """Split one simulated compute event into (kind, start, width), in the order they happen."""
    if d is None:
        return [(ev.kind, ev.start, ev.end - ev.start)]
    k = ev.stage
    if ev.kind == "F":
        parts = [("collective", d.comm_f[k]), ("offload", d.offload_f[k])]
    elif ev.kind == "W" and k:  # a split backward's weight pass recomputes again (estimate._paces)
        parts = [("recompute", d.recompute[k])]
    else:
        parts = [("collective", d.comm_b[k]), ("offload", d.offload_b[k]), ("recompute", d.recompute[k])]
    out, t = [], ev.start
    for kind, w in parts:
        if w > 0:
            out.append((kind, t, w))
            t += w
    return out + [(ev.kind, t, max(0.0, ev.end - t))]


def _draw_rows(ax, rows: dict[int, dict[str, list[tuple[float, float]]]], labels: list[str], end: float,
               texts: list[tuple[int, float, float, str]], axis_end: float | None = None) -> set[str]:
    """One row per entry of `rows` (top to bottom): a bubble band, compute lane, thin transfer lane.

    axis_end: seconds the shared time axis spans (default `end`), which decides which bars have room for text.
    """
    used = {"bubble"}
    ms = 1e3
    for y, by_kind in rows.items():
        ax.broken_barh([(0.0, end * ms)], (y - 0.4, 0.8), facecolors=COLOURS["bubble"])
        for kind, bars in by_kind.items():
            lane = (y + 0.2, 0.2) if kind in TRANSFERS else (y - 0.4, 0.58)
            ax.broken_barh([(s * ms, w * ms) for s, w in bars], lane, facecolors=COLOURS.get(kind, "#999999"),
                           edgecolor="white", linewidth=0.3)
            used.add(kind)
    for y, s, w, text in texts:
        if w > 0.012 * max(1.0, 0.5 * len(text)) * (axis_end or end):  # room for the text
            ax.text((s + w / 2) * ms, y - 0.11, text, ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(list(rows), labels)
    ax.set_ylim(max(rows, default=0) + 0.6, -0.6)
    return used


def _label(mb: int, stage: int, v: int) -> str:
    """A compute bar's text: its microbatch, and its stage where a rank runs several (interleaved)."""
    return f"{mb}" if v == 1 or stage < 0 else f"{mb}.s{stage}"


def _predicted_rows(sim: SimResult, d: StageDetail | None, pp: int, v: int = 1):
    rows: dict[int, dict[str, list]] = {r: defaultdict(list) for r in range(pp)}
    texts = []
    for ev in sim.events:
        if ev.kind in COMPUTE:
            for kind, s, w in _segments(ev, d):
                rows[ev.rank][kind].append((s, w))
            texts.append((ev.rank, ev.start, ev.end - ev.start, _label(ev.mb, ev.stage, v)))
            if d is not None and d.offload_move[ev.stage] > 0:
                rows[ev.rank]["offload"].append((ev.start, d.offload_move[ev.stage]))
        else:
            rows[ev.rank][ev.kind].append((ev.start, ev.end - ev.start))
    end = sim.makespan
    for r in range(pp):
        t = sim.makespan
        for kind, w in (d.tail[r].items() if d else ()):
            if w > 0:
                rows[r][kind].append((t, w))
                t += w
        end = max(end, t)
    return rows, texts, end


def _memory_curve(sim: SimResult, rank: int, d: StageDetail | None) -> tuple[list[float], list[float]]:
    """Activations held (plus static bytes) at each compute event's start and end, from the snapshots."""
    size = d.act_bytes if d else None
    base = d.static_bytes[rank] if d else 0
    xs, ys = [], []
    for snap in sim.snapshots[rank]:
        ev = snap.event
        held = sum((size[s] if size else 1) * n for s, n in snap.resident.items() if n)
        own = size[ev.stage] if size else 1
        xs += [ev.start, ev.end]
        ys += [base + held + (own if ev.kind == "B" else 0), base + held + (own if ev.kind == "F" else 0)]
    scale = GiB if d else 1
    return [x * 1e3 for x in xs], [y / scale for y in ys]


def draw_timeline(sim: SimResult, plan: Plan, out: str | Path, measured: StepTrace | None = None,
                  detail: StageDetail | None = None) -> Path:
    """Write the step's Gantt chart (one row per pipeline rank; measured spans below) and memory over time.

    The format follows the extension (.png, .svg, .pdf). Without `detail` (from timeline_for) events are
    drawn whole and memory is counted in microbatches held.
    """
    out = Path(out)
    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ValueError(f"timeline file {out} must end in .png, .svg or .pdf")
    pp, dp = plan.pp, plan.dp
    rows, texts, end = _predicted_rows(sim, detail, pp, plan.virtual_stages)
    n_meas = len(measured.ranks) if measured else 0
    heights = [0.5 * pp + 0.6] + ([0.5 * n_meas + 0.6] if n_meas else []) + [2.0]
    fig = Figure(figsize=(12, sum(heights) + 1.2), layout="constrained")
    axes = fig.subplots(len(heights), 1, sharex=True, gridspec_kw={"height_ratios": heights})
    group = [plan.layout.stage_ranks(r) for r in range(pp)]  # the dp x tp ranks a row stands for
    labels = [f"rank {r}" if len(g) == 1 else f"pp rank {r}\n(ranks {g[0]}-{g[-1]})" for r, g in enumerate(group)]
    axis_end = max(end, measured.duration if n_meas else 0.0)
    used = _draw_rows(axes[0], rows, labels, end, texts, axis_end)
    tp = f" x tp {plan.tp}" if plan.tp > 1 else ""
    axes[0].set_title(f"predicted: {plan.schedule}, dp {dp}{tp} x pp {pp}, {plan.num_microbatches} microbatches "
                      f"of {plan.micro_batch_size} x {plan.seq_len} tokens; step "
                      f"{(detail.step_s if detail else end) * 1e3:,.1f} ms", fontsize=9)
    if n_meas:
        mrows: dict[int, dict[str, list]] = {}
        mtexts = []
        for y, r in enumerate(measured.ranks):
            mrows[y] = defaultdict(list)
            for s in measured.spans:
                if s.rank == r:
                    mrows[y][s.kind].append((s.start, s.end - s.start))
                    if s.kind in ("F", "B") and s.mb >= 0:
                        mtexts.append((y, s.start, s.end - s.start, _label(s.mb, s.stage, plan.virtual_stages)))
        used |= _draw_rows(axes[1], mrows, [f"rank {r}" for r in measured.ranks], measured.duration, mtexts,
                           axis_end)
        axes[1].set_title(f"measured: step {measured.duration * 1e3:,.1f} ms", fontsize=9)
    mem = axes[-1]
    for r in range(pp):
        xs, ys = _memory_curve(sim, r, detail)
        line, = mem.step(xs, ys, where="post", linewidth=1.2, label=labels[r].split("\n")[0])
        if detail:
            mem.axhline(detail.peak_bytes[r] / GiB, color=line.get_color(), linestyle=":", linewidth=0.8)
    mem.set_xlabel("time (ms)")
    if detail:
        top = max(detail.peak_bytes) / GiB
        if detail.budget_bytes and detail.budget_bytes / GiB < 1.5 * top:  # else it would flatten the curves
            mem.axhline(detail.budget_bytes / GiB, color="black", linestyle="--", linewidth=0.8, label="budget")
            top = max(top, detail.budget_bytes / GiB)
        mem.set_ylim(0.9 * min(detail.static_bytes) / GiB, 1.05 * top)
        mem.set_ylabel("device GiB\n(static + activations;\ndotted: predicted peak)", fontsize=8)
    else:
        mem.set_ylim(bottom=0)
        mem.set_ylabel("microbatches held", fontsize=8)
    mem.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    order = [k for k in COLOURS if k in used]
    fig.legend([Patch(color=COLOURS[k]) for k in order], [LABELS[k] for k in order], loc="outside upper center",
               ncol=min(len(order), 6), fontsize=8, frameon=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    return out
