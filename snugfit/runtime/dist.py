"""Process-group setup from torchrun's environment; one process without it."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

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


def init_distributed(timeout_s: float = 300.0) -> DistEnv:
    """Join the process group torchrun describes (NCCL on GPUs, gloo on CPU).

    The timeout bounds every collective and point-to-point transfer, so a dead
    peer ends the step with an error instead of a silent hang.
    """
    if "RANK" not in os.environ:
        return DistEnv()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(local_rank)
    if not dist.is_initialized():
        backend = _backend(device)
        timeout = timedelta(seconds=timeout_s)
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
        # torchrun's agent store outlives a restart and still holds the dead attempt's addresses,
        # which gloo would try to connect to; keep each attempt's keys apart.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"snugfit/attempt_{attempt}", store)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                device_id=None if device.type == "cpu" else device)
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=device)


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
