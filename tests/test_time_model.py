"""Time model: collectives, pipeline bubbles, overlap, recompute, offload, and heterogeneous ranks."""

import pytest

from snugfit.hardware import get_link, parse_cluster
from snugfit.plan.estimate import estimate
from snugfit.plan.plan import BlockPlan, Plan
from snugfit.plan.policies import ACTIVATION_POLICIES
from snugfit.plan.simulate import simulate
from snugfit.model.decoder import ModelConfig
from snugfit.plan.kernels import attention_rates, gemm_seconds
from snugfit.plan.timing import piece_compute, recompute_time, ring_time
from snugfit.profile import profile_model
from tests.test_memory_model import _plan, synthetic_profile


def test_ring_collectives():
    link = get_link("pcie4")
    big = 1e9
    assert ring_time("all_gather", big, 1, link) == 0.0
    ag = ring_time("all_gather", big, 4, link)
    assert ag == pytest.approx(3 * link.latency_s + 0.75 * big / (link.bus_gbps * 1e9))
    assert ring_time("all_reduce", big, 4, link) == pytest.approx(2 * ag)
    assert ring_time("reduce_scatter", big, 4, get_link("eth-10g")) > 10 * ag


def test_1f1b_bubble_is_p_minus_1_stage_times():
    p, m, f, b = 4, 8, 1.0, 2.0
    sim = simulate("1f1b", p, m, [f] * p, [b] * p)
    assert sim.makespan == pytest.approx((m + p - 1) * (f + b))
    assert all(sim.bubble(r) == pytest.approx((p - 1) * (f + b)) for r in range(p))


def test_interleaving_halves_the_bubble():
    p, m = 4, 8
    plain = simulate("1f1b", p, m, [1.0] * p, [2.0] * p)
    inter = simulate("interleaved", p, m, [0.5] * 2 * p, [1.0] * 2 * p, v=2)
    assert inter.bubble(0) == pytest.approx(plain.bubble(0) / 2, rel=0.05)


def test_no_pipeline_no_bubble_and_accumulation_scales():
    prof, cl = synthetic_profile(), parse_cluster("A100-80GB")
    one = estimate(_plan(num_microbatches=1), prof, cl)
    four = estimate(_plan(num_microbatches=4), prof, cl)
    assert one.time_by_phase["bubble"] == pytest.approx(0.0, abs=1e-9)
    assert four.time_by_phase["compute"] == pytest.approx(4 * one.time_by_phase["compute"])
    assert four.tokens_per_s > one.tokens_per_s  # the optimizer step is amortised


def test_phases_sum_to_step_time():
    prof, cl = synthetic_profile(), parse_cluster("2x4xRTX4090")
    plan = _plan(dp=4, pp=2, num_microbatches=8, block=BlockPlan(zero=3, activations="selective"))
    pred = estimate(plan, prof, cl)
    assert sum(pred.time_by_phase.values()) == pytest.approx(pred.step_time_s)
    assert pred.time_by_phase["bubble"] > 0 and pred.time_by_phase["dp_comm_exposed"] > 0
    assert 0 < pred.mfu < 1


def test_recompute_adds_a_forward_selective_less():
    prof, cl = synthetic_profile(), parse_cluster("A100-80GB")
    t = {pol: estimate(_plan(block=BlockPlan(activations=pol)), prof, cl).time_by_phase["recompute"]
         for pol in ("keep", "selective", "recompute")}
    fwd = sum(piece_compute(b, cl.gpu_of(0), "bfloat16", None)[0] for b in prof.blocks)
    assert t["keep"] == 0 and t["recompute"] == pytest.approx(fwd) and 0 < t["selective"] < t["recompute"]


