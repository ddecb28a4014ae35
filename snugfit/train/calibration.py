"""Calibration from the run: after `[train] replan_after` steps, trace a step on every rank and profile the next
(FSDP2's own ranges: its gathers, reduce-scatters and their waits), attribute the measured time to the time
model's terms, store the per-term corrections beside the hardware profile, and re-plan with them (`replan`:
"report" records what the corrected model would choose; "switch" also goes on under it, through PlanSwitch; "off"
does none of it). Both are the training loop's handlers (train/run.py).

Also the test hook that makes a straggler on purpose (`SLOW_ENV`), read in one place: `slow_down`.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from snugfit.errors import SnugfitError
from snugfit.plan import Plan, PlanError
from snugfit.plan.corrections import MeasuredStep
from snugfit.report.trace import StepTrace
from snugfit.runtime.engine import Engine, StepResult
from snugfit.train.run import Handler, Run, StepDone

log = logging.getLogger("snugfit")
# Test hook, documented as such: "RANK:SECONDS" makes that rank sleep SECONDS inside every training step, before its
# forward (a straggler made on purpose, for `snugfit diagnose`'s tests). Never set it in a real run.
SLOW_ENV = "SNUGFIT_TEST_SLOW_RANK"
GAIN_STEPS = 6  # steps under a switched-to plan before its measured gain is reported (the first two: warm-up)


def slow_down(rank: int) -> None:
    """Sleep where SLOW_ENV asks it of this rank (the test hook's one place)."""
    spec = os.environ.get(SLOW_ENV)
    if not spec:
        return
    try:
        who, seconds = spec.split(":")
        who, seconds = int(who), float(seconds)
    except ValueError:
        raise SnugfitError(f"{SLOW_ENV}={spec!r}: write RANK:SECONDS, e.g. 1:0.2 (a test hook; unset it)") from None
    if who == rank:
        time.sleep(seconds)


def fsdp_seconds(profiler) -> float:
    """Seconds of a profiled step inside FSDP2's own ranges ("FSDP::..." record_functions), nested ones once."""
    from snugfit.report.measured import union_length

    ranges = [(e.time_range.start, e.time_range.end) for e in profiler.events() if e.name.startswith("FSDP::")]
    return union_length(ranges) / 1e6


@contextmanager
def _without_stderr():
    """File descriptor 2 sent to /dev/null meanwhile (C++ libraries write there, not through sys.stderr)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def profiled_step(engine, batch, rank: int):
    """(engine.train_step(batch)'s result, FSDP2's share of its forward and backward), the step profiled; the
    caller has begun engine.trace (`begin_trace`), which keeps the step's spans (the profiler slows every operator
    alike: the share holds, the seconds do not)."""
    from torch.profiler import ProfilerActivity, profile

    from snugfit.report.measured import measured_step

    prof = profile(activities=[ProfilerActivity.CPU])
    with _without_stderr():  # kineto writes a 'USDT: ... profiler_start' line to stderr
        prof.start()
    res = engine.train_step(batch)
    with _without_stderr():
        prof.stop()
    work = measured_step(engine.trace, rank).work  # engine.trace stays: the step's spans, as any traced step's
    return res, min(1.0, fsdp_seconds(prof) / work) if work else 0.0


def begin_trace(engine) -> None:
    """Trace the engine's next step, its clock started with every rank's (after a barrier)."""
    engine.trace = StepTrace()
    if dist.is_initialized():
        dist.barrier()
    engine.trace.begin()


def calibration_steps(engine, batches, rank: int, world_size: int) -> list[MeasuredStep]:
    """Every rank's traced step in the parts the corrections read, from two steps of `engine` (one traced, the
    next profiled): what a run's calibration measures, in one call (bench/). A collective."""
    from snugfit.report.measured import measured_step

    begin_trace(engine)
    engine.train_step(next(batches))
    traces = gather(engine.trace, world_size)
    begin_trace(engine)
    shares = gather(profiled_step(engine, next(batches), rank)[1], world_size)
    engine.trace = None
    merged = StepTrace.merge(traces)
    return [measured_step(merged, r, shares[r]) for r in range(world_size)]


