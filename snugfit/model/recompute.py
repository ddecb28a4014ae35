"""Activation recomputation of one block: full, or selective (matmul and attention outputs kept, or only every second
linear layer's).

A model-level transformation, as torch.utils.checkpoint is: the runtime applies it per the plan
(runtime.activations), and the profiler applies it to measure what each policy saves and costs.
`recompute(block, policy)` replaces the block's `forward` on the instance (no wrapper module), so parameter
names -- and checkpoints -- stay the same, and FSDP2's module hooks still run around it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from snugfit.model.decoder import Documents
from snugfit.model.moe import grouped_mm
from snugfit.plan.policies import ACTIVATION_POLICIES, RECOMPUTED, SELECTIVE

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
    grouped_mm._opoverload,  # model.moe's experts
}
# The linear layers' GEMMs (3-D inputs folded to 2-D), which "selective_half" keeps only every second one of.
GEMM_OPS = {aten.mm.default, aten.addmm.default}
SELECTIVE_POLICIES = SELECTIVE  # the policies whose checkpoint keeps some outputs (plan.policies)
RECOMPUTE_POLICIES = RECOMPUTED  # every checkpointed variant: full and selective


def keeps_output(policy: str, op: Any, gemms: int) -> bool:
    """Whether a selective `policy` keeps `op`'s output; gemms: the GEMMs the block's forward has run, this one
    included. "selective" keeps every matmul's and attention's output. "selective_half" (gemm_stride 2) keeps
    attention's and the 1st, 3rd, ... GEMM's and recomputes the others, as torchtitan's op-level selective
    checkpointing does: of a Llama block's q, k, v, o, gate, up, down it replays k, o and up, trading about a third
    of the forward's matmul FLOPs for their outputs' bytes. Shared with the profiler, which charges the bytes this
    decides."""
    stride = ACTIVATION_POLICIES[policy].gemm_stride
    return op in SAVED_OPS and not (op in GEMM_OPS and (gemms - 1) % stride)


class _Policy:
    """One checkpointed forward's selective policy. It counts GEMMs per pass, so the replay decides as the forward
    did where torch asks again (before 2.13); the outputs it keeps in the forward are appended to `kept` (where
    torch passes them: `op_output`, torch 2.13)."""

    def __init__(self, policy: str, kept: list[torch.Tensor]):
        self.policy, self.kept, self.gemms = policy, kept, {False: 0, True: 0}

    def __call__(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        self.gemms[ctx.is_recompute] += op in GEMM_OPS
        if not keeps_output(self.policy, op, self.gemms[ctx.is_recompute]):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if not ctx.is_recompute:
            self.kept.extend(t for t in tree_leaves(getattr(ctx, "op_output", None)) if isinstance(t, torch.Tensor))
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
    cache (and packed documents' mask, which their Documents keep), which saved-tensor hooks around the block never
    see, shown to them (the memory tracker, a pipeline
    stage's accounting and BPipe's evictions) as _KeepInput shows the input. Same storages, so no extra bytes;
    they count as released when the block's backward starts, a little before the recomputation drops them.
    It returns `out`'s storage as a new tensor, not a view of it: the block's output is an FSDP2 unit's, and FSDP2
    warns of units that return views (an in-place op on one would skip the unit's pre-backward hook)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, *kept: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*kept)
        return out.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (grad, *([None] * len(ctx.saved_tensors)))


def _compiled_contexts(policy: str):
    """A selective policy's contexts in a compiled block (runtime.compile), where torch decides per operator once, as
    it traces the graph; what is kept is then the graph's to save, seen by saved-tensor hooks outside it."""
    return create_selective_checkpoint_contexts(_Policy(policy, []))


def _recompute(forward: Callable, policy: str, x: torch.Tensor, *args: Any) -> torch.Tensor:
    if torch.compiler.is_compiling():  # a compiled block: the checkpoint becomes a region the partitioner recomputes
        context = {} if policy == "recompute" else {"context_fn": functools.partial(_compiled_contexts, policy)}
        return checkpoint(forward, x, *args, use_reentrant=False, **context)
    tracked = torch.is_grad_enabled() and x.requires_grad
    if tracked:
        x = _KeepInput.apply(x)
    kept: list[torch.Tensor] = []
    if not ACTIVATION_POLICIES[policy].selective:
        out = checkpoint(forward, x, *args, use_reentrant=False)
    else:
        out = checkpoint(forward, x, *args, use_reentrant=False,
                         context_fn=lambda: create_selective_checkpoint_contexts(_Policy(policy, kept)))
    # packed documents' mask, made in the first block's forward and held by their Documents, not by autograd
    kept += [t for a in args if isinstance(a, Documents) for t in a.held()]
    return _KeepAlongside.apply(out, *kept) if tracked and kept else out


def recompute(block: nn.Module, policy: str = "recompute") -> nn.Module:
    """Make `block` hold only its input for backward ("recompute"), or its matmul and attention outputs too (one of
    SELECTIVE_POLICIES), recomputing the rest."""
    if policy not in RECOMPUTE_POLICIES:
        raise ValueError(f"unknown recompute policy {policy!r}; use one of {RECOMPUTE_POLICIES}")
    block.forward = functools.partial(_recompute, block.forward, policy)
    return block