def test_selective_half_adds_the_forward_gemms_it_dropped():
    """On a GPU, selective_half's replay is selective's plus the forward GEMMs of k, o and up (the 2nd, 4th and 6th
    linear layers, by the tile model); full recomputation costs more than both."""
    cfg = ModelConfig(arch="llama", dim=2048, n_layers=1, n_heads=16, vocab_size=256, max_seq_len=4096)
    blk = profile_model(cfg, micro_batch_size=4, seq_len=4096, dtype="bfloat16", use_cache=False,
                        kernels="cuda").blocks[0]
    gpu = parse_cluster("A100-80GB").gpu_of(0)
    fwd = piece_compute(blk, gpu, "bfloat16", None)[0]
    t = {pol: recompute_time(blk, ACTIVATION_POLICIES[pol], fwd, gpu, "bfloat16", None)
         for pol in ("selective", "selective_half")}
    dropped = gemm_seconds([blk.gemms[i] for i in (1, 3, 5)], gpu, "bfloat16", 0.0)[0]
    assert dropped > 0.2 * t["selective"]
    assert t["selective_half"] == pytest.approx(t["selective"] + dropped)
    assert t["selective_half"] < fwd


def test_slow_link_exposes_zero3_communication():
    prof = synthetic_profile()
    plan = _plan(dp=8, block=BlockPlan(zero=3), root=BlockPlan(zero=3))
    fast = estimate(plan, prof, parse_cluster("8xH100-80GB"))
    slow = estimate(plan, prof, parse_cluster("8x1xH100-80GB", inter="eth-10g"))
    assert slow.time_by_phase["dp_comm_exposed"] > 10 * fast.time_by_phase["dp_comm_exposed"]
    assert slow.step_time_s > fast.step_time_s


def test_host_optimizer_and_faster_gpus():
    prof = synthetic_profile()
    cl = parse_cluster("RTX4090")
    dev = estimate(_plan(), prof, cl)
    host = estimate(_plan(block=BlockPlan(placement="host_step"), root=BlockPlan(placement="host_step")), prof, cl)
    assert host.time_by_phase["optimizer"] < dev.time_by_phase["optimizer"]
    assert host.step_time_s >= dev.step_time_s - dev.time_by_phase["optimizer"]
    assert estimate(_plan(), prof, parse_cluster("H100")).step_time_s < estimate(_plan(), prof, parse_cluster("T4")).step_time_s


def test_the_host_optimizer_hides_behind_a_gpus_backward_but_not_a_cpus():
    """Offloaded AdamW runs on the host: behind the device's work on a GPU; on a CPU device nothing else runs
    then (runtime.offload steps it in place), so all of it, the copies too, adds to the step."""
    from snugfit.hardware import Host
    from snugfit.hardware.catalogue import GPUS
    from snugfit.plan.piece_memory import rank_stages
    from snugfit.plan.timing import optimizer_time

    plan = _plan(block=BlockPlan(placement="host_step"), root=BlockPlan(placement="host_step"))
    pieces = [sp for sps in rank_stages(plan, synthetic_profile(), 0).values() for sp in sps]
    host, link = Host(adam_params_per_s=1e9), get_link("pcie4")
    kw = dict(host=host, dp=1, dtype="float32", reduce_dtype="float32", pcie=link, ranks_on_host=1)
    gpu, cpu = GPUS["RTX4090"], parse_cluster("cpu").gpu_of(0)
    alone = optimizer_time(pieces, gpu=gpu, bwd_last=0.0, **kw)[1]
    assert alone > 0 and optimizer_time(pieces, gpu=gpu, bwd_last=alone / 2, **kw)[1] == pytest.approx(alone / 2)
    assert optimizer_time(pieces, gpu=cpu, bwd_last=alone / 2, **kw)[1] == pytest.approx(alone)


def test_slowest_data_parallel_member_sets_the_pace():
    prof = synthetic_profile()
    plan = _plan(dp=2)
    mixed = estimate(plan, prof, parse_cluster("RTX4090+RTX3090"))
    fast = estimate(plan, prof, parse_cluster("2xRTX4090"))
    assert mixed.step_time_s > fast.step_time_s


def test_measured_piece_times_are_used_on_their_device():
    prof = synthetic_profile()
    prof.device = "cpu"
    for p in prof.pieces:
        p.fwd_time_s, p.bwd_time_s = 0.01, 0.02
    pred = estimate(Plan.uniform(8, seq_len=1024, compute_dtype="bfloat16", num_microbatches=2), prof,
                    parse_cluster("cpu"))
    assert pred.time_by_phase["compute"] == pytest.approx(2 * 10 * 0.03)


