"""`snugfit diagnose RUN_DIR`: where a run's measurements depart from its plan's predictions, in words.

Reads what `snugfit train` wrote: plan.json (the predictions), metrics.jsonl (measured step time per rank and
memory every log interval, checkpoints' blocking time, replan records) and traces/step_N.json (every rank's
spans of a traced step: `--trace-step`, and the calibration step of `[train] replan`).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from snugfit.errors import SnugfitError
from snugfit.plan.corrections import TERMS, attribute
from snugfit.plan.plan import Plan
from snugfit.report.measured import PHASE_TERMS, PHASE_WORDS, measured_step, stragglers
from snugfit.report.routing import routing_table
from snugfit.report.trace import StepTrace

STRAGGLER_SHARE = 0.25  # own time in a phase this share of a step (and STRAGGLER_MIN_S) above its peers' median
STRAGGLER_MIN_S = 0.03  # (one traced step on a shared host has hiccups of a few milliseconds)
MODEL_OFF = 1.5  # a term measured this many times its prediction (or its inverse) is named
MEMORY_OVER = 1.10  # measured peak this far above the prediction is alarming
CHECKPOINT_SHARE = 0.10  # checkpoints blocking this share of the run's step time are alarming


@dataclass
class Finding:
    text: str  # one line in words
    term: str  # the model's term it concerns
    alarm: bool  # a problem of the run, not only of the model


@dataclass
class Diagnosis:
    table: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    picture: Path | None = None

    def lines(self) -> list[str]:
        alarms = [f for f in self.findings if f.alarm]
        out = [*self.table, ""]
        out += [f"{'!' if f.alarm else '-'} {f.text} (term: {f.term})" for f in self.findings]
        out.append("nothing alarming" if not alarms else f"{len(alarms)} alarming finding(s), marked !")
        if self.picture:
            out.append(f"picture: {self.picture}")
        return out


@dataclass
class Run:
    plan: Plan
    records: list[dict]
    traces: dict[int, tuple[StepTrace, list[float] | None]]  # step -> (spans of every rank, FSDP2's share per rank)
    profiled: set[int] = field(default_factory=set)  # traced steps the profiler ran in (calibration)

    def kind(self, kind: str) -> list[dict]:
        return [r for r in self.records if r.get("kind", "train") == kind]

    def predicted(self) -> tuple[dict[str, float], float | None]:
        """(seconds per term, step seconds) the plan predicted; for a plan written without predictions (--plan dp,
        a plan file), the time model's figures a replan record computed for it."""
        if self.plan.predicted is not None:
            return self.plan.predicted.time_by_phase, self.plan.predicted.step_time_s
        replan = next(iter(self.kind("replan")), None)
        return (replan["predicted_terms_s"], replan["uncorrected_step_s"]) if replan else ({}, None)


def read_run(run_dir: Path) -> Run:
    if not (run_dir / "plan.json").exists():
        raise SnugfitError(f"{run_dir} holds no plan.json: name the --out-dir of a `snugfit train` run")
    plan = Plan.from_json((run_dir / "plan.json").read_text())
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    traces, profiled = {}, set()
    for path in sorted((run_dir / "traces").glob("step_*.json")):
        d = json.loads(path.read_text())
        traces[d["step"]] = StepTrace.from_dict(d), d.get("fsdp_share")
        if d.get("profiled"):
            profiled.add(d["step"])
    return Run(plan, records, traces, profiled)


def _s(x: float) -> str:
    return f"{x:.3g}"


def term_name(plan: Plan, term: str) -> str:
    """A term as the plan has it: with one data-parallel rank there is no dp communication, and what the model's
    dp_comm_exposed holds (and the trace measures in FSDP2's ranges) is FSDP2's own copies and hooks around each
    unit (plan.cpu_ranks.cpu_fsdp_time)."""
    return "fsdp2_own_work" if term == "dp_comm_exposed" and plan.shard_ranks == 1 else term


def unmeasured_terms(run: Run, step: int) -> set[str]:
    """Terms the traced step could not measure: without an FSDP2 profile its ranges count as compute, so at one
    data-parallel rank (no collectives traced) FSDP2's own work, dp_comm_exposed's figure, is not measured."""
    return {"dp_comm_exposed"} if run.traces[step][1] is None and run.plan.shard_ranks == 1 else set()


def corrected_words(run: Run) -> str:
    """' (corrected: compute x1.32, ...)' where the plan's predictions carry a run's corrections, else ''."""
    factors = run.plan.predicted.corrections if run.plan.predicted else {}
    return f" (corrected: {', '.join(f'{t} x{f:.2f}' for t, f in sorted(factors.items()))})" if factors else ""


