"""Start N ranks of `python -m snugfit train ...` through torchrun's elastic launcher.

`snugfit train --nproc N` calls `launch` in the parent process; the ranks it
starts see torchrun's environment (`inside_launch()` is then true) and train.
Going through torch.distributed.run rather than spawning processes by hand
gives what PyTorch users expect from torchrun: rendezvous across nodes,
restarts of failed workers, and per-rank error reports.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.run import parse_args, run

from snugfit.errors import SnugfitError
from snugfit.runtime.dist import ROUND_ENV

log = logging.getLogger(__name__)
PLAN_ENV = "SNUGFIT_LAUNCH_PLAN"  # the plan file the launcher searched (--plan auto), for the ranks it starts
PLAN_KEY = "snugfit/launch_plan"  # the same plan, in the rendezvous store, for the other nodes' launchers
PLAN_READ_KEY = "snugfit/launch_plan_read"  # how many other launchers read it
ERROR_MARK = "error: "
PLAN_WAIT_S = 600  # how long a launcher waits for node 0's plan (node 0 may first measure its machine)
ERROR_HOLD_S = 10  # how long node 0 keeps the store up after a plan error, for the other launchers to read it


def inside_launch() -> bool:
    """True in a rank started by torchrun (or by `launch`): do not launch again."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ


def die_with_launcher() -> None:
    """In a launched rank: be killed when the launcher that started it dies. torchrun starts each rank in
    its own session, so a launcher killed outright (kill -9, the OOM killer) would leave its ranks training
    unsupervised, and the other nodes' ranks waiting on them for as long as they live."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1  # <linux/prctl.h>
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the launcher died before the line above
        os.kill(os.getpid(), signal.SIGKILL)


def handed_plan() -> str | None:
    """In a rank: the path of the plan its launcher searched for it (`--plan auto`), or None."""
    return os.environ.get(PLAN_ENV) or None


@dataclass
class PlanHandoff:
    """How a launcher comes by the plan its ranks run under `--plan auto`: `search` finds it, as JSON, or raises
    SnugfitError (on node 0, or on every node where none names its rank); without it, node 0's plan comes through
    the rendezvous store. The ranks read it from a file in `folder` (launch() makes and removes it)."""

    search: Callable[[], str] | None = None
    nodes: int = 1
    folder: str = ""

    def hand_to_ranks(self, plan_json: str) -> None:
        """Write the plan where this launcher's ranks read it: they inherit its environment."""
        path = os.path.join(self.folder, "plan.json")
        with open(path, "w") as f:
            f.write(plan_json)
        os.environ[PLAN_ENV] = path

    def share(self, store) -> str:
        """The plan JSON every node runs: the first one published, perhaps this node's. A plan error is one line
        on every node: the searching node's own, and `node 0 could not plan the run: ...` on the others."""
        mine = None
        if self.search is not None:
            try:
                mine = self.search()
            except SnugfitError as e:
                mine = ERROR_MARK + str(e)
            shared = store.compare_set(PLAN_KEY, "", mine).decode()
        else:
            try:
                store.wait([PLAN_KEY], timedelta(seconds=PLAN_WAIT_S))
            except RuntimeError:  # DistStoreError: it timed out, or the store's node went
                raise SnugfitError(f"no plan from node 0's launcher in {PLAN_WAIT_S} s: start it with the same "
                                   "options, or give every node --plan FILE (from `snugfit plan --json`)") from None
            shared = store.get(PLAN_KEY).decode()
        if not shared.startswith(ERROR_MARK):
            return shared
        error = shared.removeprefix(ERROR_MARK)
        if shared != mine:
            store.add(PLAN_READ_KEY, 1)
            raise SnugfitError(f"node 0 could not plan the run: {error}")
        deadline = time.monotonic() + ERROR_HOLD_S  # this launcher may hold the store: let the others read it
        while store.add(PLAN_READ_KEY, 0) < self.nodes - 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        raise SnugfitError(error)


_handoff: PlanHandoff | None = None  # this launcher's, for the rendezvous handler torchrun constructs


BACKEND = "snugfit-c10d"  # torchrun's --rdzv-backend for RoundNamingRendezvous


class RoundNamingRendezvous(RendezvousHandler):
    """torchrun's c10d rendezvous, which also numbers its rounds for the ranks it starts ($SNUGFIT_RDZV_ROUND:
    1, 2, ... over the rendezvous store's life).

    The ranks use it as the launch attempt (runtime/dist.launch_attempt): to keep each round's process-group
    keys apart in the job's store, which outlives the round, and to resume after a restart.
    TORCHELASTIC_RESTART_COUNT cannot do it across nodes: a node restarting because another's rank failed
    (a membership change) does not count a restart, so its ranks would read the dead round's addresses and
    start from step 0 while the others resume.
    """

    def __init__(self, params: RendezvousParameters):
        backend, self.store = create_backend(params)
        self.inner = create_handler(self.store, backend, params)
        if _handoff is not None:  # --plan auto: every node's ranks run node 0's plan
            _handoff.hand_to_ranks(_handoff.share(self.store))

    def next_rendezvous(self) -> RendezvousInfo:
        info = self.inner.next_rendezvous()
        if info.rank == 0:  # one node per round counts it; info.store's keys are this round's own
            info.store.set("snugfit/round", str(self.store.add("snugfit/rounds", 1)))
        os.environ[ROUND_ENV] = info.store.get("snugfit/round").decode()  # the ranks inherit the launcher's
        return info

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return self.inner.use_agent_store

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self) -> None:
        self.inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self.inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        return self.inner.shutdown()


