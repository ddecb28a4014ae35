"""Preemption: SIGTERM to `snugfit train --nproc 2` stops both ranks after the same step, checkpoints that step,
exits 143 with one line saying where, and `--resume` continues bit-identically to a run never stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from snugfit.train.metrics import read_metrics
from snugfit.train.preemption import StopRequests

ARGS = ["--nproc", "2", "--dim", "64", "--n-layers", "2", "--n-heads", "4", "--eval-every", "0", "--log-every", "1",
        "--checkpoint-every", "1000", "--progress", "false", "--plot", "false"]


def _train(out, *args, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen([sys.executable, "-m", "snugfit", "train", *ARGS, "--out-dir", str(out), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kw)


def _losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"}


def test_sigterm_checkpoints_the_step_and_resume_is_bit_identical(tmp_path):
    run = _train(tmp_path / "stopped", "--steps", "400")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and run.poll() is None and not (
            (tmp_path / "stopped" / "metrics.jsonl").exists() and len(_losses(tmp_path / "stopped")) >= 3):
        time.sleep(0.2)
    assert run.poll() is None and len(_losses(tmp_path / "stopped")) >= 3, "the run never logged step 3"
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=240)
    assert run.returncode == 128 + signal.SIGTERM, err[-2000:]
    stopped_at = max(_losses(tmp_path / "stopped"))
    assert 3 <= stopped_at < 400
    assert f"stopped by SIGTERM at step {stopped_at}; checkpoint step_{stopped_at:08d}; resume with --resume" in err
    assert "Traceback" not in err and "death signal" not in err  # torch's agent says nothing of it
    assert [p.name for p in (tmp_path / "stopped" / "checkpoints").iterdir()] == [f"step_{stopped_at:08d}"]

    end = stopped_at + 3
    resumed = _train(tmp_path / "stopped", "--steps", str(end), "--resume")
    reference = _train(tmp_path / "reference", "--steps", str(end))
    for proc in (resumed, reference):
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-2000:]
    after = {s: v for s, v in _losses(tmp_path / "stopped").items() if s > stopped_at}
    assert after == {s: v for s, v in _losses(tmp_path / "reference").items() if s > stopped_at}  # bit-identical
    assert sorted(after) == list(range(stopped_at + 1, end + 1))


def test_a_second_signal_while_stopping_changes_nothing():
    stops = StopRequests()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # during the save: noted, not acted on
        assert stops.agreed() == signal.SIGUSR1
    finally:
        stops.close()
    assert signal.getsignal(signal.SIGTERM) != stops._handle  # handlers restored


def test_a_rank_that_stops_answering_is_named_and_nothing_is_left_behind(tmp_path):
    """SIGSTOP one rank: the other fails within timeout_s naming it and the step; torchrun removes the stopped one."""
    from tests.test_elastic import rank_pid

    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"}
    out = tmp_path / "hang"
    run = subprocess.Popen([sys.executable, "-m", "snugfit", "train", *ARGS, "--steps", "2000", "--timeout-s", "8",
                            "--checkpoint-every", "5", "--out-dir", str(out)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 240
    committed = out / "checkpoints" / "step_00000005"  # async: it may commit a step or more after step 5
    while time.monotonic() < deadline and run.poll() is None and not (
            (out / "metrics.jsonl").exists() and len(_losses(out)) >= 6 and committed.is_dir()):
        time.sleep(0.2)
    victim = rank_pid(out, 1)
    assert victim is not None
    os.kill(victim, signal.SIGSTOP)
    try:
        _, err = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode != 0
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "rank 1 stopped answering after step" in lines[0], err[-2000:]
    assert "the last checkpoint is step_000000" in lines[0], lines[0]
    deadline = time.monotonic() + 120
    while os.path.exists(f"/proc/{victim}") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(f"/proc/{victim}")  # the stopped rank is gone too


def test_a_lost_rank_names_the_checkpoint_to_resume_or_says_there_is_none():
    """Heartbeat.explain's one line says what is true: --resume with the last checkpoint, or, with none yet, to
    restart from the beginning (the line once told the user to resume from a checkpoint that did not exist)."""
    import pytest
    import torch.distributed as dist

    from snugfit.errors import SnugfitError
    from snugfit.train.liveness import Heartbeat

    lost = RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234")
    for checkpoint, said in ((None, "no checkpoint yet: restart from the beginning, or with --max-restarts N"),
                             ("step_00000005", "the last checkpoint is step_00000005: restart with --resume")):
        beat = Heartbeat(0, 3)
        beat.store = dist.HashStore()
        beat.beat(7)
        beat.rank = 2
        beat.beat(6)
        beat.rank = 0  # rank 1 never finished a step
        with pytest.raises(SnugfitError) as err:
            beat.explain(lost, 7, 8.0, checkpoint)
        assert str(err.value).startswith("rank 1 stopped answering before finishing a step (its connection closed "
                                         "while this rank ran step 8)")
        assert said in str(err.value) and "none" not in str(err.value)
    beat.explain(ValueError("shapes differ"), 7, 8.0, None)  # not a lost peer: nothing to say


def test_a_signal_stops_after_the_step_with_its_checkpoint_and_the_loss_curve(tmp_path, monkeypatch, caplog):
    """One process, in this one: SIGTERM arrives while step 3's batch is drawn; the run finishes that step, saves
    it, draws loss.png as a finished run would, writes no end record, and stops with 128 + SIGTERM."""
    import logging

    import pytest

    from snugfit.data.dataset import BatchSampler
    from snugfit.errors import Stopped
    from snugfit.train.loop import train
    from tests.test_train import tiny

    real_next, calls = BatchSampler.next_batch, {"n": 0}

    def signal_at_step_3(self):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_next(self)

    monkeypatch.setattr(BatchSampler, "next_batch", signal_at_step_3)
    handler_before = signal.getsignal(signal.SIGTERM)
    with caplog.at_level(logging.INFO, logger="snugfit"), pytest.raises(Stopped) as stopped:
        train(tiny(tmp_path, steps=10, log_every=1, plot=True))
    assert stopped.value.exit_status == 128 + signal.SIGTERM
    assert str(stopped.value).startswith("stopped by SIGTERM at step 3; checkpoint step_00000003")
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000003"]
    assert sorted(_losses(tmp_path)) == [1, 2, 3]
    assert "end" not in {r["kind"] for r in read_metrics(tmp_path / "metrics.jsonl")}
    assert (tmp_path / "loss.png").stat().st_size > 0 and f"loss curve: {tmp_path / 'loss.png'}" in caplog.text
    assert signal.getsignal(signal.SIGTERM) == handler_before  # the run's signal handlers are gone with it