def phase_table(run: Run, step: int) -> tuple[list[str], dict[int, dict[str, float]]]:
    """Predicted against measured per term and rank, for one traced step; and the measured seconds per rank."""
    trace, fsdp = run.traces[step]
    predicted, predicted_step = run.predicted()
    measured = {r: attribute(measured_step(trace, r, fsdp[r] if fsdp else 0.0), predicted, run.plan.pp > 1)
                for r in trace.ranks}
    ranks = sorted(measured)
    head = f"{'term':<18}{'predicted':>10}" + "".join(f"{f'rank {r}':>10}" for r in ranks)
    lines = [f"traced step {step}{'' if fsdp else ' (no FSDP2 profile: its time counts as compute)'}"
             f"{corrected_words(run)}:", head]
    for term in (*TERMS, "bubble", "host"):
        got = [measured[r].get(term, 0.0) for r in ranks]
        want = predicted.get(term)
        if not any(got) and not want:
            continue
        cells = ["-"] * len(got) if term in unmeasured_terms(run, step) else [_s(g) for g in got]
        lines.append(f"{term_name(run.plan, term):<18}{_s(want) if want is not None else '-':>10}"
                     + "".join(f"{c:>10}" for c in cells))
    step_s = [max(s.end for s in trace.spans if s.rank == r) for r in ranks]
    lines.append(f"{'step':<18}{_s(predicted_step) if predicted_step else '-':>10}"
                 + "".join(f"{_s(s):>10}" for s in step_s))
    return lines, measured


def over_the_run(run: Run) -> tuple[list[str], list[Finding]]:
    """Step time per rank over the run against the prediction, and ranks slower than the rest."""
    train = [r for r in run.kind("train") if "step_time_by_rank_s" in r]
    if not train:
        return [], []
    ranks = len(train[0]["step_time_by_rank_s"])
    med = [statistics.median(r["step_time_by_rank_s"][i] for r in train) for i in range(ranks)]
    pred = train[-1].get("predicted_step_time_s") or run.predicted()[1]
    lines = [f"steps {train[0]['step']}-{train[-1]['step']}: median step "
             + " ".join(f"rank {i} {_s(m)} s" for i, m in enumerate(med))
             + (f" (predicted {_s(pred)} s)" if pred else "")]
    findings = []
    everyone = statistics.median(med)
    for i, m in enumerate(med):
        if m > 1.25 * everyone and m - everyone > STRAGGLER_MIN_S:
            findings.append(Finding(f"rank {i} takes {_s(m)} s per step over the run, its peers {_s(everyone)} s",
                                    "step", True))
    if pred and not 1 / MODEL_OFF <= everyone / pred <= MODEL_OFF:
        findings.append(Finding(f"steps take {everyone / pred:.2f}x the {_s(pred)} s predicted over the run", "step",
                                False))
    return lines, findings


def straggler_findings(run: Run) -> list[Finding]:
    """Stragglers of every traced step, each (rank, phase) once, with the step where it stood out most. Alarming
    where it stands out in two traced steps or more (or in the only one): one step's hiccup on a shared host is
    named as such."""
    seen: dict[tuple[int, str], list] = {}
    for step, (trace, _) in sorted(run.traces.items()):
        step_s = statistics.median(max(s.end for s in trace.spans if s.rank == r) for r in trace.ranks)
        for s in stragglers(trace, max(STRAGGLER_MIN_S, STRAGGLER_SHARE * step_s)):
            seen.setdefault((s.rank, s.phase), []).append((step, s))
    out = []
    for (rank, phase), found in seen.items():
        step, s = max(found, key=lambda f: f[1].excess_s)
        waits = "; ".join(f"rank {r} waits {_s(sec)} s for it in {PHASE_WORDS.get(kind, kind)}"
                          for r, (kind, sec) in sorted(s.waits.items()) if sec > STRAGGLER_MIN_S)
        steps = ", ".join(str(st) for st, _ in found)
        alarm = len(found) > 1 or len(run.traces) == 1
        text = (f"rank {rank} is a straggler in {PHASE_WORDS.get(phase, phase)}, in {len(found)} of "
                f"{len(run.traces)} traced steps ({steps}): {_s(s.excess_s)} s more of its own than its peers at "
                f"step {step}"
                + (f"; {waits}" if waits else "")) if alarm else (
                f"rank {rank} stood out in {PHASE_WORDS.get(phase, phase)} at step {step} only, of "
                f"{len(run.traces)} traced steps ({_s(s.excess_s)} s): a hiccup, not a straggler")
        out.append(Finding(text, PHASE_TERMS.get(phase, phase), alarm))
    return out