def gather(obj, world_size: int) -> list:
    """Every rank's `obj`, on every rank (a collective)."""
    if dist.is_initialized() and world_size > 1:
        out: list = [None] * world_size
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def save_trace(out: Path, step: int, traces: list[StepTrace], fsdp_share: list[float] | None = None,
               profiled: bool = False) -> Path:
    """Every rank's spans of a traced step as out/traces/step_N.json (what `snugfit diagnose` reads), with each
    rank's share of FSDP2 in its forward and backward where a profiled step measured it; profiled: the step the
    profiler ran in (its operators slowed)."""
    folder = out / "traces"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step:08d}.json"
    record = {"step": step, **StepTrace.merge(traces).to_dict()}
    if fsdp_share is not None:
        record["fsdp_share"] = fsdp_share
    if profiled:
        record["profiled"] = True
    path.write_text(json.dumps(record))
    return path


def _routing_so_far(cfg) -> list[list[list[int]]]:
    """The recorded steps' tokens per expert (metrics.jsonl), for the routing's imbalance; none without."""
    from snugfit.train.metrics import read_metrics

    path = Path(cfg.train.out_dir) / "metrics.jsonl"
    records = read_metrics(path) if path.exists() else []
    return [r["tokens_per_expert"] for r in records if r.get("kind", "train") == "train" and "tokens_per_expert" in r]


def replan_record(cfg, env, plan, measured: list[MeasuredStep], step: int, step_time_s: float) -> dict:
    """On rank 0: the corrections this run's traced step gives, stored for later plans, and the plan the corrected
    model chooses for the same ranks, as a metrics record ("replan")."""
    from dataclasses import replace

    from snugfit.calibrate.corrections import save_corrections
    from snugfit.hardware.load import other_load_now
    from snugfit.plan.corrections import (
        IMBALANCE, TimeCorrections, derive, machine_key, on_cluster, routing_imbalance, shape_key,
    )
    from snugfit.plan.estimate import estimate
    from snugfit.plan.explain import summary
    from snugfit.plan.search import NoPlanError, search
    from snugfit.train.autoplan import _profile, fixed_constraints, local_cluster
    from snugfit.config import optimizer_plan

    # the re-plan keeps the run's compile choice: its blocks compiled (or not) at start-up
    profile, cluster = _profile(cfg, 1, env.device, plan.compile), local_cluster(env)
    # the routing's imbalance so far (rank 0's metrics.jsonl), priced in the uncorrected view too: else its cost
    # would land in the compute factor as well
    imbalance = routing_imbalance(_routing_so_far(cfg), plan.ep)
    skewed = on_cluster(cluster, TimeCorrections({IMBALANCE: imbalance}))
    raw = estimate(replace(plan, predicted=None), profile, skewed)  # the uncorrected model's view of this plan
    # other work's share of the cores, sampled now, with the run's other ranks waiting for this one: what the
    # traced step shared the machine with, as near as one rank sees it
    corrections = derive(measured, raw.time_by_phase, plan.pp > 1, imbalance, machine=machine_key(cluster),
                         shape=shape_key(profile), step=step, measured_at=time.time(), other_load=other_load_now())
    stored = save_corrections(corrections)
    fixed = cluster if not corrections.factors else on_cluster(cluster, corrections)
    old = estimate(replace(plan, predicted=None), profile, fixed)
    record = {"kind": "replan", "step": step, "mode": cfg.train.replan, "corrections": corrections.factors,
              "measured_terms_s": corrections.measured, "predicted_terms_s": corrections.predicted,
              "measured_step_s": step_time_s, "uncorrected_step_s": raw.step_time_s,
              "corrected_terms_s": old.time_by_phase, "old_plan": plan.to_dict(), "old_predicted_s": old.step_time_s,
              "switched": False}
    try:
        new = search(profile, fixed, global_batch=cfg.train.batch_size, alternatives=0,
                     constraints=fixed_constraints(cfg, env.world_size), optimizer=optimizer_plan(cfg.train)).best
    except NoPlanError as e:
        record.update(new_plan=None, new_predicted_s=None, predicted_gain=0.0, why=str(e))
        return record
    gain = 1.0 - new.predicted.step_time_s / old.step_time_s if old.step_time_s else 0.0
    same = summary(new) == summary(plan)
    worth = not same and gain >= cfg.train.replan_gain
    record.update(new_plan=new.to_dict(), new_predicted_s=new.predicted.step_time_s, predicted_gain=gain,
                  same_plan=same, worth_switching=worth)
    if same:
        verdict = "the corrected model keeps this plan"
    else:
        verdict = (f"the corrected model prefers {summary(new)}: {new.predicted.step_time_s:.3g} s against "
                   f"{old.step_time_s:.3g} s ({gain:.0%} faster{'' if worth else ', under replan_gain'})")
    record["switched"] = worth and cfg.train.replan == "switch" and cfg.parallel.plan == "auto"  # not a given plan
    log.info("replan at step %d: measured %.3g s per step, the model said %.3g s; corrections %s (stored in %s); "
             "%s; %s", step, step_time_s, raw.step_time_s, corrections.describe(), stored, verdict,
             "switching to it from the next step" if record["switched"] else
             f"replan = {cfg.train.replan}, nothing switches")
    return record


