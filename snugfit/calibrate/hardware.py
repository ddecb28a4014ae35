"""Measure this machine: matmul rate per dtype, memory bandwidth, host<->device copies, the host's dispatch,
CPU fused-AdamW throughput, and (calibrate.local_ranks) what local gloo ranks cost each other.

Writes the catalogue format (LocalHardware) so the time model reads measured and
datasheet hardware alike. Kept short (about 10-20 s on 2 cores).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from snugfit.calibrate.local_ranks import measure_local_ranks
from snugfit.calibrate.timers import best_time, clock, current_clock
from snugfit.hardware.catalogue import (
    GPU, GiB, Host, Link, LocalHardware, cuda_arch, hardware_cache_path, host_ram,
)
from snugfit.hardware.load import OtherLoad, is_busy
from snugfit.profile.record import op_cost
from snugfit.runtime.host_alloc import return_freed_host_memory

log = logging.getLogger(__name__)


def _matmul_tflops(dtype: torch.dtype, n: int, device: str, sync, repeats: int = 3) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)

    def run():
        a @ b
        sync()
    return 2 * n**3 / best_time(run, repeats) / 1e12


def attention_tflops(device: str = "cpu", b: int = 8, heads: int = 6, seq: int = 128, head_dim: int = 32,
                     dtype: torch.dtype = torch.float32, sync=lambda: None) -> list[float]:
    """[forward, backward] TFLOP/s of causal SDPA, its FLOPs counted as the profiler counts them (the forward
    2 b h s^2 d, the backward 2.5 times that), through whichever kernel torch picks for this shape. On CPU it runs
    at a fifth of the matmul rate (41 against 200 GFLOP/s here), and a block's attention was the 25% its predicted
    time missed. On a GPU it is what the published flash attention rates stand for until measured: torch 2.11
    ran cuDNN's kernels on an H200, not the FlashAttention-2 whose rates plan.kernels assumes."""
    q, k, v = (torch.randn(b, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def forward():
        sdpa(q, k, v, is_causal=True)
        sync()

    def both():
        sdpa(q, k, v, is_causal=True).sum().backward()
        sync()
    flops = 2.0 * b * heads * seq * seq * head_dim
    fwd = best_time(forward, 5)
    return [flops / fwd / 1e12, 2.5 * flops / max(best_time(both, 5) - fwd, 1e-9) / 1e12]


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
    return moved / best_time(run, 3) / 1e9


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
    return nbytes / best_time(run, 3) / 1e9


def dispatch_costs(device: str, sync) -> tuple[float, float]:
    """(host seconds per operator as a model runs them, what selective checkpointing adds per forward operator and
    pass), from a tiny decoder whose kernels take next to nothing, so that its dispatch is its time (nn.Module
    calls, autograd, the dispatcher): its step over the operators the profiler counts for it, and its step under
    selective against full recomputation over its blocks' forward operators, run twice (forward and replay).
    A chain of bare multiplies measured 12.5-13.6 us per operator on an H200's host, where plain PyTorch's Llama
    step took 10.3 us per counted operator (docs/gpu.md)."""
    from snugfit.model.decoder import Decoder, ModelConfig
    from snugfit.profile.cache import profile_model
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
        step[policy] = best_time(run, 10)
    prof = profile_model(cfg, micro_batch_size=1, seq_len=8, dtype="float32",
                         kernels="cpu" if device == "cpu" else "gpu", use_cache=False)
    passes = 2 * sum(b.fwd_ops for b in prof.blocks)
    return (step["keep"] / sum(p.fwd_ops + p.bwd_ops for p in prof.pieces),
            max(0.0, step["selective"] - step["recompute"]) / passes)


def minor_faults() -> int:
    """Pages the kernel has mapped into this process at their first touch so far (all its threads)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def seconds_per_page_fault(nbytes: int = 64 * 2**20, repeats: int = 3) -> float:
    """Seconds the kernel takes to zero and map one page of fresh memory at its first touch: an anonymous mapping
    written once, against writing it again (1-1.5 us a 4 KiB page on this project's 2-core CPU)."""
    best = float("inf")
    for _ in range(repeats):
        with mmap.mmap(-1, nbytes) as pages:
            memory = torch.frombuffer(pages, dtype=torch.uint8)
            before, t0 = minor_faults(), clock()
            memory.fill_(1)
            first, faults = clock() - t0, minor_faults() - before
            t0 = clock()
            memory.fill_(2)
            again = clock() - t0
            del memory  # the mapping closes only once no tensor views it
        best = min(best, max(0.0, first - again) / max(faults, 1))
    return best


class _OpTimer(TorchDispatchMode):
    """A real step's operators in order, each as (roofline kind, its FLOPs or bytes, seconds, page faults)
    (profile.record.op_cost): each operator's kernel timed where it is dispatched, below autograd and the module
    calls (op_overhead_s's part); and the bytes of the large tensors they allocate (OpCost.fresh_bytes)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, float, float, int]] = []
        self.fresh_bytes = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before, t0 = minor_faults(), clock()
        out = func(*args, **kwargs)
        seconds, faults = clock() - t0, minor_faults() - before
        cost = op_cost(func, args, kwargs, out)
        self.ops.append((cost.kind, cost.flops + cost.mem_bytes, seconds, faults))
        self.fresh_bytes += cost.fresh_bytes
        return out

    def totals(self, kind: str) -> tuple[float, float]:
        """(FLOPs or bytes, seconds) of the operators of one kind."""
        ops = [(work, seconds) for k, work, seconds, _ in self.ops if k == kind]
        return sum(w for w, _ in ops), sum(s for _, s in ops)


def in_own_process(fn: Callable, *args):
    """fn(*args) in a new interpreter with this one's torch threads and probe clock (fn module-level; its arguments
    and result JSON): a measurement of what a run meets from its start, which this process's history would change
    (the host allocator serves a step's large tensors from whatever earlier work left in its heap). A subprocess
    rather than multiprocessing's spawn, which runs the caller's main script again where it has no __main__ guard."""
    code = ("import importlib, json, sys, time, torch; from snugfit.calibrate import timers; "
            "threads, clock, module, name, args = json.loads(sys.argv[1]); torch.set_num_threads(threads); "
            "timers.use_clock(getattr(time, clock)); "
            "print(json.dumps(getattr(importlib.import_module(module), name)(*args)))")
    spec = [torch.get_num_threads(), current_clock().__name__, fn.__module__, fn.__qualname__, list(args)]
    done = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{fn.__qualname__} in a process of its own failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def step_efficiencies(matmul_flops_per_s: float, copy_bytes_per_s: float,
                      repeats: int = 5) -> tuple[float, float, float]:
    """(matmul_efficiency, mem_efficiency, page_in_bytes_per_s) of this CPU: the rates a decoder's training step
    reaches, against the large square matmul and the plain copy the device's rates were measured with, and how fast
    it pages in its fresh tensors. In a step the caches hold other tensors, rotary embedding reads strided halves,
    SiLU and the loss compute exponentials, and mid-sized operators spread over the threads less well than a 768^3
    matmul: on this project's 2-core CPU, at one thread, the blocks' GEMMs reached 0.8-1 of the square matmul's
    rate and their memory-bound operators 0.35-0.6 of the copy's bandwidth. The tensors of MMAP_THRESHOLD_BYTES or
    more come from fresh mappings (runtime.host_alloc, as every run sets it from its start), whose pages the
    kernel zeroes at first touch: an operator's time counts only from the repeats where it took no page fault,
    and the faults, at `seconds_per_page_fault`, are charged per fresh byte the profile counts. glibc serves some
    of those tensors from memory freed before (45-60% of their pages faulted in a settled step of both bench/speed.py
    models, more in this reference's), so the rate is over the bytes, not the faults.
    Run it in a process of its own (`in_own_process`): in one whose heap earlier work had grown, its page faults
    all but vanished and its memory-bound operators ran faster than from a run's start.
    Measured on a decoder of its own shape (neither bench model's), each operator at the best of `repeats` steps,
    as best_time takes each probe: a step's hundreds of operators each meet another job's burst on a shared
    machine, and the best step did not shake them off (its memory-bound rate read 0.05 of the copy's at load 4)."""
    from snugfit.model.decoder import Decoder, ModelConfig

    return_freed_host_memory()  # as a run starts (in_own_process: a fresh heap)
    cfg = ModelConfig(arch="llama", dim=256, n_layers=2, n_heads=4, vocab_size=1024, max_seq_len=128)
    torch.manual_seed(0)
    model = Decoder(cfg)
    # 16 x 128 tokens: hidden states of 2 MiB, above the host allocator's threshold as a real model's are (at 8 x 128
    # they sat on it, and its memory-bound operators read 27-36 GB/s where both bench models' read about 20)
    tokens = torch.randint(0, cfg.vocab_size, (16, cfg.max_seq_len + 1))

    def step() -> _OpTimer:
        timer = _OpTimer()
        with timer:
            model(tokens[:, :-1], tokens[:, 1:]).backward()
        model.zero_grad(set_to_none=True)
        return timer
    # glibc reuses more of what it freed step after step (from 0.75 to 0.45 of the fresh pages faulted over the
    # default model's first 10 steps, 0.85 to 0.55 of the 1B-shaped one's), settling after 5 or so
    for _ in range(5):
        step()
    steps = [step() for _ in range(max(repeats, 1))]
    best = _OpTimer()
    for ops in zip(*(t.ops for t in steps)):
        clean = [seconds for _, _, seconds, faults in ops if not faults]
        if clean:  # left out where it faulted every time
            best.ops.append((ops[0][0], ops[0][1], min(clean), 0))
    flops, gemm_s = best.totals("gemm")
    nbytes, memory_s = best.totals("memory")
    paging_s = sum(f for t in steps for *_, f in t.ops) / len(steps) * seconds_per_page_fault()
    # above 1 where a probe met another job's burst: the time model then charges the rates the step reached, each
    # operator's best of several steps being less at the mercy of a shared machine than one short probe
    return (flops / gemm_s / matmul_flops_per_s, nbytes / memory_s / copy_bytes_per_s,
            steps[0].fresh_bytes / paging_s if paging_s else 0.0)


def compiled_block_costs(device: str, sync) -> tuple[float, float]:
    """Host seconds per kernel a compiled block launches (GPU.compiled_launch_s) and per kernel torch.compile
    generates for it (GPU.compile_kernel_s): a tiny block compiled as the runtime compiles it (runtime.compile), its
    kernels taking next to nothing, its forward and backward over the launches the profile counts for it
    (profile.compiled). Its first call compiles (seconds to a minute on a CPU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from snugfit.model.decoder import Block, ModelConfig, rope_table
    from snugfit.profile.compiled import trace_block
    from snugfit.runtime.compile import CompiledForward

    cfg = ModelConfig(arch="llama", dim=32, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=8)
    with FakeTensorMode():
        fwd, bwd = trace_block(Block(cfg), (torch.empty(1, 8, cfg.dim), rope_table(cfg)), {})
    with torch.device(device):
        block, rope = Block(cfg), rope_table(cfg)
    block.forward = CompiledForward(block.forward)
    x = torch.randn(1, 8, cfg.dim, device=device, requires_grad=True)

    def run():
        block(x, rope).sum().backward()
        sync()
    start = time.perf_counter()
    run()  # compiles
    compiling = time.perf_counter() - start
    launches = fwd.launches + bwd.launches
    return best_time(run, 20) / launches, compiling / launches


def host_step_params_per_s(n: int = 16_000_000, tensors: int = 16, staged: torch.dtype | None = None) -> float:
    """Parameters per second of an optimizer step on host tensors as snugfit runs it: each gradient's norm
    (runtime.grad_norm.global_grad_norm), the clip's multiply, fused AdamW and, where offloaded units run in a lower
    precision, the master's cast into its staging copy (runtime.offload). Past the CPU's caches (16M parameters,
    256 MB of fp32 state): fused AdamW alone on 2M parameters read 5.6e9 a second on an H200's 16-core host, and on
    this project's 2-core machine 1.5-2.6e9 where the whole step at 16M read 1.3e9 (1.1e9 with the bf16 cast)."""
    params = [torch.zeros(n // tensors, requires_grad=True) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(n // tensors)
    grads = [p.grad for p in params]
    copies = [torch.empty(n // tensors, dtype=staged) for _ in params] if staged is not None else []
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)

    @torch.no_grad()
    def step():
        for g in grads:
            torch.linalg.vector_norm(g, dtype=torch.float32)
        torch._foreach_mul_(grads, 1.0)
        opt.step()
        for copy, p in zip(copies, params):
            copy.copy_(p)
    step()  # AdamW's states
    return n / best_time(step, 3)


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
    # flash attention's kind of shape (head dim 128, as Llama's; FLASH_ATTENTION's reference) in the tensor cores'
    # dtype; plan.kernels carries it to other head dims by the published rates' proportions
    attention = attention_tflops(dev, b=2, heads=16, seq=size, head_dim=128, dtype=dtypes[-1], sync=sync)
    gpu = GPU(name, mem, tflops, hbm, pcie_gen, None, matmul_efficiency=1.0, mem_efficiency=1.0,
              op_overhead_s=per_op, sac_overhead_s=selective, attention_tflops=attention,
              sms=props.multi_processor_count if props else 0,
              arch=cuda_arch(props.major, props.minor) if props and not torch.version.hip else "")
    return gpu, link


def measure_compiled(local: LocalHardware, out: str | Path | None = None) -> LocalHardware:
    """Add what a compiled block's launches cost here to a measurement (and save it): taken only where compiled
    blocks are planned, since it compiles."""
    dev = "cpu" if local.device.name == "cpu" else torch.accelerator.current_accelerator().type
    sync = torch.accelerator.synchronize if dev != "cpu" else lambda: None
    local.device.compiled_launch_s, local.device.compile_kernel_s = compiled_block_costs(dev, sync)
    local.compiled = True
    local.save(out or hardware_cache_path())
    return local


def profile_hardware(out: str | Path | None = None, collectives: bool = True, compiled: bool = False) -> LocalHardware:
    """Measure this machine and cache the result (default ~/.cache/snugfit/hardware.json); `compiled`: also what a
    compiled block's launches cost (`measure_compiled`)."""
    with OtherLoad() as load:  # around what this process and its waited-for children measure
        host, device, links = _measure_device()
    if collectives:
        links["gloo-loopback"] = measure_local_ranks(host)
    local = LocalHardware(device, host, links, measured_at=time.time(), other_load=load.share)
    if is_busy(load.share):
        log.warning("other work kept %.0f%% of this machine's cores busy while it was measured: the figures are "
                    "kept only while it stays that busy, and taken again once it is quiet", 100 * load.share)
    local.save(out or hardware_cache_path())
    return measure_compiled(local, out) if compiled else local


def _measure_device() -> tuple[Host, GPU, dict[str, Link]]:
    """The host's and the device's figures (the accelerator's, or this CPU's with its step efficiencies)."""
    # offloaded units of a GPU's model run in bf16: their masters are cast for the copy back; a CPU trains in fp32
    staged = torch.bfloat16 if torch.accelerator.is_available() else None
    host = Host(ram_bytes=host_ram(), adam_params_per_s=host_step_params_per_s(staged=staged),
                cores=os.cpu_count() or 1)
    links: dict[str, Link] = {}
    if torch.accelerator.is_available():
        device, links["pcie-local"] = measure_accelerator(f"local-{torch.accelerator.current_accelerator().type}")
    else:
        sync = lambda: None  # noqa: E731
        tflops = {"float32": _matmul_tflops(torch.float32, 768, "cpu", sync),
                  "bfloat16": _matmul_tflops(torch.bfloat16, 128, "cpu", sync)}
        hbm = _copy_gbps(32 * 2**20, "cpu", "cpu", sync)
        host.thread_slowdown = thread_slowdown()
        per_op, selective = dispatch_costs("cpu", sync)
        # what a training step's operators reach of those rates (a GPU's kernels are timed apart from its host's
        # dispatch only with a synchronisation per operator: there the measured rates stand as they are)
        matmul, mem, page_in = in_own_process(step_efficiencies, tflops["float32"] * 1e12, hbm * 1e9)
        device = GPU("cpu", host.ram_bytes, tflops, hbm, 0, None, "gloo-loopback",
                     matmul_efficiency=matmul, mem_efficiency=mem, page_in_bytes_per_s=page_in, context_bytes=0,
                     op_overhead_s=per_op, sac_overhead_s=selective, attention_tflops=attention_tflops())
    return host, device, links
