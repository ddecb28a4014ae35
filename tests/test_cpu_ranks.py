"""The time model on CPU ranks: FSDP2's, tensor parallelism's and the pipeline runtime's measured costs, and
how ranks crowding the cores slow each other (plan.cpu_ranks)."""

import pytest

from snugfit.hardware import parse_cluster
from snugfit.plan.cpu_ranks import local_ranks
from snugfit.plan.estimate import estimate, stage_times
from snugfit.plan.plan import BlockPlan, Plan
from snugfit.plan.timing import gather_every, stage_time
from tests.test_memory_model import _plan, synthetic_profile
from tests.test_time_model import _measured


def _cpu_cluster(ranks: int, contention: float = 1.0):
    """`ranks` x this machine's CPU: 2 cores, known FSDP2 costs and contention measured for 2 ranks only, one
    thread as fast as all (the one-thread factor has its own test, in test_hardware)."""
    cluster = parse_cluster(f"{ranks}xcpu")
    h = cluster.nodes[0].host
    h.cores, h.thread_slowdown = 2, 1.0
    h.fsdp = {"2": {"replicate": [3e-4, 1e-10], "gather": [1e-3, 1e-9], "regather": [5e-4, 1e-9],
                    "allreduce": [1e-3, 3e-9], "reduce": [2e-3, 2e-9], "update": [4e-4, 1e-10],
                    "stage": [3e-3, 0.0], "tp": [0.0, 0.0], "contention": [contention]}}
    return cluster


def test_cpu_ranks_pay_fsdp_costs_per_unit_and_zero3_gathers_twice():
    """On CPU ranks FSDP2's measured costs add up (nothing overlaps): zero 3 > zero 1-2 > zero 0 by the hand sums,
    the root (embedding + head) one unit."""
    prof, cluster = _measured(synthetic_profile(dtype="float32")), _cpu_cluster(2)
    bp = 10_000_000 * 4  # a block's parameter bytes (fp32)
    root_bytes = 2_000_000 * 4  # embedding + head

    def comm(zero):
        plan = Plan.uniform(8, dp=2, block=BlockPlan(zero=zero), root=BlockPlan(zero=zero), seq_len=1024,
                            num_microbatches=1)
        return estimate(plan, prof, cluster).time_by_phase["dp_comm_exposed"]

    def reduce(fixed, per_byte):
        return sum(fixed + per_byte * n * 4 for n in [10_000_000] * 8 + [2_000_000])

    assert comm(0) == pytest.approx(8 * (3e-4 + 1e-10 * bp) + 3e-4 + 1e-10 * root_bytes + reduce(1e-3, 3e-9))
    assert comm(2) == pytest.approx(8 * (1e-3 + 1e-9 * bp) + 1e-3 + 1e-9 * root_bytes + reduce(2e-3, 2e-9))
    assert comm(3) == pytest.approx(comm(2) + 8 * (5e-4 + 1e-9 * bp))
    # the optimizer step's DTensor work: once per unit and step, whatever the sharding
    plan = Plan.uniform(8, dp=2, seq_len=1024, num_microbatches=1)
    no_update = _cpu_cluster(2)
    no_update.nodes[0].host.fsdp["2"]["update"] = [0.0, 0.0]
    extra = estimate(plan, prof, cluster).time_by_phase["optimizer"] - estimate(plan, prof, no_update).time_by_phase[
        "optimizer"]
    assert extra == pytest.approx(8 * (4e-4 + 1e-10 * bp) + 4e-4 + 1e-10 * root_bytes)


