"""The built-in decoder: LLaMA-style or GPT-2-style from one config.

Structure, which planner and runtime rely on:
    model.embed   token (+ learned position) embedding      -- the first piece
    model.blocks  nn.ModuleDict {"0": Block, "1": Block, ...} -- the repeated blocks
    model.norm    final norm                                  -- part of the last piece
    model.head    output projection                          -- part of the last piece

Blocks live in a ModuleDict keyed by their index so that a pipeline stage that
deletes the blocks it does not run keeps the same parameter names (checkpoints
then load under any split). Pieces a stage does not own are set to None and
skipped by forward.
"""

from __future__ import annotations

import functools
import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from snugfit.model.config import ModelConfig
from snugfit.model.moe import MoEMLP
from snugfit.model.shards import write_whole


def initial_value(name: str, shape: tuple[int, ...], n_layers: int,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """A parameter's GPT-2 style init from its name: 1-D weights 1 and biases 0, matrices N(0, 0.02), output
    projections scaled by depth."""
    if len(shape) == 1:
        return torch.full(shape, 1.0 if name.endswith("weight") else 0.0)
    std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("o.weight", "down.weight", "down_proj")) else 0.02
    return torch.randn(shape, generator=generator) * std


EMBEDDING = "embed.tokens.weight"  # the token embedding's weight, which a tied head shares (Hugging Face models too)


def init_name(cfg: ModelConfig, name: str) -> str:
    """The tensor whose init `name` draws: a tied head's own copy (a pipeline stage apart from the embedding's,
    runtime.tied_embeddings) the embedding's, so both copies start equal."""
    return EMBEDDING if cfg.tie_embeddings and name == "head.weight" else name


def tensor_generator(seed: int, name: str) -> torch.Generator:
    """One generator per (seed, tensor name): a tensor's init is drawn alone, whatever else a rank holds."""
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def make_norm(cfg: ModelConfig) -> nn.Module:
    return RMSNorm(cfg.dim, cfg.norm_eps) if cfg.arch == "llama" else nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)


def rope_table(cfg: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    """cos/sin table of shape (max_seq_len, head_dim/2, 2)."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, device=device, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate x: (batch, heads, seq, head_dim) by position, pairing dimension i with i + head_dim/2. table: the
    rows of the positions in order (seq, head_dim/2, 2), or each row's own (batch, seq, head_dim/2, 2) (packed).

    The half-split pairing is Hugging Face Llama's, so exported weights load there unchanged.
    """
    seq, half = x.shape[2], x.shape[-1] // 2
    table = table[:, None] if table.dim() == 4 else table[:seq]
    cos, sin = table[..., 0].to(x.dtype), table[..., 1].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def document_positions(docs: torch.Tensor) -> torch.Tensor:
    """Each token's position in its own document: (batch, seq) document ids -> positions restarting at 0 where the
    id changes (packed examples, data.packing)."""
    index = torch.arange(docs.shape[1], device=docs.device).expand_as(docs)
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def document_mask(docs: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) boolean: token i attends to token j <= i of its own document only (a block-diagonal
    causal mask; the padding, document 0, attends to itself and no document attends to it)."""
    seq = docs.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=docs.device).tril()
    return (docs[:, :, None] == docs[:, None, :]).logical_and(causal)[:, None]


def flex_trains_on(device: torch.device | str) -> bool:
    """Whether packed attention runs FlexAttention with a block mask on `device` (`Documents.mask`): O(seq) memory
    and a flash-like kernel, where a dense seq x seq mask forces SDPA's memory-efficient kernel and O(seq^2)
    memory. CUDA only: torch 2.13's FlexAttention has no backward on CPU, which keeps the dense mask."""
    return torch.device(device).type == "cuda"


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask) -> torch.Tensor:
    """FlexAttention under a block mask: compiled on CUDA (eager FlexAttention materialises the scores), eager
    elsewhere (a forward without gradients on CPU, as tests check the mask)."""
    return (_compiled_flex() if q.is_cuda else flex_attention)(q, k, v, block_mask=mask)


