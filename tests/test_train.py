"""The single-process trainer: loss falls, resume is bit-exact, bad input is one clear line."""

import json
import os
import subprocess
import sys

import pytest

from snugfit.config import build_config
from snugfit.data.dataset import BatchSampler
from snugfit.plan import Plan
from snugfit.train.loop import train

TINY = {"dim": 64, "n_layers": 2, "n_heads": 4, "seq_len": 32, "max_seq_len": 32, "batch_size": 4,
        "steps": 12, "warmup_steps": 2, "eval_every": 6, "eval_batches": 2, "log_every": 3,
        "checkpoint_every": 6, "progress": False, "plot": False}


def tiny(out, **kw):
    return build_config(None, {**TINY, "out_dir": str(out), **kw})


def test_loss_falls_and_outputs_are_written(tmp_path):
    result = train(tiny(tmp_path, steps=30, lr=0.01, plot=True, micro_batch_size=2))
    assert result.val_losses[30] < 0.8 * result.val_losses[0]
    for name in ("metrics.jsonl", "loss.png", "plan.json", "config.json"):
        assert (tmp_path / name).stat().st_size > 0
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000024", "step_00000030"]


def test_tensorboard_gets_what_metrics_jsonl_gets(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from snugfit.train.metrics import read_metrics

    train(tiny(tmp_path, steps=6, tensorboard=True))
    records = read_metrics(tmp_path / "metrics.jsonl")
    board = EventAccumulator(str(tmp_path / "tensorboard"))
    board.Reload()
    for kind, field in (("train", "loss"), ("train", "lr"), ("train", "step_time_s"),
                        ("train", "predicted_step_time_s"), ("eval", "val_loss")):
        want = [(r["step"], r[field]) for r in records if r["kind"] == kind]
        got = [(e.step, e.value) for e in board.Scalars(f"{kind}/{field}")]
        assert want and got == [(s, pytest.approx(v, rel=1e-6)) for s, v in want], (kind, field)
    peaks = [r["peak_memory_bytes"][0] for r in records if r["kind"] == "train"]
    assert [e.value for e in board.Scalars("train/peak_memory_bytes/rank0")] == pytest.approx(peaks, rel=1e-6)


def test_resume_after_crash_is_bit_exact(tmp_path, monkeypatch):
    reference = train(tiny(tmp_path / "a"))

    real_next = BatchSampler.next_batch
    calls = {"n": 0}

    def crash_after_eight(self):
        calls["n"] += 1
        if calls["n"] > 8:
            raise RuntimeError("simulated crash")
        return real_next(self)

    monkeypatch.setattr(BatchSampler, "next_batch", crash_after_eight)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(tiny(tmp_path / "b"))
    monkeypatch.setattr(BatchSampler, "next_batch", real_next)
    assert [p.name for p in (tmp_path / "b" / "checkpoints").iterdir()] == ["step_00000006"]

    resumed = train(tiny(tmp_path / "b", resume=True))
    assert list(resumed.losses) == list(range(7, 13))
    for step in range(7, 13):
        assert resumed.losses[step] == reference.losses[step]  # bit-exact on CPU
    assert resumed.val_losses[12] == reference.val_losses[12]


def run_cli(*args, cwd):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "snugfit", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--stepz", "3"], "unknown config key 'stepz'; did you mean steps"),
        (["--steps", "many"], "train.steps must be an integer"),
        (["--path", "no/such/file.txt"], "does not exist"),
        (["--path", "empty.txt"], "too few for one training sequence"),
        (["--config", "broken.toml"], "not valid TOML"),
    ],
)
def test_cli_bad_input_is_one_line(tmp_path, args, message):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "broken.toml").write_text("[train\n")
    proc = run_cli("train", "--steps", "2", *args, cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr


def test_existing_checkpoints_are_never_overwritten(tmp_path):
    train(tiny(tmp_path, steps=6))
    ckpt = tmp_path / "checkpoints" / "step_00000006"
    before = {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()}
    proc = run_cli("train", *sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in TINY.items()), []),
                   "--out-dir", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2 and "already holds checkpoints" in proc.stderr
    assert {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()} == before


def test_auto_plan_reports_predictions_and_draws_a_traced_step(tmp_path):
    """--plan auto: the searched plan runs, carries its predictions into the metrics, and a traced step is drawn."""
    import json

    import matplotlib.image

    train(tiny(tmp_path, steps=4, log_every=2, plan="auto", trace_step=3))
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert Plan.from_dict(plan).world_size == 1 and plan["predicted"]["fits"]
    record = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"train"' in x][-1]
    measured, predicted = record["peak_memory_bytes"][0], record["predicted_peak_memory_bytes"][0]
    assert record["predicted_step_time_s"] > 0
    assert abs(measured - predicted) <= 0.05 * predicted, (measured, predicted)
    height, width, _ = matplotlib.image.imread(tmp_path / "timeline.png").shape
    assert width > 600 and height > 300


