"""Memory model: ZeRO division, schedule residency, BPipe bound, offload, and the CPU check against MemTracker."""

import pytest

from snugfit.hardware import parse_cluster
from snugfit.model.decoder import ModelConfig
from snugfit.plan.estimate import estimate
from snugfit.plan.memory import device_bytes
from snugfit.plan.piece_memory import param_state, rank_stages
from snugfit.plan.plan import BlockPlan, Plan
from snugfit.plan.simulate import simulate
from snugfit.profile.types import ModelProfile, PieceProfile

MB = 2**20


def synthetic_profile(n_blocks=8, block_params=10_000_000, saved=64 * MB, seq=1024, dtype="bfloat16"):
    """Round numbers, so the expected bytes can be written down by hand."""
    hidden = 4 * MB

    def block(i):
        return PieceProfile(
            f"block.{i}", {dtype: block_params}, hidden, hidden,
            {"keep": saved, "recompute": hidden, "selective": saved // 2}, saved + 2 * hidden, 2 * hidden,
            fwd_flops=1e12, bwd_flops=2e12, fwd_mem_bytes=1e9, bwd_mem_bytes=2e9,
        )

    embed = PieceProfile("embed", {dtype: 1_000_000}, 0, hidden, {"keep": 0}, hidden, 0)
    head = PieceProfile("head", {dtype: 1_000_000}, hidden, 0, {"keep": 8 * MB}, 32 * MB, 16 * MB, 1e11, 2e11)
    return ModelProfile("synthetic", {}, 1, seq, dtype, embed, [block(i) for i in range(n_blocks)], head)


def _plan(n=8, **kw):
    kw.setdefault("root", BlockPlan(zero=kw["block"].zero) if "block" in kw else None)
    kw.setdefault("seq_len", 1024)
    kw.setdefault("compute_dtype", "bfloat16")
    return Plan.uniform(n, **kw)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_stage_divides_the_right_categories(zero):
    """As FSDP2 holds them: fp32 shards at rest (zero 1 runs as zero 2), a bf16 copy gathered unless zero 3."""
    plan = _plan(dp=4, block=BlockPlan(zero=zero), num_microbatches=1)
    sp = rank_stages(plan, synthetic_profile(), 0)[0][1]  # block 0
    dev, host = param_state(plan, sp)
    n, div = 10_000_000, (4 if zero >= 1 else 1)
    assert dev["parameters"] == n * 4 // div  # the fp32 shard is the master weight
    assert dev["comm_buffers"] == (0 if zero == 3 else n * 2)
    assert dev["gradients"] == n * 4 // div
    assert dev["optimizer_states"] == n * 8 // div
    assert host == {}


def test_accumulation_holds_unsharded_gradients_whatever_the_zero_stage():
    prof, cl = synthetic_profile(), parse_cluster("4xA100-80GB")
    one = estimate(_plan(dp=4, block=BlockPlan(zero=3), num_microbatches=1), prof, cl).memory_by_rank[0]
    acc = estimate(_plan(dp=4, block=BlockPlan(zero=3), num_microbatches=2), prof, cl).memory_by_rank[0]
    assert acc["gradients"] == prof.num_params() * 4 > 2 * one.get("gradients", 0)


def test_frozen_parameters_cost_their_compute_dtype_bytes_only():
    prof = synthetic_profile()
    for b in prof.blocks:
        b.trainable = 100_000
    frozen = 10_000_000 - 100_000
    plan = _plan(dp=2, block=BlockPlan(zero=2, placement="host_step"))
    dev, host = param_state(plan, rank_stages(plan, prof, 0)[0][1])
    assert dev["frozen_parameters"] == frozen * 2 // 2  # bf16
    assert dev["parameters"] == 100_000 * 2 // 2  # the adapters' shards: bf16 too, their masters on host
    assert host == {"master_weights": 200_000, "gradients": 200_000, "optimizer_states": 400_000, "staging": 100_000}
    plan = _plan(dp=2, block=BlockPlan(zero=0))
    dev, host = param_state(plan, rank_stages(plan, prof, 0)[0][1])
    assert dev["frozen_parameters"] == frozen * 2 and dev["parameters"] == 100_000 * 4  # bf16; fp32 masters
    assert dev["comm_buffers"] == 100_000 * 2  # a zero-0 unit gathers only its trainable part
    plan = _plan(dp=2, block=BlockPlan(zero=3, placement="params_on_host"))
    dev, host = param_state(plan, rank_stages(plan, prof, 0)[0][1])
    assert host["frozen_parameters"] == frozen * 2 // 2 and host["parameters"] == 100_000 * 4 // 2


def test_zero3_adds_a_gather_buffer_and_shrinks_peak():
    prof = synthetic_profile()
    cl = parse_cluster("4xA100-80GB")
    p0 = estimate(_plan(dp=4, block=BlockPlan(zero=0), root=BlockPlan(zero=0)), prof, cl)
    p3 = estimate(_plan(dp=4, block=BlockPlan(zero=3), root=BlockPlan(zero=3)), prof, cl)
    root = 2 * 1_000_000 * 2  # the root unit stays gathered from forward through backward
    assert p3.memory_by_rank[0]["comm_buffers"] == root + 2 * 10_000_000 * 2  # running + prefetched block
    assert p0.memory_by_rank[0]["comm_buffers"] == root + 8 * 10_000_000 * 2
    assert p3.peak_memory_bytes < p0.peak_memory_bytes


def test_1f1b_stage_s_holds_p_minus_s_microbatches():
    p, m = 4, 8
    sim = simulate("1f1b", p, m, [1.0] * p, [2.0] * p)
    assert [sim.max_resident(s) for s in range(p)] == [p - s for s in range(p)]
    prof = synthetic_profile()
    pred = estimate(_plan(pp=p, num_microbatches=m), prof, parse_cluster("4xA100-80GB"))
    acts = [r["activations"] for r in pred.memory_by_rank]
    stage = 2 * 64 * MB  # two blocks per stage
    # rank s holds p-s-1 other microbatches plus the one whose piece walk peaks
    assert [a // stage for a in acts[:3]] == [3, 2, 1]
    assert acts == sorted(acts, reverse=True)


def test_bpipe_respects_the_bound_and_balances_memory():
    p, m = 4, 8
    plan_1f1b = _plan(pp=p, num_microbatches=m)
    plan_bpipe = _plan(pp=p, num_microbatches=m, schedule="bpipe")
    bound = plan_bpipe.eviction_bound
    sim = simulate("bpipe", p, m, [1.0] * p, [2.0] * p, bound=bound, move=[0.1] * p)
    assert max(sim.max_resident(s) for s in range(p)) <= bound
    assert any(e.kind == "evict" for e in sim.events) and any(e.kind == "load" for e in sim.events)
    prof, cl = synthetic_profile(), parse_cluster("4xA100-80GB")
    a = [device_bytes(r) for r in estimate(plan_1f1b, prof, cl).memory_by_rank]
    b = [device_bytes(r) for r in estimate(plan_bpipe, prof, cl).memory_by_rank]
    assert b[0] < a[0] and b[3] > a[3]  # stage 0 sheds activations to its partner, stage 3
    assert max(b) - min(b) < max(a) - min(a)


def test_offload_moves_bytes_to_host():
    prof, cl = synthetic_profile(), parse_cluster("2xRTX4090")
    base = estimate(_plan(dp=2, block=BlockPlan(zero=1)), prof, cl).memory_by_rank[0]
    off = estimate(_plan(dp=2, block=BlockPlan(zero=1, placement="host_step")), prof, cl).memory_by_rank[0]
    assert off["host:optimizer_states"] == 8 * 8 * 10_000_000 // 2
    assert off["host:master_weights"] == off["host:gradients"] == 8 * 4 * 10_000_000 // 2
    assert off["host:staging"] == 8 * 2 * 10_000_000 // 2  # the bf16 copy of the masters for the copy back
    assert off["optimizer_states"] < base["optimizer_states"] and off["parameters"] < base["parameters"]
    acts = estimate(_plan(dp=2, block=BlockPlan(activations="offload")), prof, cl).memory_by_rank[0]
    assert acts["host:activations"] >= 8 * 64 * MB
    assert acts["activations"] < base["activations"]
    params = estimate(_plan(dp=2, block=BlockPlan(zero=3, placement="params_on_host")), prof, cl).memory_by_rank[0]
    assert params["host:parameters"] == 8 * 10_000_000 * 4 // 2 and params["parameters"] < base["parameters"] / 10
    assert params["host:gradients"] > 0 and "host:master_weights" not in params


def test_zero2_copies_are_freed_after_each_block_backward_and_reduce_buffers_held():
    """FSDP2 reshards a zero 0-2 block after its backward, and holds the reduce-scatter input of the block just
    reduced (fp32) and, with one microbatch, the head's unsharded gradient: with recomputation the peak is the
    second block's backward of the backward that syncs, one block's copy already freed."""
    prof, cl = synthetic_profile(saved=8 * MB), parse_cluster("8xA100-80GB")
    m = estimate(_plan(dp=8, block=BlockPlan(zero=2, activations="recompute")), prof, cl).memory_by_rank[0]
    copy = 10_000_000 * 2  # one block's bf16 gathered copy
    root_copy = 2 * 1_000_000 * 2  # embed and head, zero 2: gathered too
    assert m["comm_buffers"] == 7 * copy + root_copy  # 8 blocks, the last one's freed
    assert m["reduce_buffers"] == 4 * 10_000_000 + (2 * 1_000_000 - 4 * 1_000_000 // 8)


def test_recompute_policies_shrink_activations():
    prof, cl = synthetic_profile(saved=512 * MB), parse_cluster("A100-80GB")
    peaks = {pol: estimate(_plan(block=BlockPlan(activations=pol)), prof, cl).peak_memory_bytes
             for pol in ("keep", "selective", "recompute")}
    assert peaks["recompute"] < peaks["selective"] < peaks["keep"]


@pytest.mark.parametrize("mbs,m,policy,attention", [
    (4, 1, "keep", "eager"), (2, 2, "keep", "sdpa"), (4, 1, "recompute", "sdpa"), (4, 2, "selective", "eager"),
])
def test_predicted_peak_within_5_percent_of_memtracker_on_cpu(mbs, m, policy, attention):
    from snugfit.profile import profile_model
    from snugfit.calibrate.step import measure_single_process

    cfg = ModelConfig(arch="llama", dim=32, n_layers=2, n_heads=2, vocab_size=512, max_seq_len=96, attention=attention)
    plan = Plan.uniform(2, block=BlockPlan(activations=policy), root=BlockPlan(), micro_batch_size=mbs,
                        num_microbatches=m, seq_len=96)
    pred = estimate(plan, profile_model(cfg, micro_batch_size=mbs, seq_len=96, use_cache=False), parse_cluster("cpu"))
    measured = measure_single_process(cfg, plan, steps=0).peak_bytes
    assert pred.peak_memory_bytes == pytest.approx(measured, rel=0.05)


def test_start_up_counts_one_whole_tensor_per_rank_beyond_the_shards():
    """Before the first step each rank fills its shards one whole fp32 tensor at a time (runtime.apply.read_weights):
    a node needs its ranks' host memory plus that tensor per rank, and a card its shards plus that tensor."""
    from dataclasses import replace

    from snugfit.plan.estimate import node_host_need
    from snugfit.plan.footprint import largest_tensor_bytes

    prof = replace(synthetic_profile(), config={"dim": 4096, "vocab_size": 32000, "ffn_dim": 11008})
    assert largest_tensor_bytes(prof) == 4 * 4096 * 32000  # the embedding
    cl = parse_cluster("8xA100-80GB")
    plan = _plan(dp=8, block=BlockPlan(zero=3, placement="host_step"))
    pred = estimate(plan, prof, cl)
    need, start = node_host_need(plan, prof, cl, pred.memory_by_rank, 0)
    assert start == need + 8 * 4 * 4096 * 32000
    assert pred.fits and pred.startup_bytes["host"] == start
    assert pred.startup_bytes["device"] == max(
        m.get("parameters", 0) + m.get("frozen_parameters", 0) for m in pred.memory_by_rank) + 4 * 4096 * 32000
    between = replace(cl, nodes=[replace(cl.nodes[0], host=replace(cl.nodes[0].host, ram_bytes=int(
        (need + start) / 2 / 0.9)))])  # training fits the RAM, start-up does not
    pred = estimate(plan, prof, between)
    assert not pred.fits and pred.host_memory == {"node": 0, "training": need, "startup": start,
                                                  "ram": int((need + start) / 2 / 0.9), "assumed": True}