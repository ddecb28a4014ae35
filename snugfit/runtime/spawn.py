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
"""

from __future__ import annotations

import os
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

# Imported once by the fork server, before any rank forks from it: torch, FSDP2, pipelining, dynamo
PRELOAD = ["snugfit.runtime.build"]


def free_port() -> int:
    """A TCP port free on this machine now, for a local rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn, args, queue, environ: dict) -> None:
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


def run_ranks(fn, world_size: int, *args) -> list:
    """fn must be importable (module level) and return picklable values."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the fork server starts: this process's first call
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, dict(os.environ)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    for _ in procs:
        rank, ok, value = queue.get()
        (results.__setitem__(rank, value) if ok else errors.append(f"rank {rank}:\n{value}"))
    for p in procs:
        p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
