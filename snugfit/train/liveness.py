"""A rank that stops answering becomes one error that names it.

Every collective and transfer waits at most `parallel.timeout_s` (runtime/dist.py), so a stopped or lost
rank already turns into an exception on the others; but gloo's and NCCL's messages name a socket or an
operation, not the rank. Each rank therefore writes the last step it finished into the job's store (the store
the launcher of rank 0's node holds for the ranks, alive whatever the ranks do) after every step; when a step
fails for lack of an answer, the rank that is behind is the one that stopped.
"""

from __future__ import annotations

import torch.distributed as dist

from snugfit.errors import SnugfitError
from snugfit.train.run import Handler, Run, StepDone

FAILED_KEY = "snugfit/failed"  # in the job's store (per launch attempt): the rank that failed first
LOST_PEER = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "peer dead")


class Heartbeat(Handler):
    """The last step each rank finished, in the job's store (nothing to do for one process); as the run's handler,
    written after every step, and read when a collective or transfer gave up waiting, to name the rank that
    stopped."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        multi = dist.is_initialized() and world_size > 1
        self.store = dist.distributed_c10d._get_default_store() if multi else None  # torch has no public getter
        self.store_lost = False  # found gone (explain): asking it again only adds c10d's warnings

    def first_to_fail(self) -> bool:
        """Claim the run's failure for this rank: True for the first rank that fails, which says why; False for
        the ranks whose failure followed from it (a rank that left closes their connections), which exit quietly.
        True where no store can tell: one process, or the store went down with its node."""
        if self.store is None or self.store_lost:
            return True
        try:
            return self.store.compare_set(FAILED_KEY, "", str(self.rank)).decode() == str(self.rank)
        except RuntimeError:  # DistStoreError, a closed connection
            return True

    def beat(self, step: int) -> None:
        if self.store is not None:
            self.store.set(f"snugfit/done/{self.rank}", str(step))

    def after_step(self, run: Run, done: StepDone) -> None:
        self.beat(done.step)

    def on_stop(self, run: Run, error: BaseException | None) -> None:
        if isinstance(error, RuntimeError):  # gloo's and NCCL's errors, which name a socket, not the rank
            latest = run.checkpoints.latest()
            self.explain(error, run.step, run.cfg.parallel.timeout_s, latest.name if latest else None)

    def last_steps(self) -> dict[int, int]:
        """Each rank's last finished step; -1 for one that never finished any (store.check does not block)."""
        out = {}
        for r in range(self.world_size):
            key = f"snugfit/done/{r}"
            out[r] = int(self.store.get(key)) if self.store.check([key]) else -1
        return out

    def explain(self, err: BaseException, step: int, timeout_s: float, checkpoint: str | None) -> None:
        """Raise one line naming the rank that stopped answering when `err` is a lost peer; else return.
        checkpoint: the newest committed checkpoint's name, None when there is none yet."""
        if self.store is None or not any(s in str(err).lower() for s in LOST_PEER):
            return
        try:
            steps = self.last_steps()
        except RuntimeError:  # the store went down with the launcher that holds it: that node is gone
            self.store_lost = True
            again = (f"the last checkpoint is {checkpoint}: restart every node with --resume" if checkpoint else
                     "no checkpoint yet: restart every node from the beginning")
            raise SnugfitError(
                f"lost the job's store while this rank ran step {step + 1}: rank 0's node, whose launcher holds it, "
                f"is gone; {again}") from None
        behind = min((r for r in steps if r != self.rank), key=lambda r: (steps[r], r))
        timed_out = any(s in str(err).lower() for s in ("timed out", "timeout"))
        silence = f"nothing for {timeout_s:.0f} s" if timed_out else "its connection closed"
        again = (f"the last checkpoint is {checkpoint}: restart with --resume, or --max-restarts N to do so by itself"
                 if checkpoint else "no checkpoint yet: restart from the beginning, or with --max-restarts N to do "
                 "so by itself")
        when = f"after step {steps[behind]}" if steps[behind] >= 0 else "before finishing a step"
        raise SnugfitError(
            f"rank {behind} stopped answering {when} ({silence} while this rank ran step {step + 1}); {again}"
        ) from None
