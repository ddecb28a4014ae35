"""Calibration from the run ([train] replan = "report") and `snugfit diagnose`, on 2 gloo ranks: a rank slowed on
purpose (the SNUGFIT_TEST_SLOW_RANK test hook) is named with its phase; a healthy run reports nothing alarming;
the replan record carries the corrections and the plan the corrected model prefers, and nothing switches."""

import json

import pytest

from snugfit.cli import main
from snugfit.plan import Plan
from snugfit.train.calibration import SLOW_ENV
from snugfit.train.loop import train
from snugfit.train.metrics import read_metrics
from tests.test_train import run_cli, tiny

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


def _diagnose(capsys, *args) -> list[str]:
    assert main(["diagnose", *args]) == 0
    return capsys.readouterr().out.splitlines()


def test_diagnose_names_the_slowed_rank_and_its_phase(runs, capsys):
    tmp, _, _ = runs
    alarms = [line for line in _diagnose(capsys, str(tmp / "slow")) if line.startswith("!")]
    # the sleep comes before the rank's forward; rank 0 waits for it in the gradients' all-reduce, in backward
    assert len(alarms) == 1 and alarms[0].startswith("! rank 1 is a straggler in host work outside the traced actions")
    assert "in 2 of 2 traced steps (2, 3)" in alarms[0]  # the calibration's traced step and its profiled one
    assert "rank 0 waits" in alarms[0] and "in backward" in alarms[0] and "(term: host dispatch)" in alarms[0]
    waited = float(alarms[0].split("rank 0 waits ")[1].split(" s")[0])
    assert 0.2 < waited < 0.45, alarms[0]
    assert (tmp / "slow" / "diagnose.png").stat().st_size > 0


def test_a_healthy_run_reports_nothing_alarming(runs, capsys):
    tmp, _, _ = runs
    lines = _diagnose(capsys, str(tmp / "healthy"), "--picture", "none")
    assert "nothing alarming" in lines and not any(line.startswith("!") for line in lines), lines
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
    assert Plan.from_dict(replan["new_plan"]).world_size == 2 and isinstance(replan["predicted_gain"], float)
    assert "replan at step 2:" in healthy_out and "nothing switches" in healthy_out
    # nothing switched: the plan run to the end is the one the run started with
    assert json.loads((out / "plan.json").read_text()) == replan["old_plan"]
    trace = json.loads((out / "traces" / "step_00000002.json").read_text())
    assert len(trace["fsdp_share"]) == 2 and all(0 < s < 1 for s in trace["fsdp_share"])
    assert json.loads((out / "traces" / "step_00000003.json").read_text())["profiled"]
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4, 5] and all(len(r["step_time_by_rank_s"]) == 2 for r in records if r["kind"] == "train")


def test_the_next_plan_here_applies_the_stored_corrections_and_says_so(tmp_path, monkeypatch, capsys):
    store = tmp_path / "corrections.json"
    monkeypatch.setenv("SNUGFIT_CORRECTIONS", str(store))
    model = {"dim": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32, "max_seq_len": 32, "batch_size": 2}
    train(tiny(tmp_path / "run", **model, steps=4, replan_after=2, eval_every=0, checkpoint_every=0, plan="auto"))
    (entry,) = json.loads(store.read_text()).values()
    assert entry["machine"] == "1xcpu" and entry["step"] == 2 and entry["factors"]
    capsys.readouterr()
    assert main(["plan", *sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in model.items()), [])]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("time model corrected")]
    assert len(said) == 1 and "on 1xcpu at step 2" in said[0] and str(store) in said[0]


