"""Which of a model's blocks record alike, so that the profile records one of each kind, not all of them.

A decoder stack repeats one layer: Llama-2-70B's 80 blocks record 80 equal copies of one block's step, and
recording them all (at the micro-batch and at twice it, for the eager profile and again for the compiled one) was
most of the 17 s its first `snugfit plan` took. A block's recorded step depends on
its input (the hidden state, the same shape everywhere), on what it is (its parameters and its modules' settings)
and on whether gradients flow into it from a trainable piece before it (a LoRA model's first block computes no
input gradient). The first and the last block are recorded on their own too, as the pieces beside them (the
embedding, the final norm) are where the recording's attribution to pieces could differ; a stack of 80 records
three blocks.
"""

from __future__ import annotations

import torch.nn as nn

from snugfit.profile.compiled import signature

_PLAIN = (bool, int, float, str, type(None))
# a layer's index into a KV cache (none is passed in training): the one setting layers always differ in
_INDEX = "layer_idx"


def _setting(value) -> bool:
    return isinstance(value, _PLAIN) or (isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value))


def behaviour(block: nn.Module) -> tuple:
    """What a block is, beside its input: its parameters (compiled.signature) and each module's type and plain
    settings (a Hugging Face layer's sliding window or attention type), its KV-cache index left out."""
    modules = tuple((name, type(m).__qualname__,
                     tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in vars(m).items()
                                  if k != _INDEX and not k.startswith("_") and _setting(v))))
                    for name, m in block.named_modules())
    return signature(block), modules


def stand_ins(embed: list[nn.Module], blocks: list[nn.Module]) -> list[int]:
    """For each block, the index of the first block that records as it does: alike in behaviour(), in whether a
    trainable piece comes before it, and in being the first or the last block."""
    first: dict[tuple, int] = {}
    out = []
    grads_in = any(p.requires_grad for m in embed for p in m.parameters())
    for i, block in enumerate(blocks):
        key = (behaviour(block), grads_in, i == 0, i == len(blocks) - 1)
        out.append(first.setdefault(key, i))
        grads_in = grads_in or any(p.requires_grad for p in block.parameters())
    return out