class Documents:
    """Packed examples' document ids over the whole sequence (batch, seq), and what the blocks derive from them, each
    once per forward: every block reads the same positions and mask. The mask is a FlexAttention block mask where
    `flex_trains_on` the device, else dense and additive, in the attention's dtype: SDPA turns a boolean one into
    that in every layer, and saves each layer's copy for backward; given it, one is held however many layers save
    it (and a recomputed block finds it again). A plain class, not a dataclass: FSDP2 rebuilds dataclass arguments
    when it casts a forward's inputs, which would drop what is derived.

    flex: the block mask or the dense one, None: as `flex_trains_on` the ids' device (the profile asks for its
    target's)."""

    def __init__(self, ids: torch.Tensor, flex: bool | None = None):
        self.ids = ids
        self.flex = flex_trains_on(ids.device) if flex is None else flex
        self._masks: dict[torch.dtype | None, torch.Tensor | BlockMask] = {}

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        return document_positions(self.ids)

    def mask(self, dtype: torch.dtype) -> torch.Tensor | BlockMask:
        """What attention masks with: the block mask of `document_mask` (`flex`), or (batch, 1, seq, seq), 0 where
        `document_mask` lets a token attend, -inf elsewhere."""
        key = None if self.flex else dtype
        if key not in self._masks:
            self._masks[key] = self._block_mask() if self.flex else self._dense(dtype)
        return self._masks[key]

    def _dense(self, dtype: torch.dtype) -> torch.Tensor:
        allowed = document_mask(self.ids)
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))

    def _block_mask(self) -> BlockMask:
        ids = self.ids

        def same_document(b, h, q, kv):
            return (ids[b, q] == ids[b, kv]) & (kv <= q)

        batch, seq = ids.shape
        # compiled on CUDA, the block mask is made block by block, not from a seq x seq one; inside a block that
        # torch.compile traces, it is compiled with the block
        return create_block_mask(same_document, batch, None, seq, seq, device=ids.device,
                                 _compile=ids.is_cuda and not torch.compiler.is_compiling())

    def held(self) -> list[torch.Tensor]:
        """The tensors of the masks made so far: what a forward holds until its first block's backward."""
        tensors = [t for m in self._masks.values() for t in ([m] if isinstance(m, torch.Tensor) else m.as_tuple())
                   if isinstance(t, torch.Tensor)]
        return list({id(t): t for t in tensors}.values())

    def held_bytes(self) -> int:
        """Their bytes (the profile's ModelProfile.mask_bytes)."""
        return sum(t.untyped_storage().nbytes() for t in self.held())


class LocalAttention(nn.Module):
    """Causal attention over sequences this rank holds whole: (batch, heads, seq, head_dim) q, k, v -> the same
    shape. Grouped key/value heads are repeated here, counted from the tensors (a tensor- or context-parallel rank
    holds a slice of the heads). Attention's `attend` by default; context parallelism (runtime.context_parallel)
    puts its all-to-alls around it. mask: packed documents' (`Documents.mask`, over the whole sequence): a block
    mask runs FlexAttention, an additive one SDPA (or the eager scores); None: causal, SDPA's fast kernel."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.eager, self.head_dim = cfg.attention == "eager", cfg.head_dim

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        if k.shape[1] != q.shape[1]:
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        if isinstance(mask, BlockMask):
            return flex(q, k, v, mask)
        if not self.eager:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        s = q.shape[2]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        if mask is not None:
            return (scores + mask).softmax(dim=-1) @ v
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        return scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        bias = cfg.arch == "gpt2"
        kv = cfg.n_kv_heads * cfg.head_dim
        self.q = nn.Linear(cfg.dim, cfg.dim, bias=bias)
        self.k = nn.Linear(cfg.dim, kv, bias=bias)
        self.v = nn.Linear(cfg.dim, kv, bias=bias)
        self.o = nn.Linear(cfg.dim, cfg.dim, bias=bias)
        self.attend: nn.Module = LocalAttention(cfg)  # no parameters: replaced freely (runtime.context_parallel)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None, docs: Documents | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        cfg = self.cfg
        # Heads counted from the projections (-1), not the config: a tensor-parallel rank holds a slice of them.
        q = self.q(x).view(b, s, -1, cfg.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, -1, cfg.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, -1, cfg.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        y = self.attend(q, k, v, None if docs is None else docs.mask(q.dtype))
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, width: int | None = None):
        super().__init__()
        self.swiglu = cfg.arch == "llama"
        bias = not self.swiglu
        width = width or cfg.ffn_dim
        self.up = nn.Linear(cfg.dim, width, bias=bias)
        self.down = nn.Linear(width, cfg.dim, bias=bias)
        self.gate = nn.Linear(cfg.dim, width, bias=False) if self.swiglu else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x), approximate="tanh"))


def make_mlp(cfg: ModelConfig) -> nn.Module:
    """A block's MLP: dense, or Mixture-of-Experts (model.moe) where cfg.n_experts."""
    if not cfg.n_experts:
        return MLP(cfg)
    shared = MLP(cfg, cfg.n_shared_experts * cfg.moe_ffn_dim) if cfg.n_shared_experts else None
    return MoEMLP(cfg.dim, cfg.n_experts, cfg.top_k, cfg.moe_ffn_dim, cfg.router_aux_coef / cfg.n_layers, shared)


