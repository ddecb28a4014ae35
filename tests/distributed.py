"""The multi-rank tests' helpers: the process runner (it lives in snugfit.runtime.spawn, which bench/ uses too),
and finding the processes of a `snugfit train` run, launchers and ranks, by its out dir via /proc."""

from __future__ import annotations

from pathlib import Path

from snugfit.runtime.spawn import free_port, run_ranks

__all__ = ["free_port", "rank_pid", "run_pids", "run_ranks"]


def _processes():
    """(pid, argv bytes, environment bytes) of every process this user can read."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            yield int(proc.name), (proc / "cmdline").read_bytes().split(b"\0"), (proc / "environ").read_bytes()
        except OSError:
            continue


def run_pids(out: Path) -> list[int]:
    """Every live process of the run writing to `out`: its launchers and their ranks all name it in argv."""
    return [pid for pid, cmd, _ in _processes() if str(out).encode() in cmd]  # a zombie's argv is empty


def rank_pid(out: Path, rank: int) -> int | None:
    """The worker process of this run with RANK=rank (torchrun sets it in the worker's environment)."""
    for pid, cmd, env in _processes():
        names = env.split(b"\0")
        if str(out).encode() in cmd and f"RANK={rank}".encode() in names and b"TORCHELASTIC_RUN_ID=" in env:
            return pid
    return None

