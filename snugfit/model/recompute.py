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


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


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


def _recompute(forward: Callable, selective: bool, x: torch.Tensor, *args: Any) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        x = _KeepInput.apply(x)
    context = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls) if selective else None
    kw = {"context_fn": context} if context else {}
    return checkpoint(forward, x, *args, use_reentrant=False, **kw)


def recompute(block: nn.Module, selective: bool) -> nn.Module:
    """Make `block` hold only its input (full) or its matmul and attention outputs too (selective) for backward,
    recomputing the rest."""
    block.forward = functools.partial(_recompute, block.forward, selective)
    return block
