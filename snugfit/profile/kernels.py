"""What a GPU's kernels save for backward where the CPU path saves more: the profile records these.

The profiler runs the model's CPU operators under FakeTensorMode. For most operators the CPU and CUDA save the
same tensors, but not for RMSNorm: CUDA runs `F.rms_norm` as one fused kernel that keeps its (bf16) input and a
small fp32 statistic per row, while on CPU the op decomposes and autograd keeps fp32 copies of the input and of
the normalised input (about 4 bytes more per element and norm). `fused_norms` makes the built-in decoder's norms
save what the fused kernel saves, so a profile taken for a GPU cluster counts what the GPU holds. (Hugging Face
Llama norms are written out in Python, unfused on CUDA too: they are left as they are.)
"""

from __future__ import annotations

import torch
import torch.nn as nn

from snugfit.model.decoder import RMSNorm

KERNELS = ("cpu", "gpu")  # whose saved tensors a profile records


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm that keeps its input, weight and the fp32 reciprocal RMS per row, as the fused CUDA kernel does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x.float() * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        g = grad.float() * weight.float()
        grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        grad_w = (grad.float() * normed).flatten(0, -2).sum(0)
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None


def fused_norms(model: nn.Module) -> int:
    """Make the built-in decoder's RMSNorms save what the fused GPU kernel saves; returns how many."""
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    for norm in norms:
        norm.forward = lambda x, n=norm: _FusedRMSNorm.apply(x, n.weight, n.eps)
    return len(norms)