def test_resume_on_fewer_ranks_replans_with_the_stored_corrections(runs, tmp_path, caplog, monkeypatch):
    """--resume of the 2-rank run on 1 rank: searched for 1 rank, with the per-device corrections the 2 ranks
    measured, said in one line each; it trains on as a fresh 1-rank resume from that checkpoint under that plan."""
    import logging
    import shutil

    from snugfit.config import build_config

    tmp, _, _ = runs
    settings = {"dim": 64, "n_layers": 2, "n_heads": 4, "seq_len": 32, "max_seq_len": 32, "batch_size": 4,
                "steps": 7, "log_every": 1, "eval_every": 0, "checkpoint_every": 0, "progress": False,
                "plot": False, "resume": True}
    for name in ("replanned", "fresh"):
        shutil.copytree(tmp / "healthy", tmp_path / name)
    # the suite's load comes and goes: pin it busy now, as it may have been when the 2 ranks measured, so the
    # stored corrections apply either way (the rule that drops them once the machine is quiet: test_corrections)
    monkeypatch.setattr("snugfit.calibrate.corrections.other_load_now", lambda: 1.0)
    with caplog.at_level(logging.INFO, logger="snugfit"):
        replanned = train(build_config(None, {**settings, "out_dir": str(tmp_path / "replanned"), "plan": "auto"}))
    said = caplog.text
    assert "time model corrected by what a run measured on 2xcpu at step 2" in said and "per-device terms" in said
    assert "the checkpoint was written by 2 ranks; re-planned for the 1 launched" in said
    plan = tmp_path / "replanned" / "plan.json"
    assert Plan.from_json(plan.read_text()).world_size == 1 and sorted(replanned.losses) == [6, 7]
    fresh = train(build_config(None, {**settings, "out_dir": str(tmp_path / "fresh"), "plan": str(plan)}))
    assert fresh.losses == pytest.approx(replanned.losses, rel=1e-6)


def test_replan_switch_goes_on_under_the_corrected_choice_as_a_resume_would(tmp_path):
    """A hardware profile that makes FSDP2's collectives and optimizer work 50x too cheap: the search picks
    2-way data parallelism; the traced step corrects the data-parallel term to what it measured, the corrected
    model prefers the 2-stage pipeline, and `--replan switch` checkpoints and goes on under it. Its losses equal
    those of a fresh run resumed from that checkpoint under the new plan."""
    import shutil

    from snugfit.hardware.catalogue import hardware_cache_path
    from snugfit.train.autoplan import measure_once

    measure_once(2)  # this machine with FSDP2's costs between 2 ranks (the tests before may have measured 1 rank)
    wrong = json.loads(hardware_cache_path().read_text())
    for name, cost in wrong["host"]["fsdp"]["2"].items():
        if name != "contention":
            wrong["host"]["fsdp"]["2"][name] = [x * 0.02 for x in cost]
    profile = tmp_path / "wrong.json"
    profile.write_text(json.dumps(wrong))
    args = [a for a in RUN if a not in ("--plan", "dp")]
    args[args.index("--steps") + 1], args[args.index("--replan-after") + 1] = "10", "3"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SNUGFIT_HARDWARE_PROFILE", str(profile))
        proc = run_cli("train", *args, "--replan", "switch", "--out-dir", str(tmp_path / "switch"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = read_metrics(tmp_path / "switch" / "metrics.jsonl")
    (replan,) = [r for r in records if r["kind"] == "replan"]
    old, new = (Plan.from_dict(replan[which]) for which in ("old_plan", "new_plan"))
    assert old.dp == 2 and replan["switched"] and new.pp == 2, replan
    # the wrong term, corrected, is what the traced step measured it to cost (not clamped, applied where it acts)
    fixed, measured = replan["corrected_terms_s"]["dp_comm_exposed"], replan["measured_terms_s"]["dp_comm_exposed"]
    assert fixed == pytest.approx(measured, rel=0.15) and replan["corrections"]["dp_comm_exposed"] > 5
    switched = Plan.from_json((tmp_path / "switch" / "plan.json").read_text())
    assert "switched at step 4" in proc.stdout and switched.pp == 2
    (outcome,) = [r for r in records if r["kind"] == "replan_outcome"]
    assert outcome["switched_at"] == 4 and outcome["measured_after_s"] > 0  # reported, not asserted: a shared host
    # a fresh run resumed from the switch's checkpoint under the new plan
    fresh = tmp_path / "fresh"
    shutil.copytree(tmp_path / "switch", fresh)
    shutil.rmtree(fresh / "checkpoints" / "step_00000010")
    (fresh / "metrics.jsonl").unlink()
    proc = run_cli("train", *args, "--resume", "--replan", "off",
                   "--plan", str(fresh / "plan.json"), "--out-dir", str(fresh), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    switched = {r["step"]: r["loss"] for r in records if r["kind"] == "train" and r["step"] > 4}
    resumed = {r["step"]: r["loss"] for r in read_metrics(fresh / "metrics.jsonl") if r["kind"] == "train"}
    assert resumed == pytest.approx(switched, rel=1e-6) and sorted(resumed) == list(range(5, 11))
