"""The GPU acceptance script's logic, on CPU (`bench/gpu/run.py --smoke`): every part of its report is there and
every technique trains as the plain PyTorch reference does."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _smoke(script: str, report: str, tmp_path: Path) -> dict:
    """Run bench/gpu/`script` --smoke with its output and hardware profile under tmp_path; its JSON report."""
    env = {**os.environ, "OUT": str(tmp_path), "SNUGFIT_HARDWARE_PROFILE": str(tmp_path / "hardware.json")}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / script), "--smoke"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return json.loads((tmp_path / report).read_text())


def test_acceptance_smoke_reports_every_part_and_every_technique_matches_its_reference(tmp_path):
    report = _smoke("run.py", "acceptance.json", tmp_path)
    rows = {r["technique"]: r for r in report["techniques"]}
    torchao = {"NF4 base (QLoRA)", "8-bit states", "bf16 master weights", "8-bit streamed in backward, bf16 weights"}
    moe = [n for n in rows if n.startswith("MoE, ")]  # its expert count is the smoke size's
    assert len(moe) == 1 and "ep 1" in moe[0]
    assert set(rows) - set(moe) == {"replicated", "optimizer offload", "parameter offload", "recompute", "selective",
                         "selective, half the matmuls", "activation offload", "ZeRO-3, reduced every microbatch",
                         "tiled MLP, 4 tiles", "LoRA", "fp16 + loss scaling", "bfloat16", "step in backward",
                         "states streamed", *torchao}
    for name, r in rows.items():
        if "skipped" in r:
            assert name in torchao
            continue
        assert r["loss_ok"] and len(r["losses"]) == len(r["reference_losses"]) >= 3, name  # (a)
        assert r["measured_peak_bytes"] > 0 and r["predicted_peak_bytes"] > 0, name  # (b)
        assert r["measured_step_s"] > 0 and r["predicted_step_s"] > 0, name  # (c)
        assert r["predicted_measured_step_s"] > 0, name  # (c) on the card as (e) measured it
        assert r["predicted_compile_s"] == 0 and "measured_compile_s" in r, name  # eager rows on CPU: none to compile
    offload = report["offload_comparison"]  # (d)
    assert set(offload["plans"]) == {"snugfit", "full offload"} and offload["speedup"]["measured"] > 0
    measured = report["hardware"]["measured"]  # (e)
    assert measured["tflops"]["float32"] > 0 and measured["host_step_params_per_s"] > 0
    corrections = report["corrections"]  # (f)
    assert corrections["corrections"]["compute"] > 0 and corrections["measured_terms_s"]["compute"] > 0
    assert len(measured["attention_tflops"]) == 2
    assert "| replicated | ok" in (tmp_path / "acceptance.md").read_text()
    assert "errors" not in report  # a part that raised is reported there and fails the run


def test_diagnose_smoke_times_both_loops_at_both_shapes(tmp_path):
    """bench/gpu/diagnose.py on CPU: the engine's and plain PyTorch's steps timed and profiled at both shapes."""
    report = _smoke("diagnose.py", "diagnose.json", tmp_path)
    for shape in ("shape", "tiny"):
        r = report[shape]
        assert r["engine_step_s"] > 0 and r["plain_step_s"] > 0 and r["predicted_step_s"] > 0
        assert r["engine_kernels"]["aten_ops"] > 0 and r["plain_kernels"]["aten_ops"] > 0
        assert r["profile_ops_total"] >= 2 * sum(r["profile_ops_per_block"].values())  # two blocks at least
