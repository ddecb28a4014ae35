"""Measure this machine: matmul rate per dtype, memory bandwidth, host<->device copies,
collective bandwidth between local gloo ranks, and CPU fused-AdamW throughput.

Writes the catalogue format (LocalHardware) so the time model reads measured and
datasheet hardware alike. Kept short (about 10-20 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch

from snugfit.hardware.catalogue import (
    GPU, GiB, Host, Link, LocalHardware, cuda_arch, default_cpu, hardware_cache_path,
)
from snugfit.runtime.spawn import free_port


def _best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _typical_time(fn, repeats: int) -> float:
    """The median: what a training step meets, where gloo's collectives have a long tail of slow calls
    (the best of a few is the lucky case, up to 2x below the typical one here)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _matmul_tflops(dtype: torch.dtype, n: int, device: str, sync, repeats: int = 3) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)

    def run():
        a @ b
        sync()
    return 2 * n**3 / _best_time(run, repeats) / 1e12


def attention_tflops(device: str = "cpu", b: int = 8, heads: int = 6, seq: int = 128, head_dim: int = 32) -> list[float]:
    """[forward, backward] TFLOP/s of causal SDPA in fp32, its FLOPs counted as the profiler counts them (the
    forward 2 b h s^2 d, the backward 2.5 times that). On CPU it runs at a fifth of the matmul rate (41 against
    200 GFLOP/s here), and a block's attention was the 25% its predicted time missed."""
    q, k, v = (torch.randn(b, heads, seq, head_dim, device=device, requires_grad=True) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    forward = _best_time(lambda: sdpa(q, k, v, is_causal=True), 5)
    both = _best_time(lambda: sdpa(q, k, v, is_causal=True).sum().backward(), 5)
    flops = 2.0 * b * heads * seq * seq * head_dim
    return [flops / forward / 1e12, 2.5 * flops / max(both - forward, 1e-9) / 1e12]


def _copy_gbps(nbytes: int, src: str, dst: str, sync) -> float:
    """Copy rate src -> dst; host memory is pinned when the other side is an accelerator, as offload's
    copies are (a pageable side halves the rate and makes the copy blocking)."""
    pin = src != dst and "cpu" in (src, dst)
    x = torch.empty(nbytes // 4, device=src, pin_memory=pin and src == "cpu")
    y = torch.empty(nbytes // 4, device=dst, pin_memory=pin and dst == "cpu")

    def run():
        y.copy_(x, non_blocking=pin)
        sync()
    moved = nbytes if src != dst else 2 * nbytes  # a same-device copy reads and writes
    return moved / _best_time(run, 3) / 1e9


def _duplex_gbps(nbytes: int, dev: str, sync) -> float:
    """Per-direction rate with host->device and device->host copies running at once on two streams (pinned):
    a PCIe 4.0 link moving 24-26 GB/s one way gives 11-16 GB/s each way when both run."""
    module, pin = torch.get_device_module(dev), dev != "cpu"
    host_in, host_out = (torch.empty(nbytes // 4, pin_memory=pin) for _ in range(2))
    dev_in, dev_out = (torch.empty(nbytes // 4, device=dev) for _ in range(2))
    up, down = module.Stream(), module.Stream()

    def run():
        with module.stream(up):
            dev_in.copy_(host_in, non_blocking=True)
        with module.stream(down):
            host_out.copy_(dev_out, non_blocking=True)
        sync()
    return nbytes / _best_time(run, 3) / 1e9


def dispatch_costs(device: str, sync) -> tuple[float, float]:
    """(host seconds per operator as a model runs them, what selective checkpointing adds per forward operator and
    pass), from a tiny decoder whose kernels take next to nothing, so that its dispatch is its time (nn.Module
    calls, autograd, the dispatcher): its step over the operators the profiler counts for it, and its step under
    selective against full recomputation over its blocks' forward operators, run twice (forward and replay).
    A chain of bare multiplies measured 12.5-13.6 us per operator on an H200's host, where plain PyTorch's Llama
    step took 10.3 us per counted operator (docs/gpu.md)."""
    from snugfit.model.decoder import Decoder, ModelConfig
    from snugfit.profile.profile import profile_model
    from snugfit.runtime.activations import apply_activation_policy

    cfg = ModelConfig(arch="llama", dim=32, n_layers=4, n_heads=2, vocab_size=64, max_seq_len=8)
    tokens = torch.randint(0, cfg.vocab_size, (1, 9), device=device)
    step = {}
    for policy in ("keep", "recompute", "selective"):
        with torch.device(device):
            model = Decoder(cfg)
        for block in model.blocks.values():
            apply_activation_policy(block, policy)

        def run():
            model(tokens[:, :-1], tokens[:, 1:]).backward()
            sync()
        step[policy] = _best_time(run, 10)
    prof = profile_model(cfg, micro_batch_size=1, seq_len=8, dtype="float32",
                         kernels="cpu" if device == "cpu" else "gpu", use_cache=False)
    passes = 2 * sum(b.fwd_ops for b in prof.blocks)
    return (step["keep"] / sum(p.fwd_ops + p.bwd_ops for p in prof.pieces),
            max(0.0, step["selective"] - step["recompute"]) / passes)


def _adam_params_per_s(n: int) -> float:
    p = torch.zeros(n, requires_grad=True)
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    return n / _best_time(opt.step, 3)


FSDP_UNITS = 4  # blocks timed for FSDP2's own costs
FSDP_WIDTHS = (32, 256)  # two block widths: a line through them gives a fixed and a per-byte cost


def _fsdp_costs(world: int) -> dict[str, list[float]]:
    """FSDP2's costs between `world` ranks on this machine's CPU, each as [seconds, seconds per byte of the
    unit's parameters], for units wrapped as runtime/sharding.py wraps them: "replicate" per unit and
    microbatch of zero 0 (HSDP over (world, 1): copies and hooks, no collective), "gather" the same for zero 1-2
    (forward all-gather), "regather" the extra of zero 3 (backward gathers again); per unit and step,
    "allreduce" (zero 0) and "reduce" (zero 1-3, reduce-scatter) for the gradient sync, and "update": the
    runtime's update of the unit's DTensors (global norm, AdamW) beyond what a plain fused AdamW costs.

    Measured rather than derived from the link: on CPU these collectives, FSDP2's copies and
    its hooks share the cores with compute, and dominate the step of a small model. The units are the
    built-in decoder's blocks (and its root: embedding, norm, head), at two widths: FSDP2's cost depends on
    the unit's tensors and hooks, not only its bytes, and the planner applies it to decoder blocks.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from snugfit.model.decoder import Decoder, ModelConfig
    from snugfit.runtime.engine import OptimConfig, global_grad_norm, make_adamw

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "one"))
    meshes = {"replicate": mesh, "shard": mesh["dp"]}
    units = FSDP_UNITS + 1  # the blocks and the root

    def step_time(cfg: ModelConfig, wrap: str | None = None, reshard: bool = False, sync: bool = False,
                  update: bool = False) -> float:
        """Seconds per unit of a forward and backward (and, with `update`, the runtime's update after it)."""
        torch.manual_seed(0)
        model = Decoder(cfg)
        if wrap is not None:
            for block in model.blocks.values():
                fully_shard(block, mesh=meshes[wrap], reshard_after_forward=reshard)
            fully_shard(model, mesh=meshes[wrap])
            model.set_requires_gradient_sync(sync)
        tokens = torch.randint(0, cfg.vocab_size, (1, cfg.max_seq_len + 1))
        params = list(model.parameters())
        optimizer = make_adamw(params, OptimConfig())

        def step():
            model(tokens[:, :-1], tokens[:, 1:]).backward()
            if update:
                global_grad_norm([(p, p.grad) for p in params], torch.device("cpu")).item()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        step()
        torch.distributed.barrier()
        return _typical_time(step, 9) / units

    points: dict[str, list[tuple[float, float]]] = {}
    for width in FSDP_WIDTHS:
        cfg = ModelConfig(dim=width, n_layers=FSDP_UNITS, n_heads=4, vocab_size=64, max_seq_len=16)
        nbytes = 4 * sum(p.numel() for p in Decoder(cfg).blocks["0"].parameters())
        plain, kept = step_time(cfg), step_time(cfg, "shard")
        replicated = step_time(cfg, "replicate")
        synced = step_time(cfg, "replicate", sync=True)
        plain_update = step_time(cfg, update=True) - plain  # the time model's fused AdamW rate covers this
        for name, t in (("replicate", replicated - plain), ("gather", kept - plain),
                        ("regather", step_time(cfg, "shard", reshard=True) - kept),
                        ("allreduce", synced - replicated), ("reduce", step_time(cfg, "shard", sync=True) - kept),
                        ("update", step_time(cfg, "replicate", sync=True, update=True) - synced - plain_update)):
            points.setdefault(name, []).append((nbytes, max(t, 0.0)))
    out = {}
    for name, ((b1, t1), (b2, t2)) in points.items():
        per_byte = max((t2 - t1) / (b2 - b1), 0.0)
        out[name] = [max(t1 - per_byte * b1, 0.0), per_byte]
    return out


def _tensor_parallel_cost(world: int) -> float:
    """Seconds per block and microbatch that tensor parallelism over `world` ranks adds on CPU ranks beyond the
    split compute: DTensor's per-operator dispatch and redistribution, and its collectives' latency. Measured on
    a decoder so narrow that its compute is negligible, through runtime.tensor_parallel itself."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from snugfit.model.decoder import Decoder, ModelConfig
    from snugfit.runtime.tensor_parallel import apply_tp

    cfg = ModelConfig(dim=8 * world, n_layers=FSDP_UNITS, n_heads=world, vocab_size=16 * world, max_seq_len=4 * world)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.max_seq_len + 1))

    def step_time(model: Decoder, loss: Callable = nullcontext) -> float:
        def step():
            with loss():  # the split head's logits stay split by vocabulary: torch's loss_parallel, as engines run it
                model(tokens[:, :-1], tokens[:, 1:]).backward()
        step()
        torch.distributed.barrier()
        return _typical_time(step, 9)

    torch.manual_seed(0)
    plain = step_time(Decoder(cfg))
    split = Decoder(cfg)
    apply_tp(split, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    return max(0.0, step_time(split, loss_parallel) - plain) / (FSDP_UNITS + 2)  # per piece: blocks, embedding, head


PIPE_EXTRA_MICROBATCHES = 6  # two 1F1B steps, with as many microbatches as stages and this many more


def _pipeline_stage_cost(world: int, replicate: list[float]) -> float:
    """Seconds per microbatch and pipeline stage that the pipeline runtime adds on CPU ranks beyond compute and
    FSDP2 (PipelineStage's bookkeeping, point-to-point transfers that spend both ranks' cores, per-microbatch
    activation accounting): the slope over microbatches of a 1F1B step through `world` one-block stages of a
    tiny decoder, less what the time model already charges a stage per microbatch (its two FSDP2 units as
    `replicate`, and its compute). Measured through the runtime itself: those costs are its own."""
    from snugfit.model.decoder import Decoder, ModelConfig
    from snugfit.plan.plan import Plan
    from snugfit.runtime.build import build_engine
    from snugfit.runtime.dist import DistEnv
    from snugfit.runtime.engine import OptimConfig

    cfg = ModelConfig(dim=16, n_layers=world, n_heads=2, vocab_size=32, max_seq_len=8)
    rank = torch.distributed.get_rank()
    env = DistEnv(rank, world, rank, torch.device("cpu"))

    def step_time(m: int) -> float:
        plan = Plan.uniform(world, dp=1, pp=world, schedule="1f1b", micro_batch_size=1, num_microbatches=m,
                            seq_len=cfg.max_seq_len)
        torch.manual_seed(0)
        engine = build_engine(Decoder(cfg), plan, OptimConfig(), env)
        engine.track_memory = False
        tokens = torch.randint(0, cfg.vocab_size, (m, cfg.max_seq_len + 1))
        engine.train_step(tokens)
        torch.distributed.barrier()
        return _typical_time(lambda: engine.train_step(tokens), 7)

    slope = (step_time(world + PIPE_EXTRA_MICROBATCHES) - step_time(world)) / PIPE_EXTRA_MICROBATCHES
    model = Decoder(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.max_seq_len + 1))
    compute = _typical_time(lambda: model(tokens[:, :-1], tokens[:, 1:]).backward(), 7) / world
    return max(0.0, slope - 2 * replicate[0] - compute)


def _compute_probe() -> float:
    """Seconds of a fixed single-threaded matmul loop (about 0.3 s here): timed alone, then on every rank at
    once. The whole loop, not the best of short runs: ranks crowding the cores take turns in time slices."""
    a = torch.randn(256, 256)
    a @ a
    t0 = time.perf_counter()
    for _ in range(300):
        a @ a
    return time.perf_counter() - t0


def _collective_worker(rank: int, world: int, port: int, out: str, nbytes: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        x = torch.ones(nbytes // 4)
        small = torch.ones(1)
        dist.all_reduce(x)
        dist.barrier()
        lat = _best_time(lambda: dist.all_reduce(small), 5)
        t = _best_time(lambda: dist.all_reduce(x), 3)
        fsdp = _fsdp_costs(world)
        fsdp["stage"] = [_pipeline_stage_cost(world, fsdp["replicate"]), 0.0]
        fsdp["tp"] = [_tensor_parallel_cost(world), 0.0]
        dist.barrier()
        together = _compute_probe()
        if rank == 0:
            # ring all-reduce moves 2 (w-1)/w of the buffer over each rank's link
            gbps = 2 * (world - 1) / world * nbytes / max(t - lat, 1e-9) / 1e9
            Path(out).write_text(json.dumps({"gbps": gbps, "latency": lat, "fsdp": fsdp, "together": together}))
    finally:
        dist.destroy_process_group()


def measure_collectives(world: int = 2, nbytes: int = 16 * 2**20) -> tuple[Link, dict[str, list[float]], float]:
    """All-reduce bus bandwidth and latency between `world` local gloo processes, FSDP2's costs there
    (`_fsdp_costs`), and how long `_compute_probe` takes while every rank runs it."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result")
        # fork where there is one: the children skip re-importing torch (seconds on a busy machine); not after
        # an accelerator ran here (profile-hardware on a GPU machine): autograd's device threads do not survive it
        method = "fork" if "fork" in mp.get_all_start_methods() and not torch.accelerator.is_available() else "spawn"
        mp.start_processes(_collective_worker, args=(world, free_port(), out, nbytes), nprocs=world, join=True,
                           start_method=method)
        r = json.loads(Path(out).read_text())
    return Link("gloo-loopback", r["gbps"], r["latency"]), r["fsdp"], r["together"]


MAX_CROWDED = 8  # most local ranks measured (twice the cores, on machines small enough to be crowded)


def thread_slowdown(n: int = 768) -> float:
    """How many times slower a matmul as large as the device's rate was measured with runs on one thread than
    on all this process has (small ones never spread over threads)."""
    # 30 repeats: the first calls after the thread count changes run before the pool has its threads going, and
    # the best of 3 read 1.02-1.06 here in five tries of six where 30 read 1.8-2.0 every time
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    one = _matmul_tflops(torch.float32, n, "cpu", lambda: None, repeats=30)
    torch.set_num_threads(threads)
    return max(1.0, _matmul_tflops(torch.float32, n, "cpu", lambda: None, repeats=30) / one)


def measure_local_ranks(host: Host) -> Link:
    """Fill host.fsdp for 2 local ranks and for twice as many ranks as cores (where ranks crowd the cores);
    return the gloo link measured between 2."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs
    alone = _compute_probe()
    torch.set_num_threads(threads)
    link = None
    for world in sorted({2} | ({2 * host.cores} if 2 * host.cores <= MAX_CROWDED else set())):
        measured, costs, together = measure_collectives(world)
        link = link or measured
        host.fsdp[str(world)] = {**costs, "contention": [max(1.0, together / alone)]}
    return link


def host_ram() -> int:
    """This machine's physical memory in bytes."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


def measure_accelerator(name: str, dev: str | None = None, size: int = 4096) -> tuple[GPU, Link]:
    """The current accelerator as a GPU entry named `name` (its memory from the device's properties, its
    rates measured here, a few seconds), and its host link: the slowest of either direction alone and both
    at once, as offload moves the next unit's parameters in while the last one's gradients go out."""
    dev = dev or torch.accelerator.current_accelerator().type
    sync = torch.accelerator.synchronize if dev != "cpu" else lambda: None  # CPU tests run it on the CPU
    props = torch.cuda.get_device_properties(torch.accelerator.current_device_index()) if dev == "cuda" else None
    mem = props.total_memory if props else 16 * GiB
    dtypes = [torch.float32, torch.float16]
    if props is None or props.major >= 8:  # bf16 tensor cores from Ampere on; older cards only emulate it
        dtypes.append(torch.bfloat16)
    tflops = {str(d).removeprefix("torch."): _matmul_tflops(d, size, dev, sync) for d in dtypes}
    copy_bytes = size * size * 16  # 256 MiB at the default size
    h2d = _copy_gbps(copy_bytes, "cpu", dev, sync)
    d2h = _copy_gbps(copy_bytes, dev, "cpu", sync)
    duplex = _duplex_gbps(copy_bytes, dev, sync)
    hbm = _copy_gbps(2 * copy_bytes, dev, dev, sync)
    link = Link("pcie-local", min(h2d, d2h, duplex), 10e-6)
    pcie_gen = 5 if link.gbps >= 40 else 4 if link.gbps >= 18 else 3  # one direction, pinned: ~50 / ~25 / ~12 GB/s
    per_op, selective = dispatch_costs(dev, sync)
    gpu = GPU(name, mem, tflops, hbm, pcie_gen, None, matmul_efficiency=1.0, mem_efficiency=1.0,
              op_overhead_s=per_op, sac_overhead_s=selective, sms=props.multi_processor_count if props else 0,
              arch=cuda_arch(props.major, props.minor) if props and not torch.version.hip else "")
    return gpu, link


def profile_hardware(out: str | Path | None = None, collectives: bool = True) -> LocalHardware:
    """Measure this machine and cache the result (default ~/.cache/snugfit/hardware.json)."""
    host = Host(ram_bytes=host_ram(), adam_params_per_s=_adam_params_per_s(2_000_000), cores=os.cpu_count() or 1)
    links: dict[str, Link] = {}
    if torch.accelerator.is_available():
        device, links["pcie-local"] = measure_accelerator(f"local-{torch.accelerator.current_accelerator().type}")
    else:
        sync = lambda: None  # noqa: E731
        base = default_cpu()
        tflops = {"float32": _matmul_tflops(torch.float32, 768, "cpu", sync),
                  "bfloat16": _matmul_tflops(torch.bfloat16, 128, "cpu", sync)}
        hbm = _copy_gbps(32 * 2**20, "cpu", "cpu", sync)
        host.thread_slowdown = thread_slowdown()
        per_op, selective = dispatch_costs("cpu", sync)
        device = GPU("cpu", host.ram_bytes, tflops, hbm, 0, None, "gloo-loopback",
                     matmul_efficiency=base.matmul_efficiency, mem_efficiency=base.mem_efficiency, context_bytes=0,
                     op_overhead_s=per_op, sac_overhead_s=selective, attention_tflops=attention_tflops())
    if collectives:
        links["gloo-loopback"] = measure_local_ranks(host)
    local = LocalHardware(device, host, links)
    local.save(out or hardware_cache_path())
    return local
