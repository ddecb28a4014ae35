"""The run's small handlers: its bad steps, its evaluations and its checkpoints (train/run.py: the moments)."""

from __future__ import annotations

import time

from snugfit.errors import SnugfitError
from snugfit.train.run import Handler, Run, StepDone

SETTLE_S = 60.0  # how long a failing run waits for its background checkpoint write to commit


class BadSteps(Handler):
    """Skipped steps (a loss or gradient not finite, or a float16 overflow) counted for the log; after `limit`
    non-finite ones in a row the run stops with its last good state saved. Overflows are the loss scale finding its
    level, not a run going bad: they never count towards the limit."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_a_row, self.skipped, self.overflows = 0, 0, 0

    def after_step(self, run: Run, done: StepDone) -> None:
        r = done.result
        self.in_a_row = self.in_a_row + 1 if r.skipped and not r.overflow else 0
        self.skipped += r.skipped
        self.overflows += r.overflow
        if self.in_a_row >= self.limit:
            saved = run.save_checkpoint()  # skipped steps left weights and optimizer untouched: the last good state
            raise SnugfitError(
                f"loss or gradients were not finite for {self.in_a_row} steps in a row (up to step {done.step}); "
                f"the last good state is saved in {saved}; lower train.lr or check the data, then --resume"
            )


class Evaluation(Handler):
    """The validation loss before a fresh run's first step, every `eval_every` steps and after the last."""

    def on_start(self, run: Run) -> None:
        if run.step == 0:
            self._evaluate(run)

    def after_step(self, run: Run, done: StepDone) -> None:
        t = run.cfg.train
        if (t.eval_every and done.step % t.eval_every == 0) or done.step == t.steps:
            self._evaluate(run)

    def _evaluate(self, run: Run) -> None:
        if not run.val:
            return
        loss = sum(run.engine.eval_loss(b) for b in run.val) / len(run.val)
        run.result.val_losses[run.step] = loss
        run.metrics.write({"kind": "eval", "step": run.step, "val_loss": loss})
        if run.env.is_main:
            run.say(f"step {run.step}: validation loss {loss:.4f}")


class Checkpointing(Handler):
    """A checkpoint every `checkpoint_every` steps, written behind the next steps with `async_checkpoint`, and one
    after the last step, complete when the run returns. A run that fails gives the save in flight time to commit."""

    def after_step(self, run: Run, done: StepDone) -> None:
        t = run.cfg.train
        if not ((t.checkpoint_every and done.step % t.checkpoint_every == 0) or done.step == t.steps):
            return
        in_background = t.async_checkpoint and done.step < t.steps
        t0 = time.perf_counter()
        run.save_checkpoint(in_background)
        run.metrics.write({"kind": "checkpoint", "step": done.step, "async": in_background,
                           "blocked_s": time.perf_counter() - t0})

    def on_stop(self, run: Run, error: BaseException | None) -> None:
        if error is not None:
            run.checkpoints.settle(min(SETTLE_S, run.cfg.parallel.timeout_s))  # it still commits if it can
