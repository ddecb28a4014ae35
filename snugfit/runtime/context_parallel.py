"""Context parallelism, Ulysses style: each of cp ranks holds 1/cp of every sequence, attention trades it for heads.

    inputs, targets   shifted whole, then each rank keeps its contiguous chunk of both (`sequence_part`)
    embed ... blocks  every token-wise piece (norms, projections, MLP, loss) runs on the rank's chunk alone;
                      positions (RoPE, learned ones) count from the chunk's first global index (Decoder.cp_rank)
    attention         q, k, v (batch, heads, seq/cp, head_dim) -> all-to-all -> (batch, heads/cp, seq, head_dim):
                      the normal causal attention over the whole sequence for this rank's heads, then the
                      output all-to-all back to (batch, heads, seq/cp, head_dim)
    gradients         FSDP2 shards and reduces over dp x cp (runtime.mesh), as it would over dp x cp data ranks:
                      each rank's loss is its chunk's, divided by the count of all cp ranks' targets
                      (runtime.microbatches)

Key/value heads fewer than cp (or not divisible by it) are repeated first, to the least common multiple of their
count and cp, so that each rank receives the key/value heads its query heads read (heads stay contiguous: rank c's
query heads [c h/cp, (c+1) h/cp) read kv heads [c kv/cp, (c+1) kv/cp) of the repeated set). With tensor
parallelism the heads are this tp rank's; cp splits them further.

Why not torch's `torch.distributed.tensor.experimental.context_parallel`: it shards SDPA through DTensor sharding
strategies, and the CPU flash kernel (aten._scaled_dot_product_flash_attention_for_cpu) has none registered, so it
fails on CPU and gloo, where every path of this project is tested. The all-to-alls here are plain collectives
(torch's functional `all_to_all_single_autograd`, whose backward is the reverse all-to-all), and run the
same on NCCL. On a GPU-only path one could use torch's ring attention (its context_parallel, overlapping the key/
value exchange with the attention blocks and needing no head divisibility), or keep Ulysses with flash attention
and run the q, k, v all-to-alls as one fused exchange on a side stream; nothing else here would change.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor


def sequence_part(t: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """This cp rank's contiguous chunk of the sequence (dim 1) of `t`; `t` itself at cp 1."""
    if cp == 1:
        return t
    n = t.shape[1] // cp
    return t[:, cp_rank * n:(cp_rank + 1) * n]


def _all_to_all(send: torch.Tensor, group) -> torch.Tensor:
    """Row i of `send` to rank i of `group`, row j of the result from rank j; its backward is the same exchange
    of the gradients (torch's functional collective, which torch.compile can trace too)."""
    return wait_tensor(all_to_all_single_autograd(send, None, None, group))


def _seq_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """(b, h, s/cp, d) on each rank -> (b, h/cp, s, d): rank c sends its chunk of heads i to rank i."""
    b, h, s, d = x.shape
    send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()  # (cp, b, h/cp, s/cp, d): row i to rank i
    got = _all_to_all(send, group)  # row j: rank j's sequence chunk
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _heads_to_seq(y: torch.Tensor, group, cp: int) -> torch.Tensor:
    """(b, h/cp, s, d) -> (b, h, s/cp, d): the inverse of `_seq_to_heads`."""
    b, h, s, d = y.shape
    send = y.reshape(b, h, cp, s // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # row i: sequence chunk i
    got = _all_to_all(send, group)  # row j: rank j's heads
    return got.transpose(0, 1).reshape(b, cp * h, s // cp, d)


class Ulysses(nn.Module):
    """An attention's `attend` (model.decoder.LocalAttention) run over the whole sequence for 1/cp of the heads,
    between two all-to-alls over the cp group (see the module docstring). No parameters: installing it changes no
    parameter name, so checkpoints load under any cp."""

    def __init__(self, inner: nn.Module, group, cp: int):
        super().__init__()
        self.inner, self.cp, self.group = inner, cp, group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        heads, kv = q.shape[1], k.shape[1]
        if kv % self.cp:  # too few key/value heads to split: repeat each so that every rank gets those it reads
            repeat = math.lcm(kv, self.cp) // kv
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        if heads % self.cp:
            raise ValueError(f"context parallelism: {heads} attention heads on this rank do not divide by cp {self.cp}")
        q, k, v = (_seq_to_heads(t, self.group, self.cp) for t in (q, k, v))
        return _heads_to_seq(self.inner(q, k, v), self.group, self.cp)


def apply_cp(model: nn.Module, group, cp: int, cp_rank: int) -> None:
    """Install Ulysses around every attention of `model` (the built-in decoder's `attn.attend`; plan.rules refuses
    other models at cp > 1) and tell the model which chunk of each sequence it holds (its positions)."""
    for block in model.blocks.values():
        attn = block.attn
        if not isinstance(attn.attend, Ulysses):
            attn.attend = Ulysses(attn.attend, group, cp)
    model.cp_rank = cp_rank
