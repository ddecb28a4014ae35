"""What a GPU's kernels save for backward where the CPU path saves more: the profile records these.

The profiler runs the model's CPU operators under FakeTensorMode. For most operators the CPU and CUDA save the
same tensors, but not for two (`gpu_kernels` makes the profile record the GPU's):
- RMSNorm: CUDA runs `F.rms_norm` as one fused kernel that keeps its (bf16) input and a small fp32 statistic per
  row, while on CPU the op decomposes and autograd keeps fp32 copies of the input and of the normalised input
  (about 4 bytes more per element and norm), and its memory traffic is that of a dozen elementwise ops, not one
  pass. The built-in decoder's norms are made to save and move what the kernel does.
  (Hugging Face Llama norms are written out in Python, unfused on CUDA too: they are left as they are.)
- Attention: flash attention on CUDA writes its output sequence-major, so the `transpose(1, 2).reshape(...)`
  before the output projection is a view of the tensor the kernel keeps; the CPU kernel writes it head-major and
  the reshape copies it, a second copy the projection keeps.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from snugfit.model.decoder import RMSNorm

KERNELS = ("cpu", "gpu")  # whose saved tensors a profile records


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm that keeps its input, weight and the fp32 reciprocal RMS per row, as the fused CUDA kernel does, and
    runs as one op each way (torch's fused RMSNorm ops), so the profile counts one pass over the tensors."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        try:
            grad_x, grad_w = torch.ops.aten._fused_rms_norm_backward(grad, x, [x.shape[-1]], rstd, weight, [True, True])
        except NotImplementedError:  # no CPU kernel (the profile's fake tensors run its meta kernel): the same math
            normed = x.float() * rstd
            g = grad.float() * weight.float()
            grad_x = (rstd * (g - normed * (g * normed).mean(-1, keepdim=True))).to(x.dtype)
            grad_w = (grad.float() * normed).flatten(0, -2).sum(0).to(weight.dtype)
        return grad_x, grad_w, None


class _FlashAttention(torch.autograd.Function):
    """Causal attention that keeps q, k, v, its output laid out sequence-major and the fp32 log-sum-exp per row,
    as flash attention on CUDA does. Forward and backward are the CPU's flash kernels, one op each, so the profile
    counts the backward's FLOPs once (2.5 forwards, its recomputation included), as flash attention runs it."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, True)


class _GpuAttention(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        plain = {k: v for k, v in kwargs.items() if not (k == "attn_mask" and v is None)}  # None: no mask
        if func is F.scaled_dot_product_attention and plain.get("is_causal") and len(args) == 3 and not (
                set(plain) - {"is_causal"}):
            return _FlashAttention.apply(*args)
        return func(*args, **kwargs)


@contextmanager
def gpu_kernels(model: nn.Module) -> Iterator[None]:
    """While profiling `model`: its RMSNorms and causal attention save what the GPU's kernels save."""
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    for norm in norms:
        norm.forward = lambda x, n=norm: _FusedRMSNorm.apply(x, n.weight, n.eps)
    try:
        with _GpuAttention():
            yield
    finally:
        for norm in norms:
            del norm.forward
