"""The time model's corrections (plan.corrections): attribution of a traced step to the terms, the factors, the one
place the model applies them, and their store beside the hardware profile."""

import pytest

from snugfit.hardware import parse_cluster
from snugfit.model.decoder import ModelConfig
from snugfit.plan import BlockPlan, Plan
from snugfit.plan.corrections import MeasuredStep, TimeCorrections, derive, machine_key, on_cluster
from snugfit.plan.estimate import estimate
from snugfit.profile.cache import profile_model

PREDICTED = {"compute": 0.10, "recompute": 0.02, "dp_comm_exposed": 0.04, "tp_comm": 0.0, "offload_exposed": 0.0,
             "pipeline_runtime": 0.0, "optimizer": 0.01, "bubble": 0.0}


def test_factors_are_measured_over_predicted_per_term():
    # ranks in lockstep: the first waited 0.05 s for the second in its collectives
    ranks = [MeasuredStep(step=0.4, work=0.24, dp_comm=0.13, optimizer=0.02, idle=0.01),
             MeasuredStep(step=0.4, work=0.24, dp_comm=0.08, optimizer=0.02, idle=0.06)]
    c = derive(ranks, PREDICTED, pipelined=False, machine="2xcpu", shape="s", step=20)
    # compute and recompute share the forward and backward spans, in the model's proportions: one factor
    assert c.factors["compute"] == pytest.approx(2.0) and c.factors["recompute"] == pytest.approx(2.0)
    assert c.factors["dp_comm_exposed"] == pytest.approx(2.0)  # the least of the ranks: no waits in it
    assert c.factors["optimizer"] == pytest.approx(2.0)
    assert "tp_comm" not in c.factors and "bubble" not in c.factors  # nothing predicted, or derived by the schedule
    assert c.measured["host"] == pytest.approx(0.035)  # idle time outside a pipeline: host work, no term of the model
    assert TimeCorrections.from_dict(c.to_dict()) == c


def test_a_term_too_small_to_measure_gets_no_factor_and_factors_are_bounded():
    predicted = dict(PREDICTED, optimizer=1e-6)
    c = derive([MeasuredStep(step=1, work=1000.0, dp_comm=0.04, optimizer=0.5, idle=0)], predicted, False)
    assert "optimizer" not in c.factors and c.factors["compute"] == 100.0 and c.factors["dp_comm_exposed"] == 1.0


def _tiny():
    cfg = ModelConfig(dim=32, n_layers=4, n_heads=2, vocab_size=128, max_seq_len=32)
    return profile_model(cfg, micro_batch_size=1, seq_len=32, dtype="float32", kernels="cpu")


def test_estimate_applies_each_factor_to_its_term_and_the_bubble_follows():
    prof = _tiny()
    cluster = parse_cluster("4xRTX4090")
    plan = Plan.uniform(4, dp=2, pp=2, micro_batch_size=1, num_microbatches=4, seq_len=32, block=BlockPlan(zero=3))
    raw = estimate(plan, prof, cluster)
    fixed = estimate(plan, prof, on_cluster(cluster, TimeCorrections({"compute": 3.0, "dp_comm_exposed": 0.5})))
    assert machine_key(cluster) == "4xRTX4090"
    assert fixed.time_by_phase["compute"] == pytest.approx(3 * raw.time_by_phase["compute"], rel=1e-9)
    assert fixed.time_by_phase["dp_comm_exposed"] == pytest.approx(0.5 * raw.time_by_phase["dp_comm_exposed"],
                                                                   rel=1e-9)
    assert fixed.time_by_phase["optimizer"] == pytest.approx(raw.time_by_phase["optimizer"], rel=1e-9)
    assert fixed.time_by_phase["bubble"] > 2 * raw.time_by_phase["bubble"]  # the pipeline waits on slower stages
    assert estimate(plan, prof, on_cluster(cluster, None)).step_time_s == pytest.approx(raw.step_time_s)


def test_corrections_measured_under_other_jobs_load_are_dropped_once_the_machine_is_quiet(tmp_path, monkeypatch):
    """Stored corrections say how old they are; those a run measured while other work loaded the machine are left
    out once it is quiet (they corrected for that work), kept while it lasts."""
    import time

    import snugfit.calibrate.corrections as stored
    from snugfit.plan.corrections import shape_key

    monkeypatch.setenv("SNUGFIT_CORRECTIONS", str(tmp_path / "corrections.json"))
    prof = profile_model(ModelConfig(dim=32, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=16),
                         micro_batch_size=1, seq_len=16, cache_dir=str(tmp_path))
    cluster = parse_cluster("2xcpu")
    for load, now, applied in ((0.7, 0.05, False), (0.7, 0.8, True), (0.02, 0.05, True)):
        stored.save_corrections(TimeCorrections({"compute": 9.0}, machine=machine_key(cluster),
                                                shape=shape_key(prof), step=20, measured_at=time.time() - 3 * 3600,
                                                other_load=load))
        monkeypatch.setattr(stored, "other_load_now", lambda: now)
        corrected, line = stored.with_stored_corrections(cluster, prof)
        assert (corrected.nodes[0].corrections == {"compute": 9.0}) == applied, (load, now)
        assert ("3 h ago" in line) if applied else ("which has stopped" in line and "70%" in line)
