"""The routing's load imbalance in the time model (plan.corrections.IMBALANCE): measured from recorded tokens per
expert as the max over mean of the ep ranks' sums, it scales an ep plan's experts' grouped GEMMs and all-to-alls,
travels with the stored corrections to the next plan, and diagnose prices a run's with the same functions."""

from __future__ import annotations

import json

import pytest

from snugfit.hardware import parse_cluster
from snugfit.plan import Plan
from snugfit.plan.corrections import IMBALANCE, MeasuredStep, TimeCorrections, derive, machine_key, on_cluster, \
    routing_imbalance, shape_key
from snugfit.plan.estimate import estimate
from snugfit.profile import profile_model
from snugfit.report.routing import routing_table
from tests.test_moe import DIST, SEQ

SKEWED = [[[6, 2, 1, 1], [3, 3, 2, 2]], [[1, 1, 4, 4], [5, 5, 0, 0]]]  # per step, per layer, tokens per expert


def test_factor_is_max_over_mean_of_the_ep_ranks_sums():
    # ep 2: ranks hold experts {0, 1} and {2, 3}: sums (8, 2), (6, 4), (2, 8), (10, 0) -> 1.6, 1.2, 1.6, 2.0
    assert routing_imbalance(SKEWED, 2) == pytest.approx((1.6 + 1.2 + 1.6 + 2.0) / 4)
    assert routing_imbalance(SKEWED, 4) == pytest.approx((2.4 + 1.2 + 1.6 + 2.0) / 4)  # per expert
    assert routing_imbalance(SKEWED, 1) == 1.0 and routing_imbalance([], 2) == 1.0
    assert routing_imbalance([[[2, 2, 2, 2]]], 2) == 1.0


@pytest.fixture(scope="module")
def prof(tmp_path_factory):
    return profile_model(DIST, micro_batch_size=1, seq_len=SEQ, cache_dir=str(tmp_path_factory.mktemp("prof")))


@pytest.mark.parametrize("cluster", ["2xH100-80GB", "2xcpu"])
def test_ep2_plan_prices_experts_and_all_to_all_at_the_factor(prof, cluster):
    cl = parse_cluster(cluster)
    plan = Plan.uniform(len(prof.blocks), dp=2, ep=2, micro_batch_size=1, num_microbatches=1, seq_len=SEQ)
    balanced = estimate(plan, prof, cl).time_by_phase
    skewed = estimate(plan, prof, on_cluster(cl, TimeCorrections({IMBALANCE: 1.5}))).time_by_phase
    assert balanced["expert_gemm"] > 0 and balanced["ep_comm"] > 0
    for term in ("expert_gemm", "ep_comm"):
        assert skewed[term] == pytest.approx(1.5 * balanced[term], rel=1e-9)
    assert skewed["compute"] == pytest.approx(balanced["compute"], rel=1e-9)  # the rest of the work as it was
    # ep 1: one rank runs every expert, nothing to wait for
    one = Plan.uniform(len(prof.blocks), dp=2, micro_batch_size=1, num_microbatches=1, seq_len=SEQ)
    assert (estimate(one, prof, on_cluster(cl, TimeCorrections({IMBALANCE: 1.5}))).time_by_phase["expert_gemm"]
            == pytest.approx(estimate(one, prof, cl).time_by_phase["expert_gemm"], rel=1e-9))


def test_stored_imbalance_is_applied_on_the_next_plan(prof, tmp_path, monkeypatch):
    import snugfit.calibrate.corrections as stored

    monkeypatch.setenv("SNUGFIT_CORRECTIONS", str(tmp_path / "corrections.json"))
    cl = parse_cluster("2xcpu")
    got = derive([MeasuredStep(step=1.0, work=0.8, dp_comm=0.1, optimizer=0.1, idle=0.0)],
                 {"compute": 0.8, "dp_comm_exposed": 0.1, "optimizer": 0.1}, False, routing_imbalance(SKEWED, 2),
                 machine=machine_key(cl), shape=shape_key(prof), step=3)
    assert got.factors[IMBALANCE] == pytest.approx(1.6)
    stored.save_corrections(got)
    fixed, line = stored.with_stored_corrections(cl, prof)
    assert "routing_imbalance x1.60" in line
    plan = Plan.uniform(len(prof.blocks), dp=2, ep=2, micro_batch_size=1, num_microbatches=1, seq_len=SEQ)
    before, after = estimate(plan, prof, cl).time_by_phase, estimate(plan, prof, fixed).time_by_phase
    assert after["ep_comm"] == pytest.approx(1.6 * before["ep_comm"], rel=1e-9)


def test_diagnose_prints_the_cost_of_the_imbalance(tmp_path, capsys):
    from snugfit.cli import main
    from snugfit.plan.plan import Prediction

    plan = Plan.uniform(2, dp=2, ep=2, micro_batch_size=1, num_microbatches=1, seq_len=SEQ)
    plan.predicted = Prediction(peak_memory_bytes=1, memory_by_rank=[], step_time_s=1.0,
                                time_by_phase={"compute": 0.5, "expert_gemm": 0.3, "ep_comm": 0.2})
    (tmp_path / "plan.json").write_text(plan.to_json())
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"kind": "train", "step": i + 1,
                                                                "tokens_per_expert": s}) + "\n"
                                                    for i, s in enumerate(SKEWED)))
    assert main(["diagnose", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    f = routing_imbalance(SKEWED, 2)
    assert f"routing imbalance over the 2 ep ranks: max/mean x{f:.2f}, about {(f - 1) * 0.5:.4g} s a step" in out
    assert routing_table(SKEWED, 1)[-1] == "routing imbalance not priced at ep 1 (one rank runs every expert)"


def test_a_run_at_ep_2_stores_its_routing_imbalance_with_its_corrections(tmp_path, monkeypatch):
    from snugfit.train.metrics import read_metrics
    from tests.test_diagnose import RUN
    from tests.test_train import run_cli

    store = tmp_path / "corrections.json"
    monkeypatch.setenv("SNUGFIT_CORRECTIONS", str(store))  # run_cli hands the environment to the ranks
    plan = tmp_path / "plan.json"
    plan.write_text(Plan.uniform(2, dp=2, ep=2, micro_batch_size=2, num_microbatches=1, seq_len=32).to_json())
    args = [a for a in RUN if a != "dp"]
    args[args.index("--plan") + 1:args.index("--plan") + 1] = [str(plan)]
    proc = run_cli("train", *args, "--n-experts", "4", "--top-k", "2", "--moe-ffn-dim", "16",
                   "--out-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = [r["tokens_per_expert"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")
             if r.get("kind", "train") == "train"]
    (entry,) = json.loads(store.read_text()).values()
    # the re-plan runs beside training: it read the steps recorded by then, at least those up to its step
    assert any(entry["factors"][IMBALANCE] == pytest.approx(routing_imbalance(steps[:n], 2))
               for n in range(entry["step"], len(steps) + 1)), (entry["factors"], steps)
