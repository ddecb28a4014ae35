"""What a block does with its saved activations: keep, recompute, selective, offload.

`apply_activation_policy(block, policy)` replaces the block's `forward` on the
instance (no wrapper module), so parameter names -- and checkpoints -- stay the
same under every policy, and FSDP2's module hooks still run around it.

- keep: autograd saves what it saves.
- recompute: non-reentrant `torch.utils.checkpoint` around the block; only the
  block input is held, the forward runs again in backward.
- selective: the same checkpoint with a selective policy that keeps the outputs
  of matrix multiplies and attention (the expensive ops: mm, addmm, bmm, sdpa)
  and recomputes the cheap elementwise/norm ops, which are most of the bytes.
- selective_half: as selective, but only every second linear layer's output is
  kept (torchtitan's op-level policy): fewer bytes for a third of the matmuls.
- offload: saved tensors are copied to host memory in forward (pinned, on a
  side stream, where an accelerator exists) and copied back one block ahead of
  backward: when the gradient reaches a block's output, the copies of the block
  before it start, newest first, so they arrive while this block computes.
  Tensors already off the device (flash attention's CPU seed and offset) stay.
- recompute_offload: recompute, with the one tensor it keeps, the block input,
  on host as offload moves its tensors. The checkpoint itself holds that input
  too (torch.utils.checkpoint keeps its arguments), so its device storage is
  emptied in place after the forward and refilled before the backward, as
  FSDP2 frees unsharded parameters.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn as nn

from snugfit.model.recompute import recompute
from snugfit.plan.policies import policy as policy_entry


def _same_layout(t: torch.Tensor, device: torch.device, pin: bool = False) -> torch.Tensor:
    """An empty tensor of t's shape and strides on `device` (contiguous where t overlaps itself, as an expanded
    tensor does): a compiled block's backward asserts the layout of what its forward saved."""
    stride = t.stride() if all(s or n == 1 for s, n in zip(t.stride(), t.shape)) else None
    if stride is None:
        return torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin)
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=device, pin_memory=pin)


class _HostCopy:
    """One saved tensor in host memory; `fetch` starts the copy back, `get` waits for it."""

    def __init__(self, t: torch.Tensor, stream: torch.Stream | None):
        self.device = t.device
        self.stream = stream
        self.back: torch.Tensor | None = None
        self.used = False  # handed to autograd: not fetched ahead again
        self.event = None
        pin = stream is not None
        self.host = _same_layout(t, torch.device("cpu"), pin)
        if stream is None:
            self.host.copy_(t)
            return
        stream.wait_stream(torch.accelerator.current_stream(t.device))
        with stream:
            self.host.copy_(t, non_blocking=True)
        t.record_stream(stream)  # keep the device memory until the copy is done
        self.event = stream.record_event()

    def fetch(self) -> None:
        if self.back is not None or self.used:
            return
        if self.stream is None:
            self.back = _same_layout(self.host, self.device).copy_(self.host)
            return
        self.stream.wait_event(self.event)
        with self.stream:
            self.back = _same_layout(self.host, self.device).copy_(self.host, non_blocking=True)
        self.event = self.stream.record_event()

    def get(self) -> torch.Tensor:
        if self.used:  # unpacked again: a split backward's weight pass (zero-bubble schedules) after its input pass
            return self.host.to(self.device, copy=True)
        self.fetch()
        back, self.back, self.used = self.back, None, True  # autograd holds it now, as long as it needs it
        if self.event is not None:
            torch.accelerator.current_stream(self.device).wait_event(self.event)
            back.record_stream(torch.accelerator.current_stream(self.device))
        return back


_last_offloaded: list = [[]]  # the host copies of the offloaded block whose forward ran last (either policy)


def _offload(forward: Callable, x: torch.Tensor, *args: Any) -> torch.Tensor:
    if not (torch.is_grad_enabled() and x.requires_grad):
        return forward(x, *args)
    stream = torch.Stream(device=x.device) if x.device.type != "cpu" and torch.accelerator.is_available() else None
    packed: list[_HostCopy] = []
    before, _last_offloaded[0] = _last_offloaded[0], packed  # the block whose backward follows this one's

    def pack(t: torch.Tensor):
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t  # weights stay where they are
        if t.device != x.device:  # e.g. flash attention's CPU seed and offset: already off the device
            return t
        packed.append(_HostCopy(t, stream))
        return packed[-1]

    def unpack(p):
        return p.get() if isinstance(p, _HostCopy) else p

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = forward(x, *args)
    if out.requires_grad:
        out.register_hook(lambda grad: _fetch_all(packed, before))
    return out


