"""Asynchronous checkpoints: training goes on while a save is written; a crash while it is in flight commits it
if its write succeeds and otherwise leaves the previous checkpoint the newest, and resuming from it ends
bit-identically to an uninterrupted run."""

import threading

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _FileSystemWriter

from snugfit.data.dataset import BatchSampler
from snugfit.train.export import load_checkpoint_model
from snugfit.train.metrics import read_metrics
from snugfit.train.loop import train
from tests.test_train import tiny


def test_crash_while_a_save_is_in_flight_resumes_from_the_previous_one(tmp_path, monkeypatch):
    reference = tiny(tmp_path / "ref", steps=12, checkpoint_every=4)
    train(reference)

    crashed = threading.Event()  # the write of step 8 is still going when the run crashes, and then fails
    real_write, real_next = _FileSystemWriter.write_data, BatchSampler.next_batch
    batches = {"n": 0}

    def stuck_write(self, plan, planner):
        if "step_00000008" in str(self.path):
            crashed.wait()
            raise OSError("simulated: the disk went away mid-write")
        return real_write(self, plan, planner)

    def crash_at_step_10(self):
        batches["n"] += 1
        if batches["n"] == 10:  # steps 9 ran while step 8 was being written
            crashed.set()
            raise RuntimeError("simulated crash")
        return real_next(self)

    monkeypatch.setattr(_FileSystemWriter, "write_data", stuck_write)
    monkeypatch.setattr(BatchSampler, "next_batch", crash_at_step_10)
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(tiny(run, steps=12, checkpoint_every=4))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000004"]  # the failed write removed
    saves = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "checkpoint"]
    assert [(r["step"], r["async"]) for r in saves] == [(4, True), (8, True)]
    assert all(r["blocked_s"] >= 0 for r in saves)

    monkeypatch.undo()
    train(tiny(run, steps=12, checkpoint_every=4, resume=True))  # from step 4
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000008", "step_00000012"]
    want = load_checkpoint_model(tmp_path / "ref" / "checkpoints" / "step_00000012").state_dict()
    got = load_checkpoint_model(run / "checkpoints" / "step_00000012").state_dict()
    for name in want:
        assert torch.equal(want[name], got[name]), name


def _train_on_ranks(env, out, background):
    train(tiny(out, steps=6, checkpoint_every=3, async_checkpoint=background, eval_every=0))


def test_a_background_save_across_ranks_equals_a_blocking_one(tmp_path):
    """Two ranks write their shards in the background, on the checkpoint's own gloo group, while the next steps
    run; the committed checkpoint equals the one a blocking save writes."""
    from tests.distributed import run_ranks

    for name, background in (("async", True), ("sync", False)):
        run_ranks(_train_on_ranks, 2, tmp_path / name, background)
    saves = [r for r in read_metrics(tmp_path / "async" / "metrics.jsonl") if r["kind"] == "checkpoint"]
    assert [(r["step"], r["async"]) for r in saves] == [(3, True), (6, False)]
    for step in ("step_00000003", "step_00000006"):
        want = load_checkpoint_model(tmp_path / "sync" / "checkpoints" / step).state_dict()
        got = load_checkpoint_model(tmp_path / "async" / "checkpoints" / step).state_dict()
        for name in want:
            assert torch.equal(want[name], got[name]), (step, name)