def test_cpu_ranks_beyond_the_cores_slow_down_and_gpus_ignore_host_fsdp_costs():
    prof = _measured(synthetic_profile(dtype="float32"))
    plan = lambda dp: Plan.uniform(8, dp=dp, seq_len=1024, num_microbatches=1)  # noqa: E731
    two, four = estimate(plan(2), prof, _cpu_cluster(2, 1.25)), estimate(plan(4), prof, _cpu_cluster(4, 1.25))
    assert two.time_by_phase["compute"] == pytest.approx(10 * 0.03 * 1.25)
    # 4 ranks measured as 2: twice as slow on 2 cores, FSDP2's costs too
    assert four.time_by_phase["compute"] == pytest.approx(2 * two.time_by_phase["compute"])
    assert four.time_by_phase["dp_comm_exposed"] == pytest.approx(2 * two.time_by_phase["dp_comm_exposed"])
    measured_four = _cpu_cluster(4, 1.25)
    measured_four.nodes[0].host.fsdp["4"] = {**measured_four.nodes[0].host.fsdp["2"], "contention": [3.0]}
    assert estimate(plan(4), prof, measured_four).time_by_phase["compute"] == pytest.approx(10 * 0.03 * 3.0)
    gpu = parse_cluster("2xA100-80GB")
    before = estimate(_plan(dp=2, block=BlockPlan(zero=3)), synthetic_profile(), gpu).step_time_s
    gpu.nodes[0].host.fsdp = _cpu_cluster(2).nodes[0].host.fsdp
    assert estimate(_plan(dp=2, block=BlockPlan(zero=3)), synthetic_profile(), gpu).step_time_s == before


def test_cpu_pipeline_stages_pay_the_measured_runtime_cost_per_microbatch():
    prof = _measured(synthetic_profile(dtype="float32"))
    plan = Plan.uniform(8, pp=2, schedule="1f1b", seq_len=1024, num_microbatches=4)
    with_cost, free = _cpu_cluster(2), _cpu_cluster(2)
    free.nodes[0].host.fsdp["2"]["stage"] = [0.0, 0.0]
    a, b = estimate(plan, prof, with_cost), estimate(plan, prof, free)
    assert a.time_by_phase["pipeline_runtime"] == pytest.approx(4 * 3e-3)
    # on every stage's critical path: the 4 microbatches of the slowest stage and the bubble's one of the other
    assert a.step_time_s - b.step_time_s == pytest.approx(5 * 3e-3, rel=0.05)
    dp = Plan.uniform(8, dp=2, seq_len=1024, num_microbatches=4)  # no pipeline: no such cost
    assert "pipeline_runtime" not in {k for k, v in estimate(dp, prof, with_cost).time_by_phase.items() if v}


def test_crowded_cpu_ranks_slow_each_other_only_while_they_work():
    """4 ranks on 2 cores measured 2x slower all working at once; a pipeline's ranks also wait, so less."""
    prof = _measured(synthetic_profile(dtype="float32"))

    def compute(plan, contention):
        cluster = _cpu_cluster(4)
        cluster.nodes[0].host.fsdp["4"] = {**cluster.nodes[0].host.fsdp["2"], "contention": [contention]}
        return estimate(plan, prof, cluster).time_by_phase["compute"]

    dp = Plan.uniform(8, dp=4, seq_len=1024, num_microbatches=4)
    assert compute(dp, 2.0) == pytest.approx(2.0 * compute(dp, 1.0))
    pp = Plan.uniform(8, pp=4, schedule="1f1b", seq_len=1024, num_microbatches=4)
    busy = 4 / (4 + 3)  # 1F1B over 4 alike stages: each rank works 4 of 7 microbatch slots
    assert compute(pp, 2.0) == pytest.approx(2.0 * busy * compute(pp, 1.0), rel=0.1)


def test_cpu_fsdp_costs_come_from_the_measurement_among_the_data_parallel_group():
    """FSDP2's collectives run among the data-parallel group: dp 2 x pp 2 on 4 ranks pays the costs measured
    between 2 (a ring of 2), slowed by the 4 ranks' crowding over what the 2 measured; dp 4 those between 4."""
    prof = _measured(synthetic_profile(dtype="float32"))

    def fsdp_time(dp, four=3.0, two=1.0):
        cluster = _cpu_cluster(4, contention=1.25)
        measured = cluster.nodes[0].host.fsdp
        base = {k: v for k, v in measured["2"].items() if k != "contention"}
        measured["2"] = {k: [two * a for a in v] for k, v in base.items()} | {"contention": [1.25]}
        measured["4"] = {k: [four * a for a in v] for k, v in base.items()} | {"contention": [2.5]}
        plan = Plan.uniform(8, dp=dp, pp=4 // dp, schedule="1f1b" if dp < 4 else "none", seq_len=1024,
                            num_microbatches=2)
        costs, share = local_ranks(cluster.nodes[0], group=dp)
        assert costs is measured[str(dp)] and share == 2.5  # the group's costs, the crowding of all 4 ranks
        return estimate(plan, prof, cluster).time_by_phase["dp_comm_exposed"]

    assert fsdp_time(2, four=5.0) == pytest.approx(fsdp_time(2))  # what 4 ranks' collectives cost: not dp 2's
    assert fsdp_time(2, two=2.0) == pytest.approx(2 * fsdp_time(2))
    assert fsdp_time(4, four=5.0) == pytest.approx(5 / 3 * fsdp_time(4))
    assert fsdp_time(4, two=2.0) == pytest.approx(fsdp_time(4))