def _measured(prof):
    prof.device = "cpu"
    for p in prof.pieces:
        p.fwd_time_s, p.bwd_time_s = 0.01, 0.02
    return prof


def test_unmeasured_pieces_have_a_dispatch_floor_and_scaling_keeps_measured_fixed_time():
    prof, cpu = synthetic_profile(), parse_cluster("cpu").nodes[0].gpu
    block = prof.blocks[0]
    roofline = piece_compute(block, cpu, "bfloat16", None)
    block.fwd_ops = block.bwd_ops = 10_000
    floor = piece_compute(block, cpu, "bfloat16", None)
    assert floor[0] == pytest.approx(roofline[0] + 10_000 * cpu.op_overhead_s)  # CPU: dispatch adds
    h100 = parse_cluster("H100").nodes[0].gpu
    assert piece_compute(block, h100, "bfloat16", None)[0] == pytest.approx(
        max(block.fwd_flops / h100.flops_per_s("bfloat16") + block.fwd_mem_bytes / h100.mem_bytes_per_s(),
            10_000 * h100.op_overhead_s))  # GPU: the host dispatches ahead, the slower one counts
    block.fwd_time_s, block.fwd_fixed_s = 0.010, 0.004
    block.recompute_time_s, block.recompute_fixed_s = {"selective": 0.005}, {"selective": 0.004}
    wide = prof.scaled(prof.micro_batch_size * 4).blocks[0]
    assert wide.fwd_time_s == pytest.approx(0.004 + 4 * 0.006)
    assert wide.recompute_time_s["selective"] == pytest.approx(0.004 + 4 * 0.001)  # its own intercept


def test_gemm_time_counts_tile_and_wave_quantization():
    """On 4 SMs: 4 tiles are one wave, 5 tiles two (as long as 8); a dimension one past a tile multiple pays a
    whole tile; the ceiling is the dtype's, or the measured rate itself."""
    from dataclasses import replace

    from snugfit.hardware.catalogue import GPUS
    from snugfit.plan.kernels import GEMM_CEILING, TILE_K, TILE_M, gemm_time

    gpu, K = replace(GPUS["A100-80GB-SXM"], sms=4), 65536  # long enough to be above the launch floor
    one_wave = gemm_time(256, 256, K, gpu, "bfloat16")  # 2 x 2 tiles
    assert one_wave == pytest.approx(2 * TILE_M * TILE_M * K / (312e12 * GEMM_CEILING["bfloat16"] / 4))
    assert gemm_time(256, 384, K, gpu, "bfloat16") == pytest.approx(2 * one_wave)  # 6 tiles: 2 waves
    assert gemm_time(512, 256, K, gpu, "bfloat16") == pytest.approx(2 * one_wave)  # 8 tiles: 2 waves
    assert gemm_time(257, 256, K, gpu, "bfloat16") == pytest.approx(2 * one_wave)  # 6 tiles, padded
    assert gemm_time(256, 256, K + 1, gpu, "bfloat16") == pytest.approx(one_wave * (K + TILE_K) / K)
    measured = replace(gpu, matmul_efficiency=1.0)
    assert gemm_time(256, 256, K, measured, "bfloat16") == pytest.approx(one_wave * GEMM_CEILING["bfloat16"])
    # Hopper's ceiling is its own, measured: an H200 ran 4096^3 in bf16 at 716-733 TFLOPS (docs/gpu.md)
    n = 4096
    assert 716e12 <= 2 * n**3 / gemm_time(n, n, n, GPUS["H200"], "bfloat16") <= 733e12


