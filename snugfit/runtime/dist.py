"""Process-group setup from torchrun's environment; one process without it."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
log = logging.getLogger("snugfit")
ROUND_ENV = "SNUGFIT_RDZV_ROUND"  # a multi-node launch's rendezvous round, counted by runtime/launch.py


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    timeout_s: float = 300.0  # how long any collective or transfer may wait (config.parallel.timeout_s)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(local_rank: int) -> torch.device:
    """The local accelerator (CUDA, ROCm, XPU, ...) by local rank, else the CPU."""
    if torch.accelerator.is_available():
        kind = torch.accelerator.current_accelerator().type
        torch.accelerator.set_device_index(local_rank)
        return torch.device(kind, local_rank)
    return torch.device("cpu")


def _backend(device: torch.device) -> str:
    """gloo on CPU; the accelerator's backend for its tensors, with gloo for host tensors.

    Plain "gloo", not "cpu:gloo": torch sets a process group's default backend
    from a "device:backend" string only when NCCL is in it or no backend plugin
    is registered, and importing torch.distributed.fsdp registers the "fake"
    plugin. The group is then left without a default backend and
    destroy_process_group warns "No backend of type 0 found". Plain "gloo"
    differs only in also serving CUDA tensors, which a CPU run has none of.
    """
    if device.type == "cpu":
        return "gloo"
    return f"{device.type}:{dist.get_default_backend_for_device(device)},cpu:gloo"


def missing_peer_access(devices: int, can_access: Callable[[int, int], bool]) -> tuple[int, int] | None:
    """The first pair of local GPUs that cannot read each other's memory directly, or None when all can."""
    return next(((a, b) for a in range(devices) for b in range(devices) if a != b and not can_access(a, b)), None)


def disable_p2p_without_peer_access(devices: int, can_access: Callable[[int, int], bool]) -> bool:
    """Set NCCL_P2P_DISABLE=1 when two local GPUs lack peer access (consumer cards such as the RTX 4090):
    NCCL's peer-to-peer transport hangs collectives on them. An explicit setting by the user wins.
    True when the traffic between GPUs goes through host memory."""
    if os.environ.get("NCCL_P2P_DISABLE"):
        return os.environ["NCCL_P2P_DISABLE"] != "0"
    pair = missing_peer_access(devices, can_access)
    if pair is None:
        return False
    os.environ["NCCL_P2P_DISABLE"] = "1"
    if os.environ.get("LOCAL_RANK", "0") == "0":
        log.warning("GPUs %d and %d cannot access each other's memory (no P2P): set NCCL_P2P_DISABLE=1, so NCCL "
                    "moves their traffic through host memory instead of hanging", *pair)
    return True


def launch_attempt() -> int:
    """Which start of the launched ranks this is, 0 for the first; the same on every rank, every node.
    On one node torchrun's restart count; across nodes the rendezvous round (runtime/launch.py), since a
    node restarting for another's failure does not count a restart."""
    if ROUND_ENV in os.environ:
        return int(os.environ[ROUND_ENV]) - 1
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def init_distributed(timeout_s: float = 300.0) -> DistEnv:
    """Join the process group torchrun describes (NCCL on GPUs, gloo on CPU).

    The timeout bounds every collective and point-to-point transfer, so a dead
    peer ends the step with an error instead of a silent hang.
    """
    # Before the first CUDA allocation reads it: segments that grow in place instead of one cudaMalloc per size,
    # torch's advice against fragmentation (an H200 held 35.1 GiB reserved for 21.5 GiB allocated under activation
    # offload; with this set, 32.5 for 19.5: little changed there, docs/gpu.md). A user's own setting wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if "RANK" not in os.environ:  # one process, not launched by torchrun: still on the local accelerator
        return DistEnv(device=pick_device(0), timeout_s=timeout_s)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(local_rank)
    if device.type == "cuda":  # before NCCL's first communicator reads it
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        disable_p2p_without_peer_access(local_world, torch.cuda.can_device_access_peer)
    if not dist.is_initialized():
        backend = _backend(device)
        timeout = timedelta(seconds=timeout_s)
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
        # torchrun's agent store outlives a restart and still holds the dead attempt's addresses,
        # which gloo would try to connect to; keep each attempt's keys apart.
        store = dist.PrefixStore(f"snugfit/attempt_{launch_attempt()}", store)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                device_id=None if device.type == "cpu" else device)
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=device, timeout_s=timeout_s)


def ensure_process_group(env: DistEnv) -> None:
    """A one-rank process group when none was launched, so one process runs the same FSDP2 code path."""
    if not dist.is_initialized():
        device = env.device
        backend = _backend(device)
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


_GROUPS: dict = {}  # (default group, key) -> group or mesh


def cached_group(key: tuple, make: Callable[[], T]) -> T:
    """A process group (or device mesh) made once per default process group and reused by every engine built
    after it. gloo starts threads for each group and torch frees none that its creator drops, so building one
    engine per plan (a resume under another plan, bench/regret.py's dozens) would otherwise pile up groups
    until the machine spends its time on their threads. Engines built this way must not run at once.

    Groups of an earlier default group stay referenced, never destroyed here: in a forked child (the hardware
    measurement forks) their destructors would wait on threads the fork did not copy."""
    world = dist.group.WORLD
    if (world, key) not in _GROUPS:
        _GROUPS[(world, key)] = make()
    return _GROUPS[(world, key)]


def release_cached_groups() -> None:
    """Let the default group's cached groups go (before destroying it), so that their gloo threads stop while
    Python still runs. Left to the interpreter's exit, a thread still freeing its last collective's tensors
    waits for the GIL the exit holds and aborts the rank ("terminate called without an active exception",
    about 1 rank-exit in 30 on CPU)."""
    world = dist.group.WORLD
    for key in [k for k in _GROUPS if k[0] is world]:
        del _GROUPS[key]
