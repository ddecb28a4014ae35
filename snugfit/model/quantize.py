"""4-bit NF4 base weights (QLoRA), through torchao's NF4Tensor.

What QLoRA quantizes: the frozen nn.Linear weights inside the blocks, which hold
nearly all of a model's parameters. Embeddings, norms and the head stay in the
compute dtype, LoRA adapters in fp32. torchao's NF4Tensor answers F.linear with
its linear_nf4, which keeps the 4-bit weight (not a dequantized copy) for
backward and dequantizes it for each matmul, so a quantized nn.Linear needs no
module of its own. FSDP2 shards NF4 parameters through torchao's all-gather
extensions. torchao is imported only here, so only this feature needs it.
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn

from snugfit.errors import SnugfitError
from snugfit.profile.types import NF4_BLOCK, NF4_SCALER_BLOCK
from snugfit.quiet import quiet_imports


def _nf4():
    try:
        with quiet_imports():
            from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, to_nf4
    except ImportError:
        raise SnugfitError("finetune.quantize_base = 'nf4' needs torchao: pip install 'snugfit[qlora]'") from None
    return NF4Tensor, to_nf4


def quantizable(block: nn.Module) -> dict[str, nn.Linear]:
    """Name -> frozen nn.Linear inside `block` whose weight NF4 can hold (whole blocks of 64 weights)."""
    return {name: m for name, m in block.named_modules()
            if isinstance(m, nn.Linear) and not m.weight.requires_grad and m.weight.numel() % NF4_BLOCK == 0}


SHARD_PARTS = 8  # NF4 weights must split into equal parts for FSDP2: allow up to 8 data-parallel shards


def _scaler_block(numel: int) -> int:
    """QLoRA's 256 scales per scaler block, halved until the weight has a multiple of SHARD_PARTS scaler blocks
    (it keeps 256 for real models' weights; tiny test models get smaller ones)."""
    scales, size = numel // NF4_BLOCK, NF4_SCALER_BLOCK
    while size > 1 and (scales % size or (scales // size) % SHARD_PARTS):
        size //= 2
    return size


def check_shardable(module: nn.Module, parts: int) -> None:
    """NF4 weights split only into equal parts (torchao shards each of its inner tensors evenly): one clear
    error before FSDP2 asserts deep inside."""
    for name, p in module.named_parameters():
        if not is_quantized(p) or hasattr(p, "to_local"):  # a DTensor: a unit inside, sharded already
            continue
        inner = [getattr(p, n) for n in ("quantized_data", "quantized_scalers", "quantization_factor")]  # split
        if p.shape[0] % parts or any(t.numel() % parts for t in inner):
            raise SnugfitError(f"NF4 weight {name} {tuple(p.shape)} cannot be sharded {parts} ways; use a data-"
                               f"parallel degree that divides it (2, 4 or 8), or ZeRO 0 for its blocks")


def quantize(t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """t as NF4 (through bf16, as QLoRA quantizes), with `like`'s block sizes when given."""
    _, to_nf4 = _nf4()
    block, scaler = (like.block_size, like.scaler_block_size) if like is not None else (
        NF4_BLOCK, _scaler_block(t.numel()))
    return to_nf4(t.detach().to(torch.bfloat16), block, scaler)


def copy_nf4(target: torch.Tensor, src: torch.Tensor) -> None:
    """Copy NF4 `src` into NF4 `target` of the same layout, inner tensor by inner tensor. torchao's empty_like
    (what to_empty runs) leaves the code table and the scales' mean on the meta device; those are set here."""
    for name in target.__tensor_flatten__()[0]:
        inner, value = getattr(target, name), getattr(src, name)
        if inner.is_meta:
            setattr(target, name, value.detach().to(src.device, copy=True))
        else:
            inner.copy_(value)


def quantize_base(model: nn.Module) -> int:
    """Replace the frozen block linears' weights with NF4 ones, in place (a model on the meta device stays there,
    for the runtime to read quantized). Returns how many weights were quantized."""
    layers = quantizable(model.blocks)
    if not layers:
        raise SnugfitError("finetune.quantize_base = 'nf4' found no frozen linear weights in the blocks; "
                           "it quantizes a frozen base: add --lora-rank (or freeze blocks)")
    for m in layers.values():
        m.weight = nn.Parameter(quantize(m.weight), requires_grad=False)
    return sum(m.weight.numel() for m in layers.values())


def is_quantized(t: torch.Tensor) -> bool:
    """Whether t (or a DTensor's local part) is an NF4Tensor; False without importing torchao when it is unused."""
    if "torchao" not in sys.modules:
        return False
    NF4Tensor, _ = _nf4()
    local = t.to_local() if hasattr(t, "to_local") else t
    return isinstance(local, NF4Tensor) or isinstance(getattr(t, "data", None), NF4Tensor)


def dequantized(t: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A plain tensor of t's values (NF4 dequantized), for export and references."""
    return t.get_original_weight().to(dtype) if is_quantized(t) else t.to(dtype)
