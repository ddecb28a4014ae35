"""Elastic restarts: kill -9 one rank mid-run; torchrun restarts the job, which resumes from its last
checkpoint and ends with weights bit-identical to an uninterrupted run (CPU, fixed seeds)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from snugfit.train.export import load_checkpoint_model
from tests.distributed import rank_pid

ARGS = ["--dim", "32", "--n-layers", "2", "--n-heads", "4", "--seq-len", "16", "--max-seq-len", "16",
        "--batch-size", "4", "--steps", "48", "--warmup-steps", "2", "--eval-every", "0", "--log-every", "4",
        "--checkpoint-every", "8", "--keep-checkpoints", "8", "--progress", "false", "--plot", "false",
        "--nproc", "2", "--max-restarts", "1", "--timeout-s", "30", "--plan", "dp"]


def launch(out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "snugfit", "train", *ARGS, "--out-dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint_model(out / "checkpoints" / "step_00000048").state_dict()


def test_kill_one_rank_restarts_and_matches_uninterrupted(tmp_path):
    reference = launch(tmp_path / "ref")
    victim = launch(tmp_path / "killed")
    first = tmp_path / "killed" / "checkpoints" / "step_00000008"
    deadline = time.time() + 240
    while not first.exists() and time.time() < deadline and victim.poll() is None:
        time.sleep(0.05)
    assert first.exists(), "the run never reached its first checkpoint"
    pid = rank_pid(tmp_path / "killed", 1)
    assert pid is not None, "rank 1 not found"
    os.kill(pid, signal.SIGKILL)
    out_victim, _ = victim.communicate(timeout=300)
    out_ref, _ = reference.communicate(timeout=300)
    assert reference.returncode == 0, out_ref
    assert victim.returncode == 0, out_victim
    assert "resuming at step" in out_victim, out_victim  # the restarted ranks resumed, not restarted from 0
    want, got = final_weights(tmp_path / "ref"), final_weights(tmp_path / "killed")
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
