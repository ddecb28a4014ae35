"""The multi-rank tests' helpers: the process runner (it lives in snugfit.runtime.spawn, which bench/ uses too),
finding the processes of a `snugfit train` run, launchers and ranks, by its out dir via /proc, and checking the
gradients an engine's update sees against a one-process reference."""

from __future__ import annotations

from pathlib import Path

from snugfit.runtime.spawn import free_port, run_ranks

__all__ = ["REFERENCE_RUN", "REFERENCE_STEPS", "check_update_gradients", "free_port", "rank_pid", "run_pids",
           "run_ranks"]

# The training of the runs test_elastic kills and restarts and test_multinode splits over two launchers: each ends
# bit-identical to one uninterrupted `snugfit train --nproc 2` of it (conftest's reference_run, trained once)
REFERENCE_STEPS = 48
REFERENCE_RUN = ["--dim", "32", "--n-layers", "2", "--n-heads", "4", "--seq-len", "16", "--max-seq-len", "16",
                 "--batch-size", "4", "--steps", str(REFERENCE_STEPS), "--warmup-steps", "2", "--eval-every", "0",
                 "--checkpoint-every", "8", "--keep-checkpoints", "8", "--progress", "false", "--plot", "false",
                 "--timeout-s", "30", "--plan", "dp"]


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



def check_update_gradients(engine, reference: dict, checked: list, bad: list):
    """Wrap `engine._update` so that the gradients it sees (final: reduced, on host where offloaded) are compared
    with this rank's shard of the one-process `reference`; names go to `checked`, mismatches to `bad`. Returns
    the original update, to put back."""
    import torch

    from snugfit.model.shards import local_shard
    from snugfit.runtime.memory import local

    update = engine._update

    def check_grads(loss):
        pairs = [(n, p, p.grad) for n, p in engine.model.named_parameters() if p.grad is not None]
        if engine.host is not None:
            pairs += [(n, p, master.grad) for n, p, master, _ in engine.host.named_masters()]
        for n, p, g in pairs:
            checked.append(n)
            try:
                torch.testing.assert_close(local(g), local_shard(reference[n], p), rtol=1e-5, atol=1e-6)
            except AssertionError as err:
                bad.append(f"{n}: {err}")
        return update(loss)

    engine._update = check_grads
    return update
