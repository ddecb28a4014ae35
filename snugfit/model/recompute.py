"""Activation recomputation of one block: full, or selective (matmul and attention outputs kept).

A model-level transformation, as torch.utils.checkpoint is: the runtime applies it per the plan
(runtime.activations), and the profiler applies it to measure what each policy saves and costs.
`recompute(block, selective)` replaces the block's `forward` on the instance (no wrapper module), so parameter
names -- and checkpoints -- stay the same, and FSDP2's module hooks still run around it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

aten = torch.ops.aten
# Ops whose outputs selective recomputation keeps: the matmuls and the attention kernels.
SAVED_OPS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _keep_matmuls(kept: list[torch.Tensor], ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective checkpointing's policy; the outputs it keeps in the forward are appended to `kept` (where torch
    passes them: `op_output`, torch 2.13)."""
    if op not in SAVED_OPS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    if not ctx.is_recompute:
        kept.extend(t for t in tree_leaves(getattr(ctx, "op_output", None)) if isinstance(t, torch.Tensor))
    return CheckpointPolicy.MUST_SAVE


class _KeepInput(torch.autograd.Function):
    """Identity that saves its input for backward.

    Non-reentrant checkpoint holds the block input in a closure, invisible to
    saved-tensor hooks around the block; saving it here too makes it visible to
    the memory tracker and lets a pipeline stage evict it (same storage, so no
    extra bytes).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _KeepAlongside(torch.autograd.Function):
    """Identity on `out` that saves `kept` for backward: the tensors selective checkpointing keeps in its own
    cache, which saved-tensor hooks around the block never see, shown to them (the memory tracker, a pipeline
    stage's accounting and BPipe's evictions) as _KeepInput shows the input. Same storages, so no extra bytes;
    they count as released when the block's backward starts, a little before the recomputation drops them."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, *kept: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*kept)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (grad, *([None] * len(ctx.saved_tensors)))


def _recompute(forward: Callable, selective: bool, x: torch.Tensor, *args: Any) -> torch.Tensor:
    tracked = torch.is_grad_enabled() and x.requires_grad
    if tracked:
        x = _KeepInput.apply(x)
    if not selective:
        return checkpoint(forward, x, *args, use_reentrant=False)
    kept: list[torch.Tensor] = []
    context = functools.partial(create_selective_checkpoint_contexts, functools.partial(_keep_matmuls, kept))
    out = checkpoint(forward, x, *args, use_reentrant=False, context_fn=context)
    return _KeepAlongside.apply(out, *kept) if tracked and kept else out


def recompute(block: nn.Module, selective: bool) -> nn.Module:
    """Make `block` hold only its input (full) or its matmul and attention outputs too (selective) for backward,
    recomputing the rest."""
    block.forward = functools.partial(_recompute, block.forward, selective)
    return block