class StepProbe(Handler):
    """How each step is taken (`train_step`): traced where drawn (`trace_step`) and at the calibration step
    (`replan_after` steps into the launch), profiled the step after it; and what follows each: the traced step's
    spans saved (and drawn), the corrections and the re-planned choice recorded, with `replan = "switch"` the plan
    to go on under (`switch_to`, acted on by PlanSwitch) and, GAIN_STEPS after a switch, the gain it measured."""

    def __init__(self):
        self.calib: int | None = None  # the calibration step of this launch
        self.calib_traces: list[StepTrace] = []
        self.replanning: threading.Thread | None = None  # rank 0's search with the corrected model (report)
        self.record: dict | None = None
        self.switch_to = None  # the plan to continue under from the next step, once decided (switch)
        self.step_s: dict[int, float] = {}  # this launch's step times, for the gain a switch measured
        self.switched_at: int | None = None
        self.record_gain = 0.0  # the switch's predicted gain

    def on_start(self, run: Run) -> None:
        t = run.cfg.train
        calibrate = t.replan != "off" and run.step + t.replan_after + 1 <= t.steps
        self.calib = run.step + t.replan_after if calibrate else None

    def train_step(self, run: Run, batch: torch.Tensor) -> StepResult:
        """run.engine.train_step(batch), traced or profiled where the next step is one of those."""
        done = run.step + 1
        profiled = self._profiled(done)
        if done in (run.cfg.train.trace_step, self.calib) or profiled:
            begin_trace(run.engine)
        slow_down(run.env.rank)
        if not profiled:
            return run.engine.train_step(batch)
        res, fsdp_share = profiled_step(run.engine, batch, run.env.rank)
        self._calibrate(run, done - 1, fsdp_share)
        return res

    def after_step(self, run: Run, done: StepDone) -> None:
        """A traced step's spans, gathered from every rank: drawn and saved (rank 0); a finished re-plan recorded;
        the gain a switch measured, GAIN_STEPS after it."""
        if not self._profiled(done.step):  # the profiler slows every operator: not a step a switch is measured by
            self.step_s[done.step] = done.seconds
        if self.replanning is not None and not self.replanning.is_alive():
            self._record_replan(run)
        if self.switched_at is not None and done.step == self.switched_at + GAIN_STEPS:
            self._measured_gain(run, done.step)
            self.switched_at = None
        engine = run.engine
        if engine.trace is None:
            return
        traces = gather(engine.trace, run.env.world_size)
        engine.trace = None
        if done.step == self.calib:
            self.calib_traces = traces
        if not run.env.is_main:
            return
        save_trace(run.out, done.step, traces, profiled=self._profiled(done.step))
        if done.step == run.cfg.train.trace_step:
            from snugfit.report.timeline import draw_timeline
            from snugfit.train.autoplan import predicted_timeline

            sim, detail, why = predicted_timeline(run.cfg, run.env, run.plan)
            picture = draw_timeline(sim, run.plan, run.out / "timeline.png", StepTrace.merge(traces), detail)
            run.say(f"timeline of step {done.step}: {picture} (predicted step {detail.step_s:.4g} s"
                    + (f"; {why})" if why else ", the plan's)"))

    def on_stop(self, run: Run, error: BaseException | None) -> None:
        if error is None:
            self._record_replan(run)

    def _profiled(self, step: int) -> bool:
        return self.calib is not None and step == self.calib + 1

    def _calibrate(self, run: Run, step: int, fsdp_share: float) -> None:
        """After the profiled step: every rank's share of FSDP2 in its work beside the traced step's spans; rank 0
        derives the corrections and re-plans (beside training for a report; for a switch every rank waits for it)."""
        from snugfit.report.measured import measured_step

        env = run.env
        fsdp = gather(fsdp_share, env.world_size)
        measured = []
        if env.is_main:
            save_trace(run.out, step, self.calib_traces, fsdp)
            merged = StepTrace.merge(self.calib_traces)
            measured = [measured_step(merged, r, fsdp[r]) for r in range(env.world_size)]
        step_s = sum(m.step for m in measured) / max(len(measured), 1)
        if run.cfg.train.replan == "switch":
            from snugfit.train.autoplan import decided_on_main

            record = decided_on_main(lambda: replan_record(run.cfg, env, run.plan, measured, step, step_s), env)
            run.metrics.write(record)
            if record["switched"]:
                self.switch_to = Plan.from_dict(record["new_plan"])
                self.record_gain = record["predicted_gain"]
            return
        if env.is_main:
            # the search runs beside training (its collectives would otherwise wait on it, up to parallel.timeout_s)
            self.replanning = threading.Thread(target=self._replan, args=(run, run.plan, measured, step, step_s),
                                               daemon=True)
            self.replanning.start()

    def _replan(self, run: Run, plan, measured: list[MeasuredStep], step: int, step_s: float) -> None:
        try:
            self.record = replan_record(run.cfg, run.env, plan, measured, step, step_s)
        except Exception as e:  # a report must never stop the run
            log.warning("replan at step %d failed: %s", step, e)

    def _record_replan(self, run: Run) -> None:
        """Wait for a re-plan still running and record it (rank 0)."""
        if self.replanning is not None:
            self.replanning.join()
            self.replanning = None
        if self.record is not None:
            run.metrics.write(self.record)
            self.record = None

    def switched(self, done: int) -> None:
        """The run now goes on under `switch_to` (from step done + 1)."""
        self.switch_to, self.switched_at = None, done

    def _measured_gain(self, run: Run, done: int) -> None:
        """Step time under the new plan against the old one's before the calibration (the launch's first step and
        the first two after the switch left out: warm-up), recorded beside the predicted gain."""
        before = [s for k, s in self.step_s.items() if min(self.step_s) < k < self.calib]
        after = [s for k, s in self.step_s.items() if k > self.switched_at + 2]
        if not before or not after:
            return
        old, new = statistics.median(before), statistics.median(after)
        gain = 1.0 - new / old
        run.metrics.write({"kind": "replan_outcome", "step": done, "switched_at": self.switched_at,
                           "measured_before_s": old, "measured_after_s": new, "measured_gain": gain,
                           "predicted_gain": self.record_gain})
        if run.env.is_main:
            run.say(f"after the switch at step {self.switched_at}: {new:.3g} s per step against {old:.3g} s "
                    f"before ({gain:.0%} faster measured, {self.record_gain:.0%} predicted)")


