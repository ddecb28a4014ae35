"""Measure this machine: matmul rate per dtype, memory bandwidth, host<->device copies,
collective bandwidth between local gloo ranks, and CPU fused-AdamW throughput.

Writes the catalogue format (LocalHardware) so the time model reads measured and
datasheet hardware alike. Kept short (about 10-20 s on 2 cores).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path

import torch

from snugfit.hardware.catalogue import GPU, GiB, Host, Link, LocalHardware, default_cpu, hardware_cache_path


def _best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _matmul_tflops(dtype: torch.dtype, n: int, device: str, sync) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)

    def run():
        a @ b
        sync()
    return 2 * n**3 / _best_time(run, 3) / 1e12


def _copy_gbps(nbytes: int, src: str, dst: str, sync, pin: bool = False) -> float:
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=src)
    if pin:
        x = x.pin_memory()
    y = torch.empty_like(x, device=dst)

    def run():
        y.copy_(x, non_blocking=pin)
        sync()
    moved = nbytes if src != dst else 2 * nbytes  # a same-device copy reads and writes
    return moved / _best_time(run, 3) / 1e9


def _adam_params_per_s(n: int) -> float:
    p = torch.zeros(n, requires_grad=True)
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    return n / _best_time(opt.step, 3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        if rank == 0:
            # ring all-reduce moves 2 (w-1)/w of the buffer over each rank's link
            gbps = 2 * (world - 1) / world * nbytes / max(t - lat, 1e-9) / 1e9
            Path(out).write_text(f"{gbps} {lat}")
    finally:
        dist.destroy_process_group()


def measure_collectives(world: int = 2, nbytes: int = 16 * 2**20) -> Link:
    """All-reduce bus bandwidth and latency between `world` local gloo processes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result")
        # fork where there is one: the children skip re-importing torch (seconds on a busy machine)
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        mp.start_processes(_collective_worker, args=(world, _free_port(), out, nbytes), nprocs=world, join=True,
                           start_method=method)
        gbps, lat = map(float, Path(out).read_text().split())
    return Link("gloo-loopback", gbps, lat)


def _host_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


def profile_hardware(out: str | Path | None = None, collectives: bool = True) -> LocalHardware:
    """Measure this machine and cache the result (default ~/.cache/snugfit/hardware.json)."""
    host = Host(ram_bytes=_host_ram(), adam_params_per_s=_adam_params_per_s(2_000_000), cores=os.cpu_count() or 1)
    links: dict[str, Link] = {}
    if torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        dev, sync = acc.type, torch.accelerator.synchronize
        idx = torch.accelerator.current_device_index()
        props = torch.cuda.get_device_properties(idx) if acc.type == "cuda" else None
        mem = props.total_memory if props else 16 * GiB
        tflops = {"float32": _matmul_tflops(torch.float32, 4096, dev, sync),
                  "bfloat16": _matmul_tflops(torch.bfloat16, 4096, dev, sync)}
        h2d = _copy_gbps(256 * 2**20, "cpu", dev, sync, pin=True)
        d2h = _copy_gbps(256 * 2**20, dev, "cpu", sync)
        links["pcie-local"] = Link("pcie-local", min(h2d, d2h), 10e-6)
        hbm = _copy_gbps(512 * 2**20, dev, dev, sync)
        name = f"local-{acc.type}"
        device = GPU(name, mem, tflops, hbm, 0, None, "gloo-loopback", 1.0, 1.0, GiB // 2)
    else:
        sync = lambda: None  # noqa: E731
        base = default_cpu()
        tflops = {"float32": _matmul_tflops(torch.float32, 768, "cpu", sync),
                  "bfloat16": _matmul_tflops(torch.bfloat16, 128, "cpu", sync)}
        hbm = _copy_gbps(32 * 2**20, "cpu", "cpu", sync)
        device = GPU("cpu", host.ram_bytes, tflops, hbm, 0, None, "gloo-loopback",
                     base.matmul_efficiency, base.mem_efficiency, 0)
    if collectives:
        links["gloo-loopback"] = measure_collectives()
    local = LocalHardware(device, host, links)
    local.save(out or hardware_cache_path())
    return local