def test_tensor_parallel_pays_its_measured_dtensor_cost_per_piece_on_cpu_ranks():
    """On CPU ranks DTensor's per-operator work, measured by profile_hardware ("tp"), is charged per piece and
    microbatch beside the collectives: a tp2 step costs m x pieces x that more once it is known."""
    from snugfit.model.decoder import ModelConfig
    from snugfit.profile import profile_model

    cfg = ModelConfig(dim=64, n_layers=3, n_heads=4, vocab_size=128, max_seq_len=32)
    prof = profile_model(cfg, micro_batch_size=2, seq_len=32, use_cache=False)
    plan = Plan.uniform(3, tp=2, micro_batch_size=2, num_microbatches=4, seq_len=32)
    free, known = _cpu_cluster(2), _cpu_cluster(2)
    known.nodes[0].host.fsdp["2"]["tp"] = [2e-3, 0.0]
    extra = estimate(plan, prof, known).time_by_phase["tp_comm"] - estimate(plan, prof, free).time_by_phase["tp_comm"]
    assert extra == pytest.approx(4 * (3 + 2) * 2e-3)


def test_zero2_units_gather_once_a_step_in_a_pipeline_and_each_microbatch_without_one():
    """Pipeline stages keep FSDP2 units unsharded until the last backward; the engine reshards after each one (the
    gathers are counted on the runtime in test_pipeline.py)."""
    assert gather_every(2, 4) == 4 and gather_every(1, 4) == 1
    prof = _measured(synthetic_profile(dtype="float32"))

    def exposed(cluster, zero: int, gathers: int) -> float:
        """A stage's FSDP2 time per microbatch at pp 2 x dp 2, 4 microbatches, with `gathers` as given."""
        plan = Plan.uniform(8, pp=2, dp=2, schedule="1f1b", block=BlockPlan(zero=zero), root=BlockPlan(zero=zero),
                            seq_len=1024, num_microbatches=4)
        pieces = stage_times(plan, prof, cluster)[0][0][0]
        node, link = cluster.nodes[0], cluster.link_for([0, 1])
        return stage_time(pieces, node=node, dtype="float32", reduce_dtype="float32", dp=2, dp_link=link,
                          measured_on="cpu", pipelined=True, gathers=gathers).comm_exposed

    cpu = _cpu_cluster(4)
    cpu.nodes[0].host.cores = 4  # no crowding: the costs differ by their gathers only
    # a ZeRO-2 unit: one gather and three microbatches of hooks alone (a replicated unit's cost)
    assert exposed(cpu, 2, 4) == pytest.approx((exposed(cpu, 2, 1) + 3 * exposed(cpu, 0, 1)) / 4)
    assert exposed(cpu, 2, 4) < exposed(cpu, 2, 1)
    for zero in (0, 3):  # nothing to keep, or resharded after every forward all the same
        assert exposed(cpu, zero, 4) == pytest.approx(exposed(cpu, zero, 1))
    gpus = parse_cluster("4xA100-80GB-PCIe")
    assert exposed(gpus, 2, 4) < exposed(gpus, 2, 1)
    # estimate() gives a pipeline's stages the microbatches of its step
    plan = Plan.uniform(8, pp=2, dp=2, schedule="1f1b", block=BlockPlan(zero=2), root=BlockPlan(zero=2),
                        seq_len=1024, num_microbatches=4)
    _, kind, times = stage_times(plan, prof, cpu)
    assert times[kind[0]][0].comm_exposed == pytest.approx(exposed(cpu, 2, 4))