class PlanSwitch(Handler):
    """With `replan = "switch"`, once the probe has chosen another plan: checkpoint the step and go on under that
    plan in this launch, as --resume under it would (the same data order, optimizer state and learning-rate
    schedule). engine_for: the engine of a plan, its model built anew."""

    def __init__(self, probe: StepProbe, engine_for: Callable[[Plan], Engine]):
        self.probe, self.engine_for = probe, engine_for

    def after_step(self, run: Run, done: StepDone) -> None:
        plan = self.probe.switch_to
        if plan is None or done.step >= run.cfg.train.steps:
            return
        saved = run.save_checkpoint()
        run.engine = run.sampler = None  # the old plan's engine goes before the new one is built
        gc.collect()
        try:
            engine = self.engine_for(plan)
        except PlanError as e:
            raise SnugfitError(f"switching to the re-planned {plan.dp} x {plan.tp} x {plan.pp} plan: {e}") from None
        run.use(plan, engine)
        run.restore(saved)
        if run.env.is_main:
            (run.out / "plan.json").write_text(plan.to_json())
            log.info("switched at step %d (checkpoint %s) to plan dp=%d tp=%d pp=%d micro-batch %d x %d", run.step,
                     saved.name, plan.dp, plan.tp, plan.pp, plan.micro_batch_size, plan.num_microbatches)
        self.probe.switched(done.step)