def test_measured_attention_replaces_the_published_rates():
    """A card profile-hardware measured runs attention at its measured rate (head dim 128), carried to other head
    dims in the published rates' proportions; unmeasured, Hopper takes FlashAttention-2's share of its peak."""
    from dataclasses import replace

    from snugfit.hardware.catalogue import GPUS
    from snugfit.plan.kernels import FLASH_ATTENTION, attention_rates

    h100 = GPUS["H100-SXM"]
    assert attention_rates(h100, "bfloat16", 128) == pytest.approx((0.33 * 989e12, 0.32 * 989e12))
    measured = replace(h100, attention_tflops=[500.0, 400.0])
    assert attention_rates(measured, "bfloat16", 128) == pytest.approx((500e12, 400e12))
    (f64, b64), (f128, b128) = FLASH_ATTENTION["hopper"][64], FLASH_ATTENTION["hopper"][128]
    assert attention_rates(measured, "bfloat16", 64) == pytest.approx((500e12 * f64 / f128, 400e12 * b64 / b128))
    assert attention_rates(measured, "float32", 128) == pytest.approx((h100.flops_per_s("float32"),) * 2)
    unknown = replace(measured, arch="")  # no published rates to scale by: the measured ones as they are
    assert attention_rates(unknown, "bfloat16", 64) == pytest.approx((500e12, 400e12))


def test_linear_layers_are_recorded_and_timed_by_shape_on_gpus():
    """The profile keeps a block's linear layers as GEMM shapes (M = the microbatch's tokens), scaled with the
    micro-batch; on a GPU they are timed by plan.kernels, faster than the flat 60% for large ones."""
    from snugfit.hardware.catalogue import GPUS
    from snugfit.model import ModelConfig
    from snugfit.plan.kernels import gemm_seconds
    from snugfit.profile.cache import profile_model

    cfg = ModelConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, max_seq_len=512, ffn_dim=768)
    prof = profile_model(cfg, micro_batch_size=2, seq_len=512, use_cache=False)
    t = 2 * 512
    assert sorted(map(tuple, prof.blocks[0].gemms)) == sorted(
        [(t, 256, 256), (t, 128, 256), (t, 128, 256), (t, 256, 256), (t, 768, 256), (t, 768, 256), (t, 256, 768)])
    assert prof.scaled(4).blocks[0].gemms[0][0] == 2 * t
    gpu = GPUS["H100-SXM"]
    block = prof.scaled(64).blocks[0]
    fwd, bwd = piece_compute(block, gpu, "bfloat16", None)
    gf, gb, gf_flops, gb_flops = gemm_seconds(block.gemms, gpu, "bfloat16", 1.0)
    rate = gpu.flops_per_s("bfloat16")
    assert gf < gf_flops / rate  # large GEMMs: above the flat 60%
    bw, (af, ab) = gpu.mem_bytes_per_s(), attention_rates(gpu, "bfloat16", block.head_dim)
    floor = gpu.op_overhead_s  # per operator: the host dispatches ahead of the kernels
    assert fwd == pytest.approx(max(gf + (block.fwd_flops - gf_flops) / af + block.fwd_mem_bytes / bw,
                                    block.fwd_ops * floor))
    assert bwd == pytest.approx(max(gb + (block.bwd_flops - gb_flops) / ab + block.bwd_mem_bytes / bw,
                                    block.bwd_ops * floor))


def test_attention_runs_at_flash_attentions_rate_by_generation_and_head_dim():
    """FlashAttention-2's published shares of the peak: head dim 128 faster than 64, the backward slower than the
    forward, Hopper at a third of its peak; no FA2 (Volta, fp32): the flat rate. A measured card's share is taken
    of its measured matmul rate."""
    from dataclasses import replace

    from snugfit.hardware.catalogue import GPUS
    from snugfit.plan.kernels import FLASH_ATTENTION, GEMM_CEILING

    a100, h100 = GPUS["A100-80GB-SXM"], GPUS["H100-SXM"]
    fwd128, bwd128 = attention_rates(a100, "bfloat16", 128)
    assert (fwd128, bwd128) == (pytest.approx(0.61 * 312e12), pytest.approx(0.53 * 312e12))
    fwd64, _ = attention_rates(a100, "bfloat16", 64)
    assert fwd64 == pytest.approx(0.53 * 312e12) and bwd128 < fwd128
    assert attention_rates(a100, "bfloat16", 96)[0] == pytest.approx((fwd64 + fwd128) / 2)  # interpolated
    assert attention_rates(a100, "bfloat16", 256) == (fwd128, bwd128)  # beyond the figures: the nearer end
    assert attention_rates(h100, "bfloat16", 128)[1] == pytest.approx(0.32 * 989e12)
    flat = GPUS["V100-32GB"].flops_per_s("float16")
    assert attention_rates(GPUS["V100-32GB"], "float16", 128) == (flat, flat)
    assert attention_rates(a100, "float32", 128) == (a100.flops_per_s("float32"),) * 2
    measured = replace(a100, tflops={"bfloat16": 250.0}, matmul_efficiency=1.0)
    share = FLASH_ATTENTION["ampere"][128][0] / GEMM_CEILING["bfloat16"]
    assert attention_rates(measured, "bfloat16", 128)[0] == pytest.approx(250e12 * share)


