"""Calibration from the run ([train] replan = "report") and `snugfit diagnose`, on 2 gloo ranks: a rank slowed on
purpose (the SNUGFIT_TEST_SLOW_RANK test hook) is named with its phase; a healthy run reports nothing alarming;
the replan record carries the corrections and the plan the corrected model prefers, and nothing switches."""

import json

import pytest

from snugfit.train.calibration import SLOW_ENV
from snugfit.train.metrics import read_metrics
from tests.test_train import run_cli

RUN = ["--nproc", "2", "--plan", "dp", "--dim", "64", "--n-layers", "2", "--n-heads", "4", "--seq-len", "32",
       "--max-seq-len", "32", "--batch-size", "4", "--steps", "5", "--replan-after", "2", "--log-every", "1",
       "--eval-every", "0", "--checkpoint-every", "0", "--progress", "false", "--plot", "false"]


def _train(tmp_path, name, slow=None):
    with pytest.MonkeyPatch.context() as mp:
        if slow:
            mp.setenv(SLOW_ENV, slow)  # run_cli hands the environment to the ranks
        proc = run_cli("train", *RUN, "--out-dir", str(tmp_path / name), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("diagnose")
    return tmp, _train(tmp, "slow", slow="1:0.3"), _train(tmp, "healthy")


def test_diagnose_names_the_slowed_rank_and_its_phase(runs):
    tmp, _, _ = runs
    proc = run_cli("diagnose", str(tmp / "slow"), cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-2000:]
    alarms = [line for line in proc.stdout.splitlines() if line.startswith("!")]
    # the sleep comes before the rank's forward; rank 0 waits for it in the gradients' all-reduce, in backward
    assert len(alarms) == 1 and alarms[0].startswith("! rank 1 is a straggler in host work outside the traced actions")
    assert "rank 0 waits" in alarms[0] and "in backward" in alarms[0] and "(term: host dispatch)" in alarms[0]
    waited = float(alarms[0].split("rank 0 waits ")[1].split(" s")[0])
    assert 0.2 < waited < 0.45, alarms[0]
    assert (tmp / "slow" / "diagnose.png").stat().st_size > 0


def test_a_healthy_run_reports_nothing_alarming(runs):
    tmp, _, _ = runs
    proc = run_cli("diagnose", str(tmp / "healthy"), "--picture", "none", cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert "nothing alarming" in lines and not any(line.startswith("!") for line in lines), proc.stdout
    table = lines[lines.index("traced step 2:") + 1:]
    assert table[0].split() == ["term", "predicted", "rank", "0", "rank", "1"]
    assert {row.split()[0] for row in table[1:5]} >= {"compute", "dp_comm_exposed", "optimizer"}


def test_replan_report_records_the_corrected_choice_and_does_not_switch(runs):
    tmp, _, healthy_out = runs
    out = tmp / "healthy"
    records = read_metrics(out / "metrics.jsonl")
    (replan,) = [r for r in records if r["kind"] == "replan"]
    assert replan["step"] == 2 and replan["mode"] == "report" and replan["switched"] is False
    assert {"compute", "dp_comm_exposed", "optimizer"} <= set(replan["corrections"])
    # the corrected model predicts the plan it corrected closer to what was measured than the uncorrected one
    measured = replan["measured_step_s"]
    assert abs(replan["old_predicted_s"] - measured) < abs(replan["uncorrected_step_s"] - measured)
    assert replan["new_plan"]["world_size"] == 2 and isinstance(replan["predicted_gain"], float)
    assert "replan at step 2:" in healthy_out and "nothing switches" in healthy_out
    # nothing switched: the plan run to the end is the one the run started with
    assert json.loads((out / "plan.json").read_text()) == replan["old_plan"]
    trace = json.loads((out / "traces" / "step_00000002.json").read_text())
    assert len(trace["fsdp_share"]) == 2 and all(0 < s < 1 for s in trace["fsdp_share"])
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4, 5] and all(len(r["step_time_by_rank_s"]) == 2 for r in records if r["kind"] == "train")


def test_the_next_plan_here_applies_the_stored_corrections_and_says_so(tmp_path, monkeypatch):
    store = tmp_path / "corrections.json"
    monkeypatch.setenv("SNUGFIT_CORRECTIONS", str(store))
    model = ["--dim", "32", "--n-layers", "2", "--n-heads", "2", "--seq-len", "32", "--max-seq-len", "32"]
    proc = run_cli("train", *model, "--batch-size", "2", "--steps", "4", "--replan-after", "2", "--eval-every", "0",
                   "--checkpoint-every", "0", "--progress", "false", "--plot", "false", "--out-dir",
                   str(tmp_path / "run"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (entry,) = json.loads(store.read_text()).values()
    assert entry["machine"] == "1xcpu" and entry["step"] == 2 and entry["factors"]
    proc = run_cli("plan", *model, "--batch-size", "2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = [line for line in proc.stdout.splitlines() if line.startswith("time model corrected")]
    assert len(said) == 1 and "on 1xcpu at step 2" in said[0] and str(store) in said[0], proc.stdout
