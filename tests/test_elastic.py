"""Elastic restarts: kill -9 one rank mid-run, or while a background save is being written; torchrun restarts
the job, which resumes from its last committed checkpoint and ends with weights bit-identical to an
uninterrupted run (CPU, fixed seeds)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from snugfit.train.export import load_checkpoint_model
from tests.distributed import REFERENCE_RUN, REFERENCE_STEPS, rank_pid

ARGS = [*REFERENCE_RUN, "--log-every", "4", "--nproc", "2", "--max-restarts", "1"]


# Imported by every process of a run whose PYTHONPATH starts with its folder: in the first attempt, each rank's
# write of step 16 blocks, so that save is still in flight when the test kills a rank.
SLOW_WRITE = """
import os, time
from torch.distributed.checkpoint.filesystem import _FileSystemWriter
_write = _FileSystemWriter.write_data
def write_data(self, plan, planner):
    if "step_00000016" in str(self.path) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        open(os.path.join(os.path.dirname(__file__), "writing_rank" + os.environ["RANK"]), "w").close()
        time.sleep(600)
    return _write(self, plan, planner)
_FileSystemWriter.write_data = write_data
"""


def launch(out: Path, pythonpath: Path | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, "-m", "snugfit", "train", *ARGS, "--out-dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


@pytest.fixture(scope="module")
def reference(reference_run) -> dict[str, torch.Tensor]:
    """The uninterrupted run's final weights (conftest.reference_run: the same training, trained once)."""
    return final_weights(reference_run())


def wait_for(path: Path, run: subprocess.Popen) -> None:
    deadline = time.monotonic() + 240
    while not path.exists() and time.monotonic() < deadline and run.poll() is None:
        time.sleep(0.05)
    assert path.exists(), f"the run never reached {path.name}"


def kill_rank_and_finish(out: Path, run: subprocess.Popen, reference: dict[str, torch.Tensor]) -> str:
    """SIGKILL rank 1; the restarted run must end with the reference's weights. Returns its output."""
    pid = rank_pid(out, 1)
    assert pid is not None, "rank 1 not found"
    os.kill(pid, signal.SIGKILL)
    log, _ = run.communicate(timeout=400)
    assert run.returncode == 0, log
    assert "resuming at step" in log, log  # the restarted ranks resumed, not restarted from 0
    got = final_weights(out)
    assert reference.keys() == got.keys()
    for name in reference:
        assert torch.equal(reference[name], got[name]), name
    return log


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint_model(out / "checkpoints" / f"step_{REFERENCE_STEPS:08d}").state_dict()


def test_kill_one_rank_restarts_and_matches_uninterrupted(tmp_path, reference):
    run = launch(tmp_path / "killed")
    wait_for(tmp_path / "killed" / "checkpoints" / "step_00000008", run)
    kill_rank_and_finish(tmp_path / "killed", run, reference)


def test_a_rank_killed_while_a_save_is_in_flight_resumes_from_the_previous_one(tmp_path, reference):
    """Step 16's background write never finishes: killing a rank then leaves step 8 the newest checkpoint, and the
    restarted run resumes there (nothing half-written is loaded) and ends as the uninterrupted run does."""
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "sitecustomize.py").write_text(SLOW_WRITE)
    out = tmp_path / "killed"
    run = launch(out, pythonpath=tmp_path / "slow")
    for rank in (0, 1):  # both ranks are inside the write
        wait_for(tmp_path / "slow" / f"writing_rank{rank}", run)
    log = kill_rank_and_finish(out, run, reference)
    assert "resuming at step 8" in log, log
