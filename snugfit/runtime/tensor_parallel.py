"""apply_tp: Megatron-style tensor parallelism with sequence parallelism, through torch's DTensor TP API.

Per block (`parallelize_module`, as torchtitan's parallelize_llama lays it out):

    norms                      SequenceParallel: each rank normalises its slice of the sequence
    attention / MLP input      all-gathered from sequence slices to the whole sequence (PrepareModuleInput)
    q, k, v, gate, up          column-wise: each rank computes its heads / its share of the MLP hidden size
    o, down                    row-wise, reduce-scattered back to sequence slices

The residual stream between blocks stays a DTensor sharded on the sequence, so a block sees the global
sequence length (position ids, rotary tables) without knowing about tensor parallelism. The embedding is
split by vocabulary (row-wise) and hands the blocks sequence slices; the final norm runs on the whole
sequence and the head is split by vocabulary. Its logits stay split (`Shard(-1)`): the loss, chunked or not,
is the plain F.cross_entropy, which torch's `loss_parallel` computes from each rank's slice of the vocabulary
with three small all-reduces per chunk, never gathering tokens x vocabulary logits on a rank. The engines run
forward and backward under `vocab_parallel_loss(plan)`, as loss_parallel requires, and take the loss, a
replicated DTensor, as a plain tensor (`runtime.memory.local`).

Which modules are split is found by name: the built-in decoder's blocks (`attn.q` ... `mlp.down`) and the Hugging
Face Llama-family layers (`self_attn.q_proj` ... `mlp.down_proj`: Llama, Mistral, Qwen2). Heads, key/value
heads, the MLP hidden size, the vocabulary and the sequence must divide by tp.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from snugfit.model.lora import expert_weights
from snugfit.model.quantize import is_quantized
from snugfit.model.tiled_mlp import untileable
from snugfit.runtime.context_parallel import hf_attention
from snugfit.plan import Plan
from snugfit.plan.facts import ModelFacts

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class BlockLayout:
    """Where a block's pieces are, by module name inside the block."""

    attn_norm: str
    attn: str
    attn_columns: tuple[str, ...]  # split by heads: q, k, v
    attn_row: str  # o: its partial sums reduce-scattered back to sequence slices
    mlp_norm: str
    mlp: str
    mlp_columns: tuple[str, ...]  # split by the hidden size (gate where the MLP has one, up)
    mlp_row: str  # down
    attn_takes_keywords: bool  # HF attention takes hidden_states by keyword, the built-in one (x, rope, docs)

    def missing(self, block: nn.Module) -> set[str]:
        """The modules this layout needs that `block` lacks."""
        have = {n for n, _ in block.named_modules()}
        need = {self.attn_norm, self.mlp_norm, f"{self.mlp}.{self.mlp_row}", f"{self.mlp}.{self.mlp_columns[-1]}",
                *(f"{self.attn}.{n}" for n in (*self.attn_columns, self.attn_row))}
        return need - have

    def plan(self, block: nn.Module) -> dict:
        """The parallelize_module plan of `block`."""
        if self.attn_takes_keywords:
            gather_attn = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                             desired_input_kwarg_layouts={"hidden_states": Replicate()})
        else:  # attn(x, rope, docs): gather x, leave the rotary table and the document ids
            gather_attn = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                             desired_input_layouts=(Replicate(), None, None))
        have = {n for n, _ in block.named_modules()}
        return {
            self.attn_norm: SequenceParallel(),
            self.attn: gather_attn,
            **{f"{self.attn}.{n}": ColwiseParallel() for n in self.attn_columns},
            f"{self.attn}.{self.attn_row}": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            self.mlp_norm: SequenceParallel(),
            self.mlp: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            **{f"{self.mlp}.{n}": ColwiseParallel() for n in self.mlp_columns if f"{self.mlp}.{n}" in have},
            f"{self.mlp}.{self.mlp_row}": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        }


