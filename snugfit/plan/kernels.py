"""GEMM time on a GPU from its shape: tiles, waves and a ceiling per dtype; attention at its measured or published rate.

cuBLAS splits C = A B (M x K times K x N) into output tiles (128 x 128 here, its
usual choice for large bf16/fp16 GEMMs) and runs them on the SMs in waves. A
GEMM whose tiles fill 1.1 waves takes as long as two full ones (wave
quantization), and a dimension that is not a tile multiple computes the padding
(tile quantization). Each wave costs one tile's FLOPs at the SM's share of the
peak, times the best fraction large GEMMs reach on its architecture (`gemm_ceiling`); a kernel
launch costs at least `LAUNCH_S`. A GPU whose rates profile-hardware measured
(matmul_efficiency 1) is at its ceiling already.

Attention (a piece's FLOPs beyond its GEMMs) in fp16/bf16 runs at the rate profile-hardware measured on the
card where it did (whatever kernel torch's SDPA picks: cuDNN's on Hopper with torch 2.11); otherwise at
FlashAttention-2's published rates on NVIDIA GPUs from Ampere on, whose achieved share of the peak depends on the
generation and the head dim (`FLASH_ATTENTION`).
"""

from __future__ import annotations

import functools
import math

from snugfit.hardware.catalogue import GPU

TILE_M = TILE_N = 128
TILE_K = 32  # the K step of one tile's main loop
# the fraction of the dense peak cuBLAS reaches on large, well-shaped GEMMs (tensor cores: power and clock
# limits; fp32 without TF32: the CUDA cores' FMA pipes); what the catalogue's flat matmul_efficiency undercounts
GEMM_CEILING = {"bfloat16": 0.8, "float16": 0.8, "tf32": 0.75, "float32": 0.9}
# Hopper's, measured: an H200 (the H100 SXM's die, clocks and 700 W) ran 4096^3 at 716-733 TFLOPS in bf16, 691-713
# in fp16 and 50.8 in fp32 (docs/gpu.md, runs 1 and 2); this tile model fills that GEMM's 8 waves over 132 SMs to
# 0.97, so each ceiling is the measured share of the peak over 0.97
GEMM_CEILING_BY_ARCH = {"hopper": {"bfloat16": 0.75, "float16": 0.73, "float32": 0.78}}
LAUNCH_S = 4e-6

# FlashAttention-2's (forward, backward) share of the dense fp16/bf16 peak, causal, sequences of 2k-8k tokens, the
# backward counted as 2.5 forwards (its recomputation included), by generation and head dim:
# - ampere: Dao, "FlashAttention-2" (arXiv 2307.08691), figures 5 and 6 (A100 80GB SXM4, 312 TFLOPS): about 190 and 165
#   TFLOPs/s at head dim 128, 165 and 135 at 64, read off the plots. Other sm8x cards (A10, RTX 3090, A6000) and Ada
#   run the same kernels with smaller tiles; no published figures, so Ampere's are used for them.
# - hopper: FA2's curves in Shah et al., "FlashAttention-3" (arXiv 2407.08608), H100 80GB SXM5 (989 TFLOPS): backward
#   291-318 TFLOPs/s at head dim 128 (2k-8k), forward about 330; head dim 64 about 0.85 of that. FA2 uses none of
#   Hopper's new instructions (torch's flash backend is FA2), hence a third of the peak where cuDNN and FA3 reach half.
# Elsewhere (Volta and Turing have no FA2, AMD, fp32, unknown cards) attention keeps the flat matmul rate.
FLASH_ATTENTION = {
    "ampere": {64: (0.53, 0.43), 128: (0.61, 0.53)},
    "ada": {64: (0.53, 0.43), 128: (0.61, 0.53)},
    "hopper": {64: (0.28, 0.27), 128: (0.33, 0.32)},
}
FLASH_DTYPES = ("bfloat16", "float16")


def gemm_ceiling(arch: str, dtype: str) -> float | None:
    """The fraction of the dense `dtype` peak large GEMMs reach on `arch`; None where no figure is known."""
    return GEMM_CEILING_BY_ARCH.get(arch, {}).get(dtype, GEMM_CEILING.get(dtype))


