"""More room never slows the plan: the search with more host RAM, or more GPU memory, returns a plan at least as
fast, over catalogue clusters (synthetic decoders: torch-free); but for two known cases of more GPU memory (below).

"At least as fast" is to the time model's resolution: the search itself calls plans within 3 significant digits
ties (search._preference). Its re-solves round blocks to buckets, so two searches over different option sets can end
a rounding apart (the largest seen here: 0.15%, 0.4430 s with 16 GiB of RAM and 0.4437 s with 32 GiB); a plan
slower by more than 1% is what this test refuses (Llama-2-70B QLoRA on 2x RTX 4090 was: a runner-up of 393 tokens/s
with 128 GiB of RAM and 356 with 256)."""

from __future__ import annotations

import pytest

from snugfit.hardware import parse_cluster
from snugfit.hardware.cluster import with_host_ram
from snugfit.plan.search import NoPlanError, search
from snugfit.plan.verify import SIMPLER_MARGIN
from tests.test_search import synth

GiB = 2**30
# the time model's resolution, and what the search gives up for a plan with nothing offloaded (verify.simpler): more
# room can make that simpler plan fit, up to SIMPLER_MARGIN slower than the one it replaces
RESOLUTION = (1 + 0.01) * (1 + SIMPLER_MARGIN) - 1
CASES = {  # (blocks, hidden, seq), cluster, global batch: the host RAM binds in most of them at the low end
    "16x4096-2xRTX4090": ((16, 4096, 2048), "2xRTX4090", 8),
    "24x2048-1xRTX4090": ((24, 2048, 1024), "1xRTX4090", 4),
    "32x4096-4xA10": ((32, 4096, 2048), "4xA10", 8),
    "24x4096-4xRTX3090": ((24, 4096, 2048), "4xRTX3090", 8),
    "16x4096-1xA10": ((16, 4096, 2048), "1xA10", 2),
    "32x4096-1xA100-80GB": ((32, 4096, 1024), "1xA100-80GB", 4),
    "24x2048-mixed": ((24, 2048, 1024), "2xRTX4090+2xRTX3090", 8),
}


def _step(prof, cluster, gb: int, **kw) -> float:
    try:
        return search(prof, cluster, global_batch=gb, alternatives=0, **kw).best.predicted.step_time_s
    except NoPlanError:
        return float("inf")


@pytest.mark.parametrize("case", list(CASES))
def test_more_host_ram_never_slows_the_plan(case):
    (n, dim, seq), spec, gb = CASES[case]
    prof, cluster = synth(n, dim, seq=seq), parse_cluster(spec)
    steps = [_step(prof, with_host_ram(cluster, ram * GiB), gb) for ram in (16, 32, 64, 128, 256, 512)]
    assert steps[-1] < float("inf"), "nothing fits even 512 GiB: the case checks nothing"
    for less, more in zip(steps, steps[1:]):
        assert more <= less * (1 + RESOLUTION), steps


SLOWER_WITH_MORE_GPU_MEMORY = pytest.mark.xfail(strict=True, reason=(
    "known: the knapsack's time for parameter offload and recomputation differs from estimate()'s, and with more "
    "room it takes options estimate() finds slower; verify.polish only ever gives room back. One RTX 4090, 24 "
    "blocks of 2048: 60% of its memory gives a plan of 0.62 s, 70% one of 0.71 s (12 blocks with parameter offload "
    "where 60% keeps 13 replicated with checkpoints offloaded), 80% 0.47 s, 90% 0.53 s (4x RTX 3090, 24 blocks of 4096, was such a case until FSDP2's copy kernels were "
    "charged)"))


@pytest.mark.parametrize("case", [pytest.param(c, marks=SLOWER_WITH_MORE_GPU_MEMORY)
                                  if c == "24x2048-1xRTX4090" else c for c in CASES])
def test_more_gpu_memory_never_slows_the_plan(case):
    (n, dim, seq), spec, gb = CASES[case]
    prof, cluster = synth(n, dim, seq=seq), parse_cluster(spec)
    memory = min(cluster.gpu_of(r).memory_bytes for r in range(cluster.world_size))
    steps = [_step(prof, cluster, gb, memory_budget=int(share * memory)) for share in (0.6, 0.7, 0.8, 0.9, 1.0)]
    assert steps[-1] < float("inf"), "nothing fits the whole GPU: the case checks nothing"
    for less, more in zip(steps, steps[1:]):
        assert more <= less * (1 + RESOLUTION), steps