def test_working_share_weighs_a_pipelines_work_by_how_many_ranks_run_beside_it():
    """CPU ranks beyond the cores crowd each other while they work: a pipeline's work runs mostly in its full
    steady state, so its crowding is above its average busy share (hand count for 1F1B at pp 2, 2 microbatches,
    forward 1 s and backward 2 s: 6 s of work with both ranks running, 6 s alone: (6 x 2 + 6 x 1) / (2 x 12))."""
    from snugfit.plan.simulate import simulate

    sim = simulate("1f1b", 2, 2, [1.0, 1.0], [2.0, 2.0])
    assert sim.working_share() == pytest.approx(0.75)
    assert sum(sim.busy) / (2 * sim.makespan) == pytest.approx(2 / 3)  # the average it replaces
    assert simulate("none", 1, 4, [1.0], [2.0]).working_share() == pytest.approx(1.0)
    deep = simulate("1f1b", 4, 4, [1.0] * 4, [2.0] * 4)
    assert sum(deep.busy) / (4 * deep.makespan) < deep.working_share() < 1.0


def test_gpu_ranks_pay_fsdp2s_host_time_per_unit_and_microbatch_where_the_host_is_the_bottleneck():
    """FSDP2's hooks and launches cost the host time per wrapped unit and microbatch (an H200: snugfit's engine
    spent 0.17 s of host time per step where plain PyTorch, the same operators, spent 0.08 s; docs/gpu.md). Each
    block is a unit, the root pieces one; a one-process plan with nothing sharded runs unwrapped and pays none."""
    from dataclasses import replace

    def host_bound(dtype):  # 10 ms of dispatch each way per piece, next to no kernel time
        prof = synthetic_profile(dtype=dtype)
        for p in prof.pieces:
            p.fwd_ops = p.bwd_ops = 1000
            p.fwd_flops = p.bwd_flops = p.fwd_mem_bytes = p.bwd_mem_bytes = 1e3
        return prof

    cluster = parse_cluster("H100")
    gpu = cluster.nodes[0].gpu
    wrapped = _plan(num_microbatches=2, block=BlockPlan(zero=3), root=BlockPlan(zero=3))
    charged = estimate(wrapped, host_bound("bfloat16"), cluster).time_by_phase["compute"]
    cluster.nodes[0].gpu = replace(gpu, unit_overhead_s=0.0)
    free = estimate(wrapped, host_bound("bfloat16"), cluster).time_by_phase["compute"]
    assert charged - free == pytest.approx(2 * (8 + 1) * gpu.unit_overhead_s)
    cluster.nodes[0].gpu = gpu
    plan = _plan(num_microbatches=2)
    for unwrapped, dtype in ((plan, "bfloat16"), (_plan(num_microbatches=2, compute_dtype="float32"), "float32")):
        assert unwrapped.runs_unwrapped
        assert estimate(unwrapped, host_bound(dtype), cluster).time_by_phase["compute"] == pytest.approx(free)
    # selective checkpointing's policy sees every forward operator twice, in the forward and in the replay, which
    # dispatches them all again (an H200 ran selective slower than full recompute, docs/gpu.md)
    keep = estimate(plan, host_bound("bfloat16"), cluster).time_by_phase
    selective = estimate(_plan(num_microbatches=2, block=BlockPlan(activations="selective"), root=BlockPlan()),
                         host_bound("bfloat16"), cluster).time_by_phase
    added = selective["compute"] + selective["recompute"] - keep["compute"] - keep["recompute"]
    assert added == pytest.approx(2 * 8 * 1000 * (gpu.op_overhead_s + 2 * gpu.sac_overhead_s))


