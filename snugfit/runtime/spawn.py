"""run_ranks: run a function in N local gloo processes and collect what each rank returns.

`run_ranks(fn, 4, args...)` calls `fn(env, *args)` on ranks 0..3 (env:
snugfit.runtime.dist.DistEnv, process group joined) and returns the list of
return values in rank order. An exception on any rank fails the call with that
rank's traceback. The multi-rank tests and the bench/ scripts use it; it lives
in the package so that a bench script runs without the tests on its path.

The ranks are forked from multiprocessing's fork server, which imported torch
and the engine's modules once and does nothing else (no CUDA context, no process
group, no operator run): a spawned rank spent seconds of CPU importing them, so a
4-rank call cost ~16 s on two loaded cores, a forked one ~0.3 s. Each rank takes
its caller's environment (the fork server keeps the one it started with).

A call never waits forever: a rank that exits without reporting (killed, crashed
in C) fails it at once, and one past `timeout_s` fails it with every silent rank's
Python stacks (faulthandler, asked by SIGUSR1), so a hang reads as a traceback
rather than as a CI job that runs out of time.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

# Imported once by the fork server, before any rank forks from it: torch, FSDP2, pipelining, dynamo
PRELOAD = ["snugfit.runtime.build"]


def forkserver():
    """multiprocessing's fork server with this module's preload: every local child process snugfit starts forks
    from it, never from its caller, whose threads (autograd's, a host-offload worker's, an accelerator's) a fork
    copies mid-lock (a forked child deadlocked in a futex in the test suite; autograd refuses after a GPU ran)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the fork server starts: this process's first call
    return ctx


def free_port() -> int:
    """A TCP port free on this machine now, for a local rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn, args, queue, environ: dict, stacks: str) -> None:
    stacks_file = open(stacks, "w")  # noqa: SIM115 - open for faulthandler for the life of the rank
    faulthandler.register(signal.SIGUSR1, file=stacks_file, all_threads=True)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    import torch

    from snugfit.runtime.dist import init_distributed

    # N ranks share the machine's few cores: default thread pools per rank oversubscribe them ~10x.
    torch.set_num_threads(1)

    try:
        env = init_distributed(timeout_s=120)
        queue.put((rank, True, fn(env, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout_s: float = 300) -> list:
    """fn must be importable (module level) and return picklable values."""
    ctx = forkserver()
    queue = ctx.SimpleQueue()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="snugfit-ranks-") as stacks:
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, dict(os.environ),
                                                   f"{stacks}/{r}"))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            results, errors = _collect(queue, procs, timeout_s, Path(stacks))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def _collect(queue, procs: list, timeout_s: float, stacks: Path) -> tuple[dict, list]:
    """Every rank's report; a rank gone silent (exited, or past the deadline) ends the wait with an error."""
    deadline = time.monotonic() + timeout_s
    results: dict[int, object] = {}
    errors: list[str] = []
    reported: set[int] = set()
    while len(reported) < len(procs):
        if not queue.empty():  # a rank's put is whole before it exits: checked before its exit code
            rank, ok, value = queue.get()
            reported.add(rank)
            (results.__setitem__(rank, value) if ok else errors.append(f"rank {rank}:\n{value}"))
            continue
        silent = [r for r in range(len(procs)) if r not in reported]
        dead = [r for r in silent if procs[r].exitcode is not None]
        if dead and queue.empty():
            return results, errors + [f"rank {r} exited with code {procs[r].exitcode} before reporting"
                                      for r in dead]
        if time.monotonic() > deadline:
            for r in silent:
                os.kill(procs[r].pid, signal.SIGUSR1)
            time.sleep(1)  # faulthandler writes from the signal handler
            return results, errors + [f"rank {r} still running after {timeout_s:.0f} s; its stacks:\n"
                                      f"{(stacks / str(r)).read_text()}" for r in silent]
        time.sleep(0.01)
    return results, errors