rendezvous_handler_registry.register(BACKEND, RoundNamingRendezvous)


def torchrun_args(
    argv: list[str],
    nproc: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
) -> list[str]:
    """torchrun's command line for `python -m snugfit <argv>` on `nproc` ranks per node."""
    if nproc < 1 or nnodes < 1:
        raise SnugfitError(f"--nproc ({nproc}) and --nnodes ({nnodes}) must be >= 1")
    if nnodes > 1 and not rdzv_endpoint:
        raise SnugfitError("a multi-node launch needs --rdzv-endpoint HOST:PORT (the same on every node)")
    args = [f"--nproc-per-node={nproc}", f"--nnodes={nnodes}", f"--max-restarts={max_restarts}"]
    if rdzv_endpoint:
        args += [f"--node-rank={node_rank}", f"--rdzv-backend={BACKEND}", f"--rdzv-endpoint={rdzv_endpoint}"]
    else:
        args.append("--standalone")  # one node: torchrun picks a free local port
    return [*args, "-m", "snugfit", *argv]


# torchrun's own lines that repeat what snugfit says (a rank's `error:` line, launch()'s summary, a stop on a
# signal) or a default it accepts (one OpenMP thread per rank), at the level from which they still show. torch's
# elastic modules set each logger's own level (torch.distributed.elastic.utils.logging: LOGLEVEL, else WARNING),
# so the parent's does not reach them: each one that speaks is named
QUIET_LOGGERS = {"torch.distributed.run": logging.ERROR, "torch.distributed.elastic": logging.ERROR,
                 "torch.distributed.elastic.multiprocessing.api": logging.CRITICAL,
                 # "Received 15 death signal, shutting down workers": a signal the ranks save and stop on
                 "torch.distributed.elastic.agent.server.api": logging.ERROR}


def launch(
    argv: list[str],
    nproc: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
    plan: PlanHandoff | None = None,
) -> int:
    """Run `python -m snugfit <argv>` on nproc ranks (x nnodes); 0 when every rank succeeded, else the
    exit status of the first failed rank. The ranks see torchrun's environment, so a CLI that checks
    `inside_launch()` trains there instead of launching again.

    plan: the `--plan auto` plan's handoff. On one node it is searched here, before torchrun starts anything (a
    plan error raises, and no rank starts); across nodes, when the rendezvous store is up (PlanHandoff.share).
    """
    global _handoff
    if inside_launch():
        raise SnugfitError("already inside a torchrun launch; run `snugfit train` without --nproc here")
    args = torchrun_args(argv, nproc, nnodes, node_rank, rdzv_endpoint, max_restarts)
    levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    with tempfile.TemporaryDirectory(prefix="snugfit-launch-") as folder:
        try:
            if plan is not None:
                plan.folder, plan.nodes = folder, nnodes
                if nnodes == 1:
                    plan.hand_to_ranks(plan.search())
                else:
                    _handoff = plan
            log.info("launch: torchrun %s", " ".join(args))
            for name, level in QUIET_LOGGERS.items():
                logging.getLogger(name).setLevel(level)
            return _run_torchrun(args, rdzv_endpoint)
        finally:
            _handoff = None
            os.environ.pop(PLAN_ENV, None)
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)


def _run_torchrun(args: list[str], rdzv_endpoint: str | None) -> int:
    try:
        run(parse_args(args))
    except SignalException as e:  # torchrun passed the signal on to the ranks, which saved a checkpoint and said so
        return 128 + int(e.sigval)
    except RendezvousConnectionError:  # torchrun's traceback names a socket; say which node went
        raise SnugfitError(f"lost the rendezvous at {rdzv_endpoint}: the node whose launcher holds it is gone; "
                           "restart every node's launcher, with --resume if the run has written a checkpoint"
                           ) from None
    except ChildFailedError as e:
        by_status: dict[int, list[int]] = {}
        for rank, failure in sorted(e.failures.items()):
            by_status.setdefault(failure.exitcode, []).append(rank)
        said = "; ".join(f"{_status(code)} on {_ranks(ranks)}" for code, ranks in sorted(by_status.items(),
                                                                                     key=lambda cr: cr[0] < 0))
        log.error("launch failed: %s", said)
        first = min(e.failures.values(), key=lambda f: (f.timestamp, f.exitcode == -signal.SIGTERM))
        return first.exitcode or 1
    return 0


def _status(code: int) -> str:
    """'exit 2', or 'SIGTERM' for a rank a signal ended (torchrun stops the others when one fails)."""
    try:
        return f"exit {code}" if code >= 0 else signal.Signals(-code).name
    except ValueError:
        return f"exit {code}"


def _ranks(ranks: list[int]) -> str:
    """'rank 3', 'ranks 0-3', 'ranks 0, 2-3' for sorted rank numbers."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"