def test_cpu_attention_runs_at_its_measured_rate_and_the_linear_layers_at_the_matmul_rate():
    """CPU SDPA ran at a fifth of the matmul rate (41 against 200 GFLOP/s on this machine), which the flat rate
    missed by 25% of a block's time; profile_hardware measures it and the CPU path charges attention by it."""
    from dataclasses import replace

    from snugfit.model.decoder import ModelConfig
    from snugfit.profile.cache import profile_model

    cfg = ModelConfig(arch="llama", dim=64, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=128)
    block = profile_model(cfg, micro_batch_size=2, seq_len=128, dtype="float32", use_cache=False).blocks[0]
    cpu = replace(parse_cluster("cpu").nodes[0].gpu, tflops={"float32": 0.2}, matmul_efficiency=1.0,
                  mem_efficiency=1.0, op_overhead_s=0.0, attention_tflops=[0.04, 0.05])
    fwd, bwd = piece_compute(block, cpu, "float32", None)
    gemm = sum(2.0 * m * n * k for m, n, k in block.gemms)
    attention = 2.0 * 2 * 2 * 128 * 128 * 32  # causal: 2 b h s^2 d
    assert block.fwd_flops == pytest.approx(gemm + attention)
    memory = block.fwd_mem_bytes / cpu.mem_bytes_per_s()
    assert fwd == pytest.approx(gemm / 0.2e12 + attention / 0.04e12 + memory)
    assert bwd > fwd and piece_compute(block, replace(cpu, attention_tflops=[]), "float32", None)[0] < fwd


def test_a_cpu_step_runs_its_linear_layers_and_memory_bound_operators_at_their_measured_efficiencies():
    """On this CPU, at one thread, a training step's GEMMs reached 0.8 of a square matmul's rate and its
    memory-bound operators 0.45 of a copy's bandwidth (the default model's step, each operator timed).
    profile_hardware measures both (calibrate.hardware.step_efficiencies); attention keeps its own measured rate."""
    from dataclasses import replace

    from snugfit.model.decoder import ModelConfig
    from snugfit.profile.cache import profile_model

    cfg = ModelConfig(arch="llama", dim=64, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=128)
    block = profile_model(cfg, micro_batch_size=2, seq_len=128, dtype="float32", use_cache=False).blocks[0]
    cpu = replace(parse_cluster("cpu").nodes[0].gpu, tflops={"float32": 0.2}, hbm_gbps=20.0, matmul_efficiency=0.8,
                  mem_efficiency=0.4, op_overhead_s=0.0, attention_tflops=[0.04, 0.05])
    gemm = sum(2.0 * m * n * k for m, n, k in block.gemms)
    attention = block.fwd_flops - gemm
    fwd, _ = piece_compute(block, cpu, "float32", None)
    assert fwd == pytest.approx(gemm / (0.8 * 0.2e12) + attention / 0.04e12 + block.fwd_mem_bytes / (0.4 * 20e9))


def test_a_cpu_step_pages_in_the_large_tensors_it_allocates():
    """On a CPU rank each tensor of 1 MiB or more comes from a fresh mapping whose pages the kernel zeroes at first
    touch (runtime.host_alloc): a quarter to two fifths of bench/speed.py's predicted steps here. The profile records
    those bytes per piece and phase; the time model charges them at the page-in rate profile_hardware measured."""
    from dataclasses import replace

    cfg = ModelConfig(arch="llama", dim=64, n_layers=1, n_heads=2, vocab_size=16384, max_seq_len=128)
    prof = profile_model(cfg, micro_batch_size=1, seq_len=128, dtype="float32", use_cache=False)
    logits = 128 * 16384 * 4  # 8 MiB: the head's matmul output, its softmax's, their gradients
    head, block = prof.head, prof.blocks[0]
    assert head.fwd_fresh_bytes >= 2 * logits and head.bwd_fresh_bytes >= 2 * logits
    assert block.fwd_fresh_bytes == block.bwd_fresh_bytes == 0  # its 32 KiB hidden states stay in malloc's heap
    assert prof.scaled(4).head.fwd_fresh_bytes == 4 * head.fwd_fresh_bytes
    cpu = replace(parse_cluster("cpu").nodes[0].gpu, tflops={"float32": 0.2}, op_overhead_s=0.0,
                  page_in_bytes_per_s=0.0)
    paged = replace(cpu, page_in_bytes_per_s=2e9)
    added = [b - a for a, b in zip(piece_compute(head, cpu, "float32", None),
                                   piece_compute(head, paged, "float32", None))]
    assert added == pytest.approx([head.fwd_fresh_bytes / 2e9, head.bwd_fresh_bytes / 2e9])