FIXED = ["--dim", "64", "--n-layers", "4", "--n-heads", "4", "--eval-every", "0", "--log-every", "1",
         "--checkpoint-every", "0", "--progress", "false", "--plot", "false"]


def _losses(out) -> dict[int, float]:
    from snugfit.train.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"}


def _cli_losses(tmp_path, name, *args) -> dict[int, float]:
    proc = run_cli("train", *FIXED, "--out-dir", str(tmp_path / name), *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((tmp_path / name / "plan.json").read_text()), _losses(tmp_path / name)


def test_train_takes_the_fixed_parts_of_a_plan_as_options(tmp_path, monkeypatch, capsys):
    """`snugfit train --nproc N --zero 3` / `--pp 4 --schedule bpipe` / `--tp 2` / `--pp 2 --schedule zbv`: the rest
    searched, no plan file; losses equal the one-process run's. The one-process run and the refused option run
    in this process (main, the CLI's entry): the multi-rank runs are the launches under test."""
    from snugfit.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", *FIXED, "--out-dir", str(tmp_path / "one"), "--steps", "4"]) == 0
    alone = _losses(tmp_path / "one")
    plan2, zero3 = _cli_losses(tmp_path, "zero3", "--steps", "4", "--nproc", "2", "--zero", "3")
    plan4, bpipe = _cli_losses(tmp_path, "bpipe", "--steps", "4", "--nproc", "4", "--pp", "4", "--schedule", "bpipe")
    plan_tp, tp2 = _cli_losses(tmp_path, "tp2", "--steps", "4", "--nproc", "2", "--tp", "2")
    plan_v, zbv = _cli_losses(tmp_path, "zbv", "--steps", "4", "--nproc", "2", "--pp", "2", "--schedule", "zbv")
    assert {b["zero"] for b in [plan2["root"], *plan2["blocks"]]} == {3}
    bpipe_shape, tp_shape, v_shape = plan4["shape"], plan_tp["shape"], plan_v["shape"]
    assert (bpipe_shape["pp"], bpipe_shape["schedule"]) == (4, "bpipe") and (tp_shape["tp"], tp_shape["dp"]) == (2, 1)
    assert (v_shape["schedule"], v_shape["virtual_stages"]) == ("zbv", 2)
    for losses in (zero3, bpipe, tp2, zbv):
        assert losses == pytest.approx(alone, rel=1e-5)
    capsys.readouterr()
    assert main(["train", *FIXED, "--steps", "2", "--zero", "3", "--plan", "dp"]) == 2
    assert "drop --plan (auto) or the fixed parts" in capsys.readouterr().err


def test_a_searched_plan_that_cannot_fit_names_the_fixed_part_to_drop(tmp_path):
    """--micro-batch 1024 at 32k tokens cannot fit any host: one line naming that fixed part and the plan without it."""
    proc = run_cli("train", *FIXED, "--out-dir", str(tmp_path / "big"), "--max-seq-len", "32768", "--seq-len", "32768",
                   "--batch-size", "1024", "--micro-batch", "1024", "--recompute", "keep", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "no plan fits" in proc.stderr and "drop --micro-batch 1024: fits as dp 1 x pp 1" in proc.stderr


def test_a_profile_the_first_steps_contradict_is_set_aside_once(tmp_path, monkeypatch, capsys):
    """Steps far from the prediction set the cached hardware profile aside, so the next run measures the machine
    again; a profile measured again after that stays (the time model is then what is off)."""
    from snugfit.train.step_log import check_profile

    profile = tmp_path / "hardware.json"
    monkeypatch.setenv("SNUGFIT_HARDWARE_PROFILE", str(profile))
    profile.write_text("{}")
    check_profile(0.11, 0.1, print)  # within 1.5x: nothing happens
    assert profile.exists() and not (tmp_path / "hardware.json.stale").exists()
    check_profile(0.3, 0.1, print)
    assert not profile.exists() and (tmp_path / "hardware.json.stale").exists()
    profile.write_text('{"measured": "again"}')  # the next run measured the machine again
    check_profile(0.3, 0.1, print)
    assert profile.read_text() == '{"measured": "again"}'


def test_engine_internals_are_not_printed(tmp_path, caplog):
    """The calibration builds engines of its own: their internals (activation policies, FSDP2 units per engine)
    stay at debug level, the printed plan is the user's line."""
    import logging

    with caplog.at_level(logging.INFO):
        train(tiny(tmp_path, steps=2, zero=3))
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert any(m.startswith("plan dp=") for m in said)
    assert not [m for m in said if m.startswith(("activations:", "fsdp:"))]
