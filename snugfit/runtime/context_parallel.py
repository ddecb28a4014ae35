"""Context parallelism, Ulysses style: each of cp ranks holds 1/cp of every sequence, attention trades it for heads.

    inputs, targets   shifted whole, then each rank keeps its contiguous chunk of both (`sequence_part`)
    embed ... blocks  every token-wise piece (norms, projections, MLP, loss) runs on the rank's chunk alone;
                      positions (RoPE, learned ones) count from the chunk's first global index (Decoder.cp_rank)
    attention         q, k, v (batch, heads, seq/cp, head_dim) -> all-to-all -> (batch, heads/cp, seq, head_dim):
                      the normal causal attention over the whole sequence for this rank's heads, then the
                      output all-to-all back to (batch, heads, seq/cp, head_dim); packed documents' mask is
                      built over the whole sequence from its document ids, which every cp rank has whole
                      (runtime.microbatches), and positions are this rank's slice of theirs
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

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from snugfit.model.moe import moe_layers


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


def _whole_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, cp: int):
    """q, k, v (b, heads, s/cp, d) -> (b, heads/cp, s, d) each; key/value heads repeated first where too few."""
    heads, kv = q.shape[1], k.shape[1]
    if kv % cp:  # too few key/value heads to split: repeat each so that every rank gets those it reads
        repeat = math.lcm(kv, cp) // kv
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    if heads % cp:
        raise ValueError(f"context parallelism: {heads} attention heads on this rank do not divide by cp {cp}")
    return tuple(_seq_to_heads(t, group, cp) for t in (q, k, v))


class Ulysses(nn.Module):
    """An attention's `attend` (model.decoder.LocalAttention) run over the whole sequence for 1/cp of the heads,
    between two all-to-alls over the cp group (see the module docstring). No parameters: installing it changes no
    parameter name, so checkpoints load under any cp."""

    def __init__(self, inner: nn.Module, group, cp: int):
        super().__init__()
        self.inner, self.cp, self.group = inner, cp, group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """mask: packed documents' (model.decoder.Documents.mask), already over the whole sequence, as attention
        runs here."""
        return _heads_to_seq(self.inner(*_whole_sequence(q, k, v, self.group, self.cp), mask), self.group, self.cp)


def hf_attention(block: nn.Module) -> nn.Module | None:
    """The attention module of a Hugging Face layer (model.hf_model.HFBlock's `layer`) whose kernel comes from
    transformers' attention registry (its `config._attn_implementation`), where context parallelism can run it:
    None for others, and for attention with per-head sinks (gpt-oss), which the attention here has no term for."""
    layer = getattr(block, "layer", None)
    attn = getattr(layer, "self_attn", None)
    if getattr(attn, "config", None) is None or getattr(attn, "sinks", None) is not None:
        return None
    return attn


def _softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout: float,
                scaling: float, softcap: float, causal: bool) -> torch.Tensor:
    """Attention with its logits soft-capped (Gemma 2: softcap x tanh(logits / softcap), before the mask), which
    SDPA has no term for; as transformers' eager attention, over the whole sequence. mask: boolean (True: attend)
    or additive, as transformers builds it for the model's attention implementation; None: causal."""
    logits = q @ k.transpose(-2, -1) * scaling
    logits = softcap * torch.tanh(logits / softcap)
    if mask is None and causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    probs = F.dropout(logits.softmax(dim=-1, dtype=torch.float32).to(q.dtype), p=dropout)
    return probs @ v


def _hf_ulysses(group, cp: int) -> str:
    """The name, in transformers' attention registry, of the Ulysses attention over `group`: the layer's q, k, v
    exchanged for the whole sequence of 1/cp of the heads, SDPA over them (flash on GPUs; the mask, where the layer
    has one, is the whole sequence's: HFBlock.mask, a sliding window's included), or the soft-capped attention
    where the layer passes `softcap` (Gemma 2), and the output exchanged back. A function transformers calls
    with the layer's own arguments is its documented extension point (AttentionInterface.register); SDPA is
    called here rather than the layer's own function because that repeats key/value heads by the layer's whole
    group count, which no longer holds once cp splits the heads."""
    from transformers import AttentionInterface

    def attend(module, q, k, v, mask, dropout: float = 0.0, scaling: float | None = None,
               softcap: float | None = None, **_):
        q, k, v = _whole_sequence(q, k, v, group, cp)
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        causal = mask is None and getattr(module, "is_causal", True)
        if softcap:
            out = _softcapped(q, k, v, mask, dropout, q.shape[-1] ** -0.5 if scaling is None else scaling, softcap,
                              causal)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                                 is_causal=causal)
        return _heads_to_seq(out, group, cp).transpose(1, 2), None  # transformers' layout: (b, s, heads, d)

    name = f"snugfit-ulysses-cp{cp}-{id(group)}"
    AttentionInterface.register(name, attend)
    return name


def apply_cp(model: nn.Module, group, cp: int, cp_rank: int) -> None:
    """Install Ulysses around every attention of `model` and tell the model which chunk of each sequence it holds
    (its positions). The built-in decoder's `attn.attend` is wrapped; a Hugging Face layer's attention gets a
    copy of its config naming the Ulysses function in transformers' registry (`_hf_ulysses`), and its block the
    cp rank and degree (HFBlock: positions and mask by global index). Mixture-of-Experts MLPs are token-wise, and
    their routers' aux loss counts the experts' tokens over the cp group (model.moe.MoEMLP.aux_loss)."""
    for m in moe_layers(model):
        m.cp_group = group
    for block in model.blocks.values():
        hf = hf_attention(block)
        if hf is not None:
            name = _hf_ulysses(group, cp)
            if hf.config._attn_implementation != name:
                hf.config = copy.copy(hf.config)  # this layer's alone: masks and saving read the model's own
                hf.config._attn_implementation = name
            block.cp, block.cp_rank = cp, cp_rank
        elif not isinstance(block.attn.attend, Ulysses):
            block.attn.attend = Ulysses(block.attn.attend, group, cp)
    model.cp_rank = cp_rank