class Block(nn.Module):
    """One pre-norm decoder layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = make_mlp(cfg)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None,
                docs: Documents | None = None) -> torch.Tensor:
        """docs: packed documents over the whole sequence (None: one sequence a row), which attention keeps apart."""
        x = x + self.attn(self.attn_norm(x), rope, docs)
        return x + self.mlp(self.mlp_norm(x))


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.positions = nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.arch == "gpt2" else None

    def forward(self, tokens: torch.Tensor, start: int | torch.Tensor = 0) -> torch.Tensor:
        """start: the first token's position, or each token's (batch, seq) positions (packed documents)."""
        h = self.tokens(tokens)
        if self.positions is not None:
            h = h + self.positions(positions_from(start, tokens))
        return h


def positions_from(start: int | torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The positions of `tokens` (batch, seq): start, start + 1, ... or the tensor of them given."""
    if isinstance(start, torch.Tensor):
        return start
    return torch.arange(start, start + tokens.shape[1], device=tokens.device)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed: Embedding | None = Embedding(cfg)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = make_norm(cfg)
        self.head: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.tokens.weight
        # Not persistent: derived from the config, rebuilt by init_weights after meta init.
        self.register_buffer("rope", rope_table(cfg) if cfg.arch == "llama" else None, persistent=False)
        # Which contiguous part of each sequence this rank holds (context parallelism, runtime.context_parallel):
        # its tokens sit at positions cp_rank x the local length on, for the rotary table and learned positions
        self.cp_rank = 0
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """GPT-2 style init (`initial_value`) of `tensors` (default: the parameters by name), and the buffers.

        seed: each tensor from its own generator (`tensor_generator`), drawn whole and this rank's part kept
        (`write_whole`), so a model built on the meta device and sharded gets the values a whole model would,
        one tensor at a time; None: the global generator, in order (a model built whole, on CPU).
        """
        for name, p in (tensors if tensors is not None else dict(self.named_parameters())).items():
            if p.is_meta:
                continue
            name = init_name(self.cfg, name)
            gen = tensor_generator(seed, name) if seed is not None else None
            write_whole(p, initial_value(name, tuple(p.shape), self.cfg.n_layers, gen))
        if self.cfg.arch == "llama" and self.rope is not None and not self.rope.is_meta:
            self.rope.copy_(rope_table(self.cfg, self.rope.device))

    def placed(self, length: int, docs: Documents | None = None
               ) -> tuple[int | torch.Tensor, torch.Tensor | nn.Module | None]:
        """Where this rank's `length` tokens of each sequence start (context parallelism: cp_rank x length), and
        the rotary input the blocks take for them: the table's rows from there, or a Hugging Face rotary module
        as it is (HFBlock places its positions itself). Pipeline stages ask it too (runtime.pipeline).

        Packed documents (docs, over the whole sequence): each token's own position in its document instead of the
        start, (batch, length), and the table's rows at those positions."""
        start = self.cp_rank * length
        if docs is not None:
            positions = docs.positions[:, start:start + length]
            return positions, self.rope[positions] if isinstance(self.rope, torch.Tensor) else self.rope
        if isinstance(self.rope, torch.Tensor) and start:
            return start, self.rope[start:start + length]
        return start, self.rope

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                docs: torch.Tensor | Documents | None = None) -> torch.Tensor:
        """tokens -> logits, or the mean cross-entropy loss when targets are given.

        A pipeline stage without the embedding takes hidden states as `tokens`;
        one without the head returns hidden states. docs: packed examples' document ids over the whole sequence
        (runtime.microbatches), or their Documents (the profile's, its mask made for its target): positions restart
        and attention stays within each document.
        """
        docs = Documents(docs) if isinstance(docs, torch.Tensor) else docs
        start, rope = self.placed(tokens.shape[1], docs)
        h = self.embed(tokens, start) if self.embed is not None else tokens
        for block in self.blocks.values():
            h = block(h, rope, docs)
        if self.head is None:
            return h
        if targets is None:
            return self.head(self.norm(h))
        return chunked_cross_entropy(self.norm(h), self.head, targets)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token loss in fp32; targets of -100 are ignored (masked prompts)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)


LOSS_CHUNK_BYTES = 2**28  # fp32 logits of one chunk of tokens: 256 MiB (512 tokens at a 128k vocabulary)


def chunked_cross_entropy(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor) -> torch.Tensor:
    """cross_entropy(head(hidden), targets) without ever holding the whole tokens x vocabulary logits.

    At 32k tokens and a 128k vocabulary whole fp32 logits are 16 GiB. Each chunk of tokens is projected, scored
    and dropped in forward, and projected again in its backward (torch.utils.checkpoint), so logits exist one
    chunk at a time, for one more head matmul. Short sequences (one chunk) take the plain path.
    """
    h, t = hidden.flatten(0, 1), targets.flatten()
    chunk = max(128, LOSS_CHUNK_BYTES // (4 * head_outputs(head)))
    if h.shape[0] <= chunk:
        return cross_entropy(head(hidden), targets)
    total = sum(checkpoint(_loss_sum, head, h[i:i + chunk], t[i:i + chunk], use_reentrant=False)
                for i in range(0, h.shape[0], chunk))
    return total / (t != -100).sum()  # the mean over target tokens (NaN without any, as cross_entropy's)


def _loss_sum(head: nn.Module, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(h).float(), t, ignore_index=-100, reduction="sum")


def head_outputs(head: nn.Module) -> int:
    """The vocabulary a head projects to (its last linear layer's outputs)."""
    return [m for m in head.modules() if isinstance(m, nn.Linear)][-1].out_features