def test_fsdp2_copies_each_gathered_unit_out_and_each_reduced_unit_in_at_hbm_bandwidth():
    """FSDP2 splits each all-gather's output into the unit's parameters on the compute stream (its copy-out): two
    passes over the gathered bytes at the card's memory bandwidth, per gather: a ZeRO-3 block in forward and again in
    backward, the root once (its gathered copy stays through backward); nothing where nothing is gathered. Before
    each reduce-scatter it copies the gradients into the reduce buffer, also on the compute stream."""
    from snugfit.plan.piece_memory import rank_stages
    from dataclasses import replace

    from snugfit.plan.timing import grad_reduce_exposed, stage_time

    prof = synthetic_profile()
    node = parse_cluster("8xH100").nodes[0]
    kw = dict(node=node, dtype="bfloat16", reduce_dtype="float32", dp_link=get_link("nvlink4"), measured_on=None)
    sps = rank_stages(_plan(dp=8, block=BlockPlan(zero=3), root=BlockPlan(zero=3)), prof, 0)[0]
    sharded, alone = stage_time(sps, dp=8, **kw), stage_time(sps, dp=1, **kw)
    copy = [2 * sp.n_params * 2 / node.gpu.mem_bytes_per_s() for sp in sps]
    assert sharded.fwd - alone.fwd == pytest.approx(sum(copy))
    assert sharded.bwd - alone.bwd == pytest.approx(sum(c for c, sp in zip(copy, sps) if sp.is_block))
    # each reduction first copies the gradients into the fp32 reduce buffer on the compute stream: never hidden
    copy_in = sum(sp.n_trainable * (2 + 4) for sp in sps) / node.gpu.mem_bytes_per_s()
    assert sharded.reduce_copy == pytest.approx(copy_in) and alone.reduce_copy == 0.0
    exposed = [grad_reduce_exposed([(st, sps)], 8, get_link("nvlink4"), 1e9)
               for st in (sharded, replace(sharded, reduce_copy=0.0))]
    assert exposed[0] - exposed[1] == pytest.approx(copy_in)


def test_the_published_h100_runs_card_has_hbm2e_bandwidth_and_the_sxm_tensor_peak():
    """torchtitan's H100 runs used an SXM H100 with HBM2e (2.4 TB/s, 94-96 GB): named, and found from torch's name
    for it; its GEMMs take what the SXM's do, its memory-bound operators 3,350 / 2,410 as long."""
    from snugfit.hardware.catalogue import GPUS, get_gpu, gpu_for_device

    card, sxm = get_gpu("H100-HBM2e"), GPUS["H100-SXM"]
    assert card.name == "H100-SXM-HBM2e" and parse_cluster("8xH100-SXM-HBM2e").nodes[0].gpu is card
    assert gpu_for_device("NVIDIA H100", int(93.6 * 2**30)) is card
    assert gpu_for_device("NVIDIA H100 80GB HBM3", int(79.1 * 2**30)) is sxm
    gemms = [[16384, 14336, 4096]]
    assert gemm_seconds(gemms, card, "bfloat16", 1.0) == gemm_seconds(gemms, sxm, "bfloat16", 1.0)
    p = synthetic_profile().pieces[1]
    p.fwd_ops = p.bwd_ops = 0
    p.gemms, p.fwd_flops, p.bwd_flops, p.fwd_mem_bytes, p.bwd_mem_bytes = [], 0.0, 0.0, 1e10, 2e10
    on_card, on_sxm = piece_compute(p, card, "bfloat16", None), piece_compute(p, sxm, "bfloat16", None)
    assert on_card[0] / on_sxm[0] == pytest.approx(3350 / 2410) and on_card[1] > on_sxm[1]
