"""What a run records and says as it goes (a handler, train/run.py): the progress bar, a train record every
`log_every` steps with the measurements beside the plan's predictions, the end record and summary, and the loss
curve however the run ends."""

from __future__ import annotations

import logging
import statistics
from pathlib import Path

from snugfit.train.handlers import BadSteps
from snugfit.train.metrics import compare_line, measured_memory, plot_losses, predicted_fields, resident_record
from snugfit.train.run import Handler, Run, StepDone

log = logging.getLogger("snugfit")


class StepLog(Handler):
    """The run's metrics.jsonl records and printed lines (those of its other handlers aside). bad_steps: the
    handler counting skipped steps, whose totals each train record carries; at_start: this process's resident
    bytes before the model was built (the end record's baseline)."""

    def __init__(self, bad_steps: BadSteps, at_start: int):
        self.bad_steps, self.at_start = bad_steps, at_start
        self.window: list[float] = []  # step seconds since the last train record
        self.profile_checked = False  # the first measured steps against the prediction from this machine's profile

    def before_step(self, run: Run) -> None:
        run.engine.track_memory = self._records(run, run.step + 1)  # count saved tensors only on the steps reported

    def after_step(self, run: Run, done: StepDone) -> None:
        self.window.append(done.seconds)
        if done.compile_s and run.env.is_main:
            guess = run.plan.predicted.compile_s if run.plan.predicted else 0.0
            predicted = f", ~{guess:.0f} s predicted" if guess else ""
            run.say(f"compiled the blocks in {done.compile_s:.1f} s (step {done.step}{predicted}; not counted in its "
                    "step time)")
        if run.bar is not None:
            run.bar.update(1)
            run.bar.set_postfix(loss=f"{done.result.loss:.3f}", refresh=False)
        if not self._records(run, done.step):
            return
        step_time, self.window = statistics.median(self.window), []
        r = done.result
        record = {
            "kind": "train", "step": done.step, "loss": r.loss, "lr": done.lr, "grad_norm": r.grad_norm,
            "skipped": r.skipped, "skipped_total": self.bad_steps.skipped, "overflow_total": self.bad_steps.overflows,
            "step_time_s": step_time,
            # tokens, not padding: a packed run's is what its examples hold (train.build.RunData.real_share)
            "tokens_per_s": run.plan.tokens_per_step * run.data.real_share / step_time,
            **measured_memory(run.engine, step_time),
            **({"aux_loss": r.aux_loss} if r.aux_loss is not None else {}),
            **({"tokens_per_expert": r.tokens_per_expert} if r.tokens_per_expert is not None else {}),
        }
        record.update(predicted_fields(run.plan))
        run.metrics.write(record)
        if run.env.is_main:
            run.say(compare_line(record))
            if not self.profile_checked and done.step >= 3 and run.env.device.type == "cpu" and run.plan.predicted:
                self.profile_checked = True
                check_profile(step_time, run.plan.predicted.step_time_s, run.say)

    def on_stop(self, run: Run, error: BaseException | None) -> None:
        if run.bar is not None:
            run.bar.close()
        end = resident_record(run.step, self.at_start) if error is None else None  # a collective: a finished run's
        if end is not None:
            run.metrics.write(end)
        run.metrics.close()
        if not run.env.is_main:
            return
        plot = self._loss_curve(run, error)
        if end is not None:
            _summary(run, end, plot)
        elif plot is not None:
            log.info("loss curve: %s", plot)

    @staticmethod
    def _records(run: Run, step: int) -> bool:
        t = run.cfg.train
        return step % t.log_every == 0 or step == t.steps

    @staticmethod
    def _loss_curve(run: Run, error: BaseException | None) -> Path | None:
        """loss.png from metrics.jsonl, however the run ended; a stopped or failed run's own error stays the one
        reported (a full disk, say, that the picture cannot be written to either)."""
        metrics = run.out / "metrics.jsonl"
        if not (run.cfg.train.plot and metrics.exists()):
            return None
        try:
            return plot_losses(metrics, run.out / "loss.png")
        except OSError as e:
            if error is None:
                raise
            log.warning("the loss curve was not drawn: %s", e)
            return None


def _summary(run: Run, end: dict, plot: Path | None) -> None:
    result = run.result
    first, last = result.val_losses.get(0), result.val_losses.get(result.last_step)
    if first is not None and last is not None:
        log.info("validation loss %.4f -> %.4f (%.0f%% lower)", first, last, 100 * (1 - last / first))
    log.info("peak resident memory per process (MiB): %s",
             " ".join(f"{b / 2**20:.0f}" for b in end["peak_resident_bytes"]))
    log.info("metrics: %s", run.out / "metrics.jsonl")
    if plot:
        log.info("loss curve: %s", plot)
    log.info("checkpoint: %s", run.checkpoints.latest())


def check_profile(measured_s: float, predicted_s: float, say) -> None:
    """When the first measured steps are far from what this machine's cached profile predicts, set the profile
    aside (`hardware.json.stale`), so the next run measures the machine again: it may have been taken while
    another job ran, or on other hardware. Once set aside and measured again, a mismatch is the time model's, and
    the new profile stays. say: where the warning goes."""
    from snugfit.hardware.catalogue import hardware_cache_path

    ratio = measured_s / predicted_s
    if 1 / 1.5 <= ratio <= 1.5:
        return
    path = hardware_cache_path()
    stale = path.with_name(path.name + ".stale")
    said = f"warning: steps take {ratio:.2f}x the {predicted_s:.3g} s predicted"
    if path.exists() and not stale.exists():
        path.replace(stale)
        say(f"{said}; this machine's profile may have been taken while it was busy: it is set aside ({stale}) "
            "and the next run measures the machine again (or `snugfit profile-hardware` now)")
    else:
        say(f"{said}, with a profile measured again after an earlier mismatch: the time model is off for this "
            f"plan, not the profile ({path} stays; delete {stale.name} to have the next mismatch set it aside)")