def sm_rate(gpu: GPU, dtype: str) -> float:
    """FLOP/s one SM reaches on a large, well-shaped GEMM of `dtype` (requires gpu.sms)."""
    dtype, peak = gpu.peak_flops(dtype)
    ceiling = 1.0 if gpu.matmul_efficiency >= 1.0 else gemm_ceiling(gpu.arch, dtype) or gpu.matmul_efficiency
    return peak * ceiling / gpu.sms


def gemm_time(m: int, n: int, k: int, gpu: GPU, dtype: str) -> float:
    """Seconds of one M x K by K x N GEMM on `gpu` (requires gpu.sms)."""
    return _gemm_time(m, n, k, gpu.sms, sm_rate(gpu, dtype))


def _gemm_time(m: int, n: int, k: int, sms: int, per_sm: float) -> float:
    waves = math.ceil(math.ceil(m / TILE_M) * math.ceil(n / TILE_N) / sms)
    k_padded = math.ceil(k / TILE_K) * TILE_K
    return max(LAUNCH_S, waves * 2 * TILE_M * TILE_N * k_padded / per_sm)


def gemm_seconds(gemms: list[list[int]], gpu: GPU, dtype: str,
                 weight_grads: float) -> tuple[float, float, float, float]:
    """(forward seconds, backward seconds, forward FLOPs, backward FLOPs) of a piece's linear layers: forward
    M x K by K x N; backward the input's gradient (M x N by N x K) and, for the `weight_grads` share of
    trainable weights, the weight's (K x M by M x N)."""
    # the search asks for the same pieces on the same GPUs thousands of times: cached on what the times depend on
    return _gemm_seconds(tuple(map(tuple, gemms)), gpu.sms, sm_rate(gpu, dtype), weight_grads)


@functools.lru_cache(maxsize=4096)
def _gemm_seconds(gemms: tuple[tuple[int, ...], ...], sms: int, per_sm: float,
                  weight_grads: float) -> tuple[float, float, float, float]:
    fwd = bwd = fwd_flops = bwd_flops = 0.0
    for m, n, k in gemms:
        fwd += _gemm_time(m, n, k, sms, per_sm)
        bwd += _gemm_time(m, k, n, sms, per_sm) + weight_grads * _gemm_time(k, n, m, sms, per_sm)
        fwd_flops += 2.0 * m * n * k
        bwd_flops += 2.0 * m * n * k * (1 + weight_grads)
    return fwd, bwd, fwd_flops, bwd_flops


def gemm_cache_clear() -> None:
    """Forget the cached GEMM times (benchmarks time the search from a cold start)."""
    _gemm_seconds.cache_clear()


def attention_rates(gpu: GPU, dtype: str, head_dim: int) -> tuple[float, float]:
    """(forward, backward) FLOP/s of attention at this head dim: where profile-hardware measured the card's attention
    (head dim 128), that rate; else flash attention's share of the peak where it is known (head dims between 64 and
    128 interpolated, others at the nearer end; on a card whose matmul rate was measured, a share of that rate, which
    is at gemm_ceiling); else the flat matmul rate. A measured rate moves to other head dims as the published ones
    do."""
    return _attention_rates(gpu.arch, dtype, head_dim, *gpu.peak_flops(dtype), gpu.matmul_efficiency,
                            tuple(gpu.attention_tflops))


@functools.lru_cache(maxsize=1024)  # the search asks thousands of times for a few GPUs and head dims
def _attention_rates(arch: str, dtype: str, head_dim: int, peak_dtype: str, peak: float,
                     efficiency: float, measured: tuple[float, ...]) -> tuple[float, float]:
    table = FLASH_ATTENTION.get(arch)
    if dtype not in FLASH_DTYPES or not head_dim or not (table or measured):
        return peak * efficiency, peak * efficiency  # GPU.flops_per_s
    t = min(max((head_dim - 64) / 64, 0.0), 1.0)
    shares = [lo + t * (hi - lo) for lo, hi in zip(table[64], table[128])] if table else None
    if measured:
        scale = [s / ref for s, ref in zip(shares, table[128])] if table else [1.0, 1.0]
        return measured[0] * 1e12 * scale[0], measured[1] * 1e12 * scale[1]
    if efficiency >= 1.0:
        peak /= gemm_ceiling(arch, peak_dtype)
    return peak * shares[0], peak * shares[1]
