"""`snugfit diagnose`'s one picture: step time per rank over the run against the prediction, and the latest traced
step's measured seconds per term and rank beside the predicted ones."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from snugfit.plan.corrections import TERMS


def draw(run, measured: dict[int, dict[str, float]], out: Path) -> Path:
    fig = Figure(figsize=(11, 4.2), dpi=100)
    over, terms = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.2, 1]})
    train = [r for r in run.kind("train") if "step_time_s" in r]
    steps = [r["step"] for r in train]
    by_rank = [r.get("step_time_by_rank_s") or [r["step_time_s"]] for r in train]
    for i in range(max((len(x) for x in by_rank), default=0)):
        over.plot(steps, [x[i] if i < len(x) else float("nan") for x in by_rank], lw=1.2, label=f"rank {i} measured")
    if any("predicted_step_time_s" in r for r in train):
        over.plot(steps, [r.get("predicted_step_time_s", float("nan")) for r in train], "k--", lw=1.2,
                  label="predicted")
    _, predicted_step = run.predicted()
    if predicted_step and not any("predicted_step_time_s" in r for r in train):  # a plan written without them
        over.axhline(predicted_step, color="black", ls="--", lw=1.2, label="predicted")
    for r in run.kind("replan"):  # the traced step, then the profiled one (the profiler's start slows it)
        over.axvspan(r["step"] - 0.5, r["step"] + 1.5, color="grey", alpha=0.15, lw=0, label="calibration")
    over.set_xlabel("step")
    over.set_ylabel("seconds per step")
    over.set_title("step time, measured against predicted")
    over.grid(alpha=0.3)
    over.legend(fontsize=8)

    predicted = run.predicted()[0]
    names = [t for t in (*TERMS, "bubble", "host")
             if predicted.get(t) or any(m.get(t) for m in measured.values())]
    width = 0.8 / (1 + len(measured))
    xs = range(len(names))
    terms.bar([x - 0.4 + width / 2 for x in xs], [predicted.get(t, 0.0) for t in names], width, color="black",
              alpha=0.6, label="predicted")
    for j, (rank, m) in enumerate(sorted(measured.items()), start=1):
        terms.bar([x - 0.4 + width * (j + 0.5) for x in xs], [m.get(t, 0.0) for t in names], width,
                  label=f"rank {rank} measured")
    terms.set_xticks(list(xs), [t.replace("_", " ") for t in names], rotation=30, ha="right", fontsize=8)
    terms.set_ylabel("seconds per step")
    shown = [k for k in run.traces if k not in run.profiled]
    terms.set_title(f"per term, traced step {max(shown)}" if shown else "per term (no trace)")
    terms.grid(alpha=0.3, axis="y")
    terms.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    return out
