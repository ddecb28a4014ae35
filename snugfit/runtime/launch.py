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


def launch(
    argv: list[str],
    nproc: int,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    max_restarts: int = 0,
) -> int:
    """Run `python -m snugfit <argv>` on nproc ranks (x nnodes); 0 when every rank succeeded, else the
    exit status of the first failed rank. The ranks see torchrun's environment, so a CLI that checks
    `inside_launch()` trains there instead of launching again.
    """
    if inside_launch():
        raise SnugfitError("already inside a torchrun launch; run `snugfit train` without --nproc here")
    args = torchrun_args(argv, nproc, nnodes, node_rank, rdzv_endpoint, max_restarts)
    log.info("launch: torchrun %s", " ".join(args))
    try:
        run(parse_args(args))
    except SignalException as e:  # torchrun passed the signal on to the ranks, which saved a checkpoint and said so
        return 128 + int(e.sigval)
    except RendezvousConnectionError:  # torchrun's traceback names a socket; say which node went
        raise SnugfitError(f"lost the rendezvous at {rdzv_endpoint}: the node whose launcher holds it is gone; "
                           "restart every node's launcher, with --resume to continue from the last checkpoint"
                           ) from None
    except ChildFailedError as e:
        log.error("launch failed: %s", "; ".join(f"rank {r}: exit {f.exitcode}" for r, f in sorted(e.failures.items())))
        return next(f.exitcode for _, f in sorted(e.failures.items())) or 1
    return 0
