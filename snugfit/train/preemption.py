"""Stop cleanly when asked: SIGTERM (a scheduler preempting the machine), SIGINT (Ctrl-C), SIGUSR1 (SLURM's
warning before the end of a job, `--signal=USR1@120`).

The signal handlers only record the signal. Between steps the ranks agree on it (one all-reduce of a single integer
on a gloo group, so a signal that reached one rank stops them all at the same step); the run's handler for it
(`StopRequests.after_step`) then writes one checkpoint of that step and stops the run with a one-line message. A
second signal while that happens is noted and ignored: the checkpoint is still written under a temporary name and
committed by rename, so nothing half-written ever looks like a checkpoint.
"""

from __future__ import annotations

import logging
import signal
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from snugfit.errors import Stopped
from snugfit.runtime.dist import cached_group
from snugfit.train.run import Handler, Run, StepDone

log = logging.getLogger("snugfit")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopRequests(Handler):
    """Records the first stop signal this process gets, from the moment it is made until `close()`; as the run's
    handler, stops the run after the step the ranks agree on, that step checkpointed."""

    def __init__(self, enabled: bool = True, timeout_s: float = 300.0):
        self.received, self.timeout = 0, timedelta(seconds=timeout_s)
        self._previous = {}
        if enabled and threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}

    def _handle(self, signum: int, _frame) -> None:
        if self.received:
            log.warning("%s again: already stopping after this step; the checkpoint is being written",
                        signal.Signals(signum).name)
            return
        self.received = signum

    def agreed(self) -> int:
        """The signal any rank received (the largest number when several did), 0 for none. A collective: every
        rank calls it after every step."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.received
        vote = torch.tensor([self.received], dtype=torch.int32)
        group = cached_group(("stop-vote",), lambda: dist.new_group(backend="gloo", timeout=self.timeout))
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=group)  # host tensors: gloo beside NCCL
        return int(vote.item())

    def after_step(self, run: Run, done: StepDone) -> None:
        stop = self.agreed()
        if stop and done.step < run.cfg.train.steps:
            saved = run.save_checkpoint()
            raise Stopped(f"stopped by {signal.Signals(stop).name} at step {done.step}; checkpoint {saved.name}; "
                          "resume with --resume", stop)

    def close(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
