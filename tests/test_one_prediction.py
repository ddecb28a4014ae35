"""One prediction per plan (issue 46 item 2): one plan through `snugfit plan`, a short `snugfit train --trace-step`
at 2 gloo ranks, pp 2, on the default model, and `snugfit diagnose` of that run: the plan's predicted step is the
training log's, the traced step's timeline's and diagnose's (or the timeline says why not); diagnose names FSDP2's
own work as such where there is no data parallelism, and at the calibration step reports the factors the run
derived."""

import json
import os
import re
import subprocess
import sys

import pytest

from snugfit.plan.plan import Plan, Prediction
from snugfit.report.timeline import differs_why
from snugfit.train.metrics import read_metrics

ARGS = ["--nproc", "2", "--seq-len", "64", "--batch-size", "8", "--steps", "4"]
TRACED = 4  # --trace-step; the calibration traces step 1 (--replan-after 1) and profiles step 2


def _cli(*args, cwd) -> tuple[str, str]:
    """stdout and stderr of one CLI call that must succeed (a first `snugfit plan` here measures the machine)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "snugfit", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def one_plan(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one_prediction")
    plan_json, _ = _cli("plan", *ARGS, "--pp", "2", "--json", cwd=tmp)
    (tmp / "plan.json").write_text(plan_json)
    out = tmp / "run"
    log = "".join(_cli("train", *ARGS, "--plan-file", str(tmp / "plan.json"), "--trace-step", str(TRACED),
                       "--replan-after", "1", "--log-every", "1", "--eval-every", "0", "--checkpoint-every", "0",
                       "--progress", "false", "--plot", "false", "--out-dir", str(out), cwd=tmp))
    diagnosis, _ = _cli("diagnose", str(out), "--picture", "none", cwd=tmp)
    return json.loads(plan_json), log, diagnosis.splitlines(), out


def test_plan_log_timeline_and_diagnose_show_one_predicted_step(one_plan):
    plan, log, diagnosis, _ = one_plan
    assert (plan["shape"]["dp"], plan["shape"]["pp"]) == (1, 2)
    step = plan["predicted"]["step_time_s"]
    logged = re.findall(r"\| step [\d.]+ s \(predicted ([\d.]+)\)", log)
    assert len(logged) == 4 and set(logged) == {f"{step:.3f}"}, log[-3000:]
    timeline = re.search(rf"timeline of step {TRACED}: \S+ \(predicted step ([\d.]+) s(, the plan's|; .*)\)", log)
    assert timeline, log[-3000:]
    if timeline.group(2) == ", the plan's":
        assert timeline.group(1) == f"{step:.4g}"
    else:  # a re-measured machine: the line says so
        assert "another measurement of this machine" in timeline.group(2), timeline.group(0)
    tables = [line for line in diagnosis if line.startswith("step ")]
    assert len(tables) == 2 and all(line.split()[1] == f"{step:.3g}" for line in tables), diagnosis
    assert f"(predicted {step:.3g} s)" in diagnosis[0]


def test_diagnose_charges_fsdp2s_own_work_not_dp_communication_at_one_data_parallel_rank(one_plan):
    _, _, diagnosis, _ = one_plan
    assert not any(line.startswith("dp_comm_exposed") for line in diagnosis), diagnosis
    rows = [line.split() for line in diagnosis if line.startswith("fsdp2_own_work")]
    assert len(rows) == 2  # the calibration's traced step (FSDP2 profiled next) and --trace-step's (not profiled)
    assert all(float(x) > 0 for x in rows[0][2:]) and rows[1][2:] == ["-", "-"], rows
    assert not any(f"at step {TRACED} the model's fsdp2_own_work" in line for line in diagnosis)


def test_diagnose_reports_the_factors_the_run_derived(one_plan):
    _, _, diagnosis, out = one_plan
    (replan,) = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "replan"]
    findings = [line for line in diagnosis if line.startswith("- at step 1 the model's ")]
    for line in findings:
        name = line.split("the model's ")[1].split(" term")[0]
        term = "dp_comm_exposed" if name == "fsdp2_own_work" else name
        assert line.endswith(f"(x{replan['corrections'][term]:.2f}) (term: {name})"), line
    words = ", ".join(f"{t} x{f:.2f}" for t, f in sorted(replan["corrections"].items()))
    assert any(line.startswith(f"- replan at step 1: corrections {words};") for line in diagnosis), diagnosis


def test_a_re_estimate_that_differs_says_why():
    plan = Plan.uniform(2, micro_batch_size=1, num_microbatches=1, seq_len=8)
    assert differs_why(plan, 0.5) is None  # no prediction to differ from
    plan.predicted = Prediction(step_time_s=0.2)
    assert differs_why(plan, 0.2 * (1 + 1e-4)) is None
    why = differs_why(plan, 0.3)
    assert why.startswith("predicted step 0.3 s here against the plan's 0.2 s") and "measurement" in why