class _StorageOnHost:
    """A tensor's whole storage copied to host and emptied on the device (`empty`), refilled in place (`fetch`),
    so every alias of it -- the checkpoint's argument, autograd's saved tensor -- holds it again at once."""

    def __init__(self, t: torch.Tensor, stream: torch.Stream | None):
        self.tensor, self.stream, self.used, self.event = t, stream, False, None
        self.storage = t.untyped_storage()
        self.nbytes = self.storage.nbytes()
        pin = stream is not None
        self.host = torch.empty(self.nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin)
        if stream is None:
            self.host.copy_(storage_bytes(self.storage))
            return
        stream.wait_stream(torch.accelerator.current_stream(t.device))
        with stream:
            self.host.copy_(storage_bytes(self.storage), non_blocking=True)
        t.record_stream(stream)  # the allocator keeps the bytes until the copy has read them
        self.event = stream.record_event()

    def empty(self) -> None:
        self.storage.resize_(0)

    def fetch(self) -> None:
        if self.used or self.storage.nbytes() == self.nbytes:
            return
        self.storage.resize_(self.nbytes)
        if self.stream is None:
            storage_bytes(self.storage).copy_(self.host)
            return
        self.stream.wait_event(self.event)
        with self.stream:
            storage_bytes(self.storage).copy_(self.host, non_blocking=True)
        self.event = self.stream.record_event()

    def get(self) -> torch.Tensor:
        self.fetch()
        self.used = True
        if self.event is not None:
            current = torch.accelerator.current_stream(self.tensor.device)
            current.wait_event(self.event)
            self.tensor.record_stream(current)
        return self.tensor


def _whole_storage(t: torch.Tensor) -> bool:
    """Whether t is all of its storage: emptying the storage then touches no other tensor's bytes."""
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def _offload_checkpoint(forward: Callable, x: torch.Tensor, *args: Any) -> torch.Tensor:
    """`forward` recomputes the block; the input it keeps waits on host (see the module docstring)."""
    if not (torch.is_grad_enabled() and x.requires_grad and _whole_storage(x)):
        return forward(x, *args)
    stream = torch.Stream(device=x.device) if x.device.type != "cpu" and torch.accelerator.is_available() else None
    held: list[_StorageOnHost] = []
    before, _last_offloaded[0] = _last_offloaded[0], held
    mine = x.untyped_storage()._cdata

    def pack(t: torch.Tensor):
        if t.untyped_storage()._cdata == mine and not held:  # the checkpoint's input, saved by _KeepInput
            held.append(_StorageOnHost(t, stream))
            return held[0]
        return t

    def unpack(p):
        return p.get() if isinstance(p, _StorageOnHost) else p

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = forward(x, *args)
    for h in held:
        h.empty()  # nothing reads the input again before this block's backward
    if out.requires_grad:
        out.register_hook(lambda grad: _restore(held, before))
    return out


def _restore(held: list[_StorageOnHost], ahead: list) -> None:
    """As the block's backward starts: its input back on the device before the recomputation reads it (autograd
    never unpacks it: the checkpoint reads its own reference), then the next block's copies started."""
    for h in held:
        h.get()
    for p in reversed(ahead):
        p.fetch()


def _fetch_all(packed: list, ahead: list) -> None:
    """As a block's backward starts: its own copies (if not yet started), then those of the block whose backward
    comes next, each newest first, as backward uses them."""
    for p in [*reversed(packed), *reversed(ahead)]:
        p.fetch()


def apply_activation_policy(block: nn.Module, policy: str,
                            compile_block: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """Make `block` do what its policy's entry (plan.policies) says, in place: recompute (fully or selectively)
    what it does not keep, and keep on host what it keeps there (all it saves, or its recomputation checkpoint).
    `compile_block` (runtime.compile) compiles the block between the two layers: its recomputation inside the
    compiled region, the offload's saved-tensor hooks outside it."""
    entry = policy_entry(policy)
    if entry.recomputes:
        recompute(block, entry.keeps)
    if compile_block is not None:
        compile_block(block)
    if entry.on_host:
        block.forward = functools.partial(_offload_checkpoint if entry.recomputes else _offload, block.forward)
    return block


def storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a byte tensor: what is copied or sent, whatever tensors view it."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))