def term_findings(run: Run, measured: dict[int, dict[str, float]], step: int) -> list[Finding]:
    """The model's terms that the traced step measured far from their prediction (mean over ranks). At the run's
    calibration step, the factors the run derived and printed (its replan record), not figures of diagnose's own;
    elsewhere against the plan's predictions. Only terms the step measured: without an FSDP2 profile its ranges
    count as compute, and dp communication is then only the traced collectives (none at one data-parallel rank)."""
    predicted = run.predicted()[0]
    unmeasured = unmeasured_terms(run, step)
    calib = next((r for r in run.kind("replan") if r["step"] == step), None)
    out = []
    floor = max(1e-4, 0.02 * sum(predicted.values()))
    for term in (t for t in TERMS if t not in unmeasured):
        want = predicted.get(term, 0.0)
        each = [m.get(term, 0.0) for m in measured.values()]
        got = min(each) if term == "dp_comm_exposed" else statistics.mean(each)  # as plan.corrections.derive reads
        against, factor = f"predicted {_s(want)} s{corrected_words(run)}", got / want if want else 0.0
        if calib is not None and term in calib["corrections"]:
            want, got = calib["predicted_terms_s"][term], calib["measured_terms_s"][term]
            against, factor = f"predicted {_s(want)} s by the uncorrected model", calib["corrections"][term]
            against += " (the factor the run derived)"
        if want >= floor and not 1 / MODEL_OFF <= factor <= MODEL_OFF:
            name = term_name(run.plan, term)
            out.append(Finding(f"at step {step} the model's {name} term is off: measured {_s(got)} s per step, "
                               f"{against} (x{factor:.2f})", name, False))
    host = statistics.mean(m.get("host", 0.0) for m in measured.values())
    if host > floor:
        out.append(Finding(f"at step {step} {_s(host)} s per step pass between traced actions (host work the model "
                           "leaves out)", "host dispatch", False))
    return out


def memory_findings(run: Run) -> list[Finding]:
    rec = next((r for r in reversed(run.kind("train")) if r.get("predicted_peak_memory_bytes")), None)
    if rec is None:
        return []
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    out, worst = [], 0.0
    for i, (got, want) in enumerate(zip(rec["peak_memory_bytes"], rec["predicted_peak_memory_bytes"])):
        if want and got > MEMORY_OVER * want:
            out.append(Finding(f"rank {i} peaks at {mib(got)}, {got / want - 1:.0%} over the {mib(want)} predicted "
                               f"(step {rec['step']})", "memory", True))
        worst = max(worst, abs(got / want - 1) if want else 0.0)
    if not out:
        out.append(Finding(f"peak memory within {worst:.0%} of the prediction on every rank (step {rec['step']})",
                           "memory", False))
    return out


def checkpoint_findings(run: Run) -> list[Finding]:
    """Checkpoints' blocking time; only those during training can alarm (the last one ends the run)."""
    train = run.kind("train")
    if not train:
        return []
    last = train[-1]["step"]
    saves = [r["blocked_s"] for r in run.kind("checkpoint") if "blocked_s" in r and r["step"] < last]
    final = [r["blocked_s"] for r in run.kind("checkpoint") if "blocked_s" in r and r["step"] >= last]
    if not saves:
        return [Finding(f"the final checkpoint took {_s(final[0])} s", "checkpoint", False)] if final else []
    steps = last - (train[0]["step"] - 1)
    run_s = statistics.median(r["step_time_s"] for r in train) * max(steps, 1)
    share = sum(saves) / (run_s + sum(saves))
    return [Finding(f"checkpoints block training {_s(statistics.mean(saves))} s each ({len(saves)} "
                    f"save{'s' if len(saves) > 1 else ''} during training, {share:.0%} of its time)", "checkpoint",
                    share > CHECKPOINT_SHARE)]


def replan_findings(run: Run) -> list[Finding]:
    out = []
    for r in run.kind("replan"):
        fac = ", ".join(f"{t} x{f:.2f}" for t, f in sorted(r["corrections"].items())) or "none"
        text = f"replan at step {r['step']}: corrections {fac}; "
        if r.get("new_plan") is None or r.get("same_plan"):
            text += "the corrected model keeps the plan"
        else:
            text += f"the corrected model prefers another plan, {r['predicted_gain']:.0%} faster predicted"
        out.append(Finding(text, "corrections", False))
    return out


def diagnose(run_dir: Path, picture: Path | None = None) -> Diagnosis:
    run = read_run(run_dir)
    diag = Diagnosis()
    lines, findings = over_the_run(run)
    diag.table += lines
    measured = {}
    for step in sorted(run.traces):
        if step in run.profiled:  # the profiler slowed its operators: for stragglers only
            continue
        table, measured = phase_table(run, step)
        diag.table += table
        findings += term_findings(run, measured, step)
    findings += straggler_findings(run) + memory_findings(run) + checkpoint_findings(run) + replan_findings(run)
    diag.table += routing_table([r["tokens_per_expert"] for r in run.kind("train") if "tokens_per_expert" in r],
                                run.plan.ep, run.predicted()[0])
    diag.findings = sorted(findings, key=lambda f: not f.alarm)
    if picture is not None:
        from snugfit.report.diagnose_picture import draw

        diag.picture = draw(run, measured, picture)
    return diag
