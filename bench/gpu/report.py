"""The GPU acceptance suite's report: acceptance.json as it grows, and acceptance.md, the table docs/gpu.md holds."""

from __future__ import annotations

import json
from pathlib import Path

GIB = 2**30


def markdown(report: dict) -> str:
    """The table of what has run so far; a part that failed shows its error."""
    gib = lambda b: f"{b / GIB:.3g}" if b is not None else "-"  # noqa: E731
    sec = lambda x: f"{x:.3g}" if x is not None else ""  # noqa: E731
    elapsed = f"{report['elapsed_s']:.0f} s" if "elapsed_s" in report else "unfinished"
    lines = [f"# snugfit GPU acceptance: {report['device']}", "",
             f"model {report['params']:,} parameters, seq {report['seq_len']}, batch {report['global_batch']}, "
             f"{report['dtype']}; {elapsed}", "",
             "| technique | loss vs reference | pred s | meas s | time err | pred s, measured card | its err | pred GiB "
             "| allocated GiB | reserved GiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report.get("techniques", []):
        if "skipped" in r:
            lines.append(f"| {r['technique']} | skipped: {r['skipped']} | | | | | | | | |")
        elif "error" in r:
            lines.append(f"| {r['technique']} | {r['error']} | {sec(r.get('predicted_step_s'))} | | | | | | | |")
        elif "loss_ok" in r:
            verdict = f"{'ok' if r['loss_ok'] else 'FAIL'} ({r['loss_error']:.1e} <= {r['loss_tolerance']:.0e})"
            err = lambda pred: f"{pred / r['measured_step_s'] - 1:+.0%}" if pred else ""  # noqa: E731
            on_measured = r.get("predicted_measured_step_s")
            lines.append(f"| {r['technique']} | {verdict} | {r['predicted_step_s']:.3g} | {r['measured_step_s']:.3g} "
                         f"| {err(r['predicted_step_s'])} | {sec(on_measured)} | {err(on_measured)} "
                         f"| {gib(r['predicted_peak_bytes'])} | {gib(r['measured_peak_bytes'])} "
                         f"| {gib(r['measured_reserved_bytes'])} |")
    d = report.get("offload_comparison")
    if d and "plans" in d:
        lines += ["", f"## snugfit vs FSDP2 full offload (budget {gib(d['budget_bytes'])} GiB)", "",
                  "| plan | pred s | meas s | pred GiB | meas GiB |", "|---|---|---|---|---|"]
        for name, r in d["plans"].items():
            meas = (f"{r['error']} | {gib(r['predicted_peak_bytes'])} |" if "error" in r else
                    f"{r['measured_step_s']:.3g} | {gib(r['predicted_peak_bytes'])} | {gib(r['measured_peak_bytes'])}")
            lines.append(f"| {name}: {r['plan']} | {r['predicted_step_s']:.3g} | {meas} |")
        lines.append("speedup: " + ", ".join(f"{v:.2f}x {k}" for k, v in d["speedup"].items()))
    elif d:
        lines += ["", f"## snugfit vs FSDP2 full offload: {d['error']}"]
    h = report.get("hardware")
    if h and "device" in h:
        lines += ["", f"## {h['device']} measured (catalogue: {h['catalogue']})", "", "```",
                  json.dumps({k: v for k, v in h.items() if k not in ("device", "catalogue")}, indent=1), "```"]
    elif h:
        lines += ["", f"## hardware: {h['error']}"]
    c = report.get("corrections")
    if c and "corrections" in c:
        lines += ["", f"## corrections a run's calibration derives here ({c['plan']})", "",
                  "| term | predicted s | measured s | factor |", "|---|---|---|---|"]
        lines += [f"| {t} | {sec(c['predicted_terms_s'].get(t))} | {sec(m)} | {sec(c['corrections'].get(t))} |"
                  for t, m in c["measured_terms_s"].items()]
        lines.append(f"catalogue figures they correct: {json.dumps(c['catalogue'])}")
    elif c:
        lines += ["", f"## corrections: {c['error']}"]
    return "\n".join(lines) + "\n"


def save(report: dict, out: Path) -> str:
    """Write the report so far (a run stopped at its time limit still leaves every finished row); the table."""
    (out / "acceptance.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (out / "acceptance.md").write_text(table)
    return table
