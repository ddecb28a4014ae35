"""Mixed precision without FSDP2, for a plan that runs unwrapped (one process, nothing sharded or offloaded).

FSDP2 on one rank shards nothing and reduces nothing, yet runs its hooks on every unit and copies each unit's
parameters in and its gradients out every microbatch: measured on an H200, a replicated 1.1B step spent about
0.17 s of host time against a plain loop's 0.08 s (docs/gpu.md). Such a plan runs the model as it is, and in a
compute dtype below fp32 this does what FSDP2's mixed precision did, more cheaply:

- the trainable parameters stay fp32 (the masters the optimizer steps); their compute copies are cast once per
  step, on the first forward, not once per microbatch as FSDP2's copy-in (or a per-microbatch autocast region)
  does, and put in the modules' place for each forward;
- each microbatch's gradient flows back through the cast into the fp32 parameter's gradient, which autograd
  accumulates in fp32 (FSDP2 accumulates in the reduce dtype, fp32 here);
- in the step's last backward each copy is dropped once its gradient has reached the master (`keep` off), as
  FSDP2 frees a unit's gathered copy after its backward, so none is left when the optimizer runs (`release`);
  frozen parameters are stored in the compute dtype and need none.

The memory model counts the copies where it counted FSDP2's gathered ones (comm_buffers), and the tracker sees
them as buffers (`memory`), never as saved activations (`storages`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from snugfit.runtime.memory import storage_key, tensor_bytes
from snugfit.runtime.offload import weak_hook


class CastOnce:
    """The compute copies of `model`'s trainable parameters, cast once per step and swapped in for each forward."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        self.slots = [(m, name, p) for m in model.modules() for name, p in m._parameters.items()
                      if p is not None and p.requires_grad and p.is_floating_point() and p.dtype != dtype]
        self.copies: list[torch.Tensor | None] | None = None
        self.storages: set[int] = set()  # of the live copies: the tracker's saved-tensor hook skips them
        self.keep = True  # off for the step's last backward (the engine sets it)
        model.register_forward_pre_hook(self._swap_in)
        model.register_forward_hook(self._swap_out)
        self._slots_of: dict[int, list[int]] = {}
        for i, (_, _, p) in enumerate(self.slots):
            self._slots_of.setdefault(id(p), []).append(i)
            if len(self._slots_of[id(p)]) == 1:
                p.register_post_accumulate_grad_hook(weak_hook(self._accumulated))

    def _swap_in(self, module: nn.Module, args) -> None:
        if torch.is_grad_enabled():
            if self.copies is None:  # the step's first forward: autograd carries each gradient back to fp32
                self.copies = self._cast(lambda p: p.to(self.dtype))
                self.storages = {storage_key(c) for c in self.copies}
            copies = self.copies
        else:  # evaluation: throwaway copies, never the ones a step's backward goes through
            copies = self.copies or self._cast(lambda p: p.detach().to(self.dtype))
        for (m, name, _), c in zip(self.slots, copies):
            m._parameters[name] = c  # what functional_call does: the module computes with the copy

    def _cast(self, cast) -> list[torch.Tensor]:
        """One copy per parameter, shared where modules share it (tied embeddings)."""
        done: dict[int, torch.Tensor] = {}
        for _, _, p in self.slots:
            if id(p) not in done:
                done[id(p)] = cast(p)
        return [done[id(p)] for _, _, p in self.slots]

    def _swap_out(self, module: nn.Module, args, output) -> None:
        for m, name, p in self.slots:
            m._parameters[name] = p

    def _accumulated(self, p: torch.Tensor) -> None:
        """p's gradient of this microbatch is in: in the last backward, its copy is no longer needed."""
        if not self.keep and self.copies is not None:
            for i in self._slots_of[id(p)]:
                self.copies[i] = None

    def release(self) -> None:
        """After the step's last backward: the optimizer changes the masters, the next step casts again."""
        self.copies, self.storages, self.keep = None, set(), True

    def memory(self) -> dict[str, int]:
        """MemoryTracker source: the live copies."""
        return {"device.buffers": tensor_bytes(c for c in self.copies or [] if c is not None)}  # each storage once


def apply_mixed_precision(model: nn.Module, compute_dtype: torch.dtype) -> CastOnce | None:
    """Compute in `compute_dtype` with fp32 masters, for a model FSDP2 does not wrap; None in fp32."""
    return CastOnce(model, compute_dtype) if compute_dtype != torch.float32 else None