LAYOUTS = (
    BlockLayout("attn_norm", "attn", ("q", "k", "v"), "o", "mlp_norm", "mlp", ("gate", "up"), "down", False),
    BlockLayout("layer.input_layernorm", "layer.self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj",
                "layer.post_attention_layernorm", "layer.mlp", ("gate_proj", "up_proj"), "down_proj", True),
)


def block_layout(block: nn.Module) -> BlockLayout | None:
    """The layout `block` has, or None where tensor parallelism has none for it."""
    return next((layout for layout in LAYOUTS if not layout.missing(block)), None)


def _out_features(linear: nn.Module) -> int | None:
    """A linear's output width, through the wrappers that keep it as `base` (LoRA adapters)."""
    while not hasattr(linear, "out_features") and hasattr(linear, "base"):
        linear = linear.base
    return getattr(linear, "out_features", None)


def model_facts(model: nn.Module) -> ModelFacts:
    """What the rules (plan.rules) need to know of the module: the sizes tensor parallelism splits, read off its
    first block (every block has the same shape), its length limit, and what no split handles yet."""
    cfg = getattr(model, "cfg", None)
    block = next(iter(model.blocks.values()))
    layout = block_layout(block)
    sizes = {}
    if layout is not None:
        attn = block.get_submodule(layout.attn)
        head_dim = getattr(attn, "head_dim", None) or getattr(getattr(attn, "cfg", None), "head_dim", None)
        q, k = (_out_features(block.get_submodule(f"{layout.attn}.{name}")) for name in layout.attn_columns[:2])
        if head_dim and q and k:
            sizes = dict(heads=q // head_dim, kv_heads=k // head_dim)
        sizes["mlp_hidden"] = _out_features(block.get_submodule(f"{layout.mlp}.{layout.mlp_columns[-1]}"))
    return ModelFacts(**sizes, vocabulary=getattr(cfg, "vocab_size", None),
                      max_seq_len=getattr(cfg, "max_seq_len", None),
                      tied_embeddings=bool(getattr(cfg, "tie_embeddings", False)),
                      adapters=any(type(m).__name__.startswith("LoRA") for m in model.modules()),
                      n_experts=getattr(cfg, "n_experts", 0) or 0, top_k=getattr(cfg, "top_k", 0) or 0,
                      unsplittable_block="Mixture-of-Experts blocks" if getattr(cfg, "n_experts", 0)
                      else None if layout else type(getattr(block, "layer", block)).__name__,
                      untileable_mlp=untileable(block), attention=type(getattr(block, "layer", block)).__name__,
                      sequence_splits=hasattr(getattr(block, "attn", None), "attend")
                      or hf_attention(block) is not None,
                      nf4_experts=any(is_quantized(p) for p in model.parameters())
                      and any(expert_weights(b) for b in model.blocks.values()))


def vocab_parallel_loss(plan: Plan) -> AbstractContextManager:
    """The context a step's forward and backward run in: torch's loss_parallel where the head's logits are split
    by vocabulary (tp > 1), else nothing."""
    return loss_parallel() if plan.tp > 1 else nullcontext()


def apply_tp(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split `model`'s pieces that are present (a pipeline rank keeps only its own) over the tp mesh."""
    if model.embed is not None:
        # Row-wise over the vocabulary with whole outputs, then sliced along the sequence: the blocks get a
        # DTensor sharded on it whatever else the embedding adds (learned positions) to the token vectors.
        parallelize_module(model.embed, mesh, {
            "tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())})
        parallelize_module(model.embed, mesh, PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False))
    for block in model.blocks.values():
        parallelize_module(block, mesh, block_layout(block).plan(block))
    if model.head is not None:
        # The final norm runs on the whole sequence (its weight stays a plain tensor: every tp rank computes
        # the same gradient), so the loss may slice tokens as it likes (chunked cross-entropy).
        parallelize_module(model.norm, mesh, PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True))
        head = [m for m in model.head.modules() if isinstance(m, nn.Linear)][-1]
        parallelize_module(head, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
    log.info("tensor parallel: %d blocks%s split over %d ranks (sequence parallel)", len(model.blocks),
             "".join(f" + {name}" for name in ("embed", "head") if getattr(model, name) is not None), mesh.size())
