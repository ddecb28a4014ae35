"""apply_tp: Megatron-style tensor parallelism with sequence parallelism, through torch's DTensor TP API.

Per block (`parallelize_module`, as torchtitan's parallelize_llama lays it out):

    norms                      SequenceParallel: each rank normalises its slice of the sequence
    attention / MLP input      all-gathered from sequence slices to the whole sequence (PrepareModuleInput)
    q, k, v, gate, up          column-wise: each rank computes its heads / its share of the MLP hidden size
    o, down                    row-wise, reduce-scattered back to sequence slices

The residual stream between blocks stays a DTensor sharded on the sequence, so a block sees the global
sequence length (position ids, rotary tables) without knowing about tensor parallelism. The embedding is
split by vocabulary (row-wise) and hands the blocks sequence slices; the final norm runs on the whole
sequence and the head is split by vocabulary with its logits gathered (`Replicate`), so the loss, chunked or
not, is the plain one. Gathering logits costs memory a vocabulary-parallel loss (`loss_parallel`) would save;
that is left for later.

Which modules are split is found by name: the built-in decoder's blocks (`attn.q` ... `mlp.down`) and the Hugging
Face Llama-family layers (`self_attn.q_proj` ... `mlp.down_proj`: Llama, Mistral, Qwen2). Heads, key/value
heads, the MLP hidden size, the vocabulary and the sequence must divide by tp.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from snugfit.plan import Plan, PlanError

# (attention norm, attention, its column-wise projections, its row-wise one,
#  MLP norm, MLP, its column-wise projections, its row-wise one, how the attention takes its input)
BLOCK_LAYOUTS = {
    "built-in": ("attn_norm", "attn", ("q", "k", "v"), "o", "mlp_norm", "mlp", ("gate", "up"), "down", "args"),
    "hf-llama": ("layer.input_layernorm", "layer.self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj",
                 "layer.post_attention_layernorm", "layer.mlp", ("gate_proj", "up_proj"), "down_proj", "kwargs"),
}


def block_layout(block: nn.Module) -> str:
    """Which of BLOCK_LAYOUTS `block` has, or a PlanError naming the block type."""
    names = {n for n, _ in block.named_modules()}
    for kind, (a_norm, attn, cols, row, m_norm, mlp, mcols, mrow, _) in BLOCK_LAYOUTS.items():
        wanted = [a_norm, m_norm, *(f"{attn}.{n}" for n in (*cols, row)), f"{mlp}.{mrow}", f"{mlp}.{mcols[-1]}"]
        if all(n in names for n in wanted):
            return kind
    inner = getattr(block, "layer", block)
    raise PlanError(f"tensor parallelism splits the built-in decoder's and Llama-family (Llama, Mistral, Qwen2) "
                    f"blocks, not {type(inner).__name__}; plan with tp 1")


def _block_plan(kind: str, block: nn.Module) -> dict:
    a_norm, attn, cols, row, m_norm, mlp, mcols, mrow, call = BLOCK_LAYOUTS[kind]
    if call == "args":  # attn(x, rope): gather x, leave the rotary table
        gather_attn = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
    else:  # HF attention takes hidden_states by keyword
        gather_attn = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                         desired_input_kwarg_layouts={"hidden_states": Replicate()})
    out = {
        a_norm: SequenceParallel(),
        attn: gather_attn,
        **{f"{attn}.{n}": ColwiseParallel() for n in cols},
        f"{attn}.{row}": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        m_norm: SequenceParallel(),
        mlp: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        **{f"{mlp}.{n}": ColwiseParallel() for n in mcols if _has(block, f"{mlp}.{n}")},
        f"{mlp}.{mrow}": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    return out


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
        return True
    except AttributeError:
        return False


def check_tp(model: nn.Module, plan: Plan) -> None:
    """Refuse, before anything is split, a tp the model or the plan cannot run."""
    if plan.tp == 1:
        return
    tp, cfg = plan.tp, model.cfg
    if getattr(cfg, "tie_embeddings", False):
        raise PlanError("tensor parallelism cannot split tied embedding and head weights; plan with tp 1 "
                        "or untie them (model.tie_embeddings = false)")
    if any(type(m).__name__.startswith("LoRA") for m in model.modules()):
        raise PlanError("tensor parallelism does not split LoRA adapters yet; plan LoRA with tp 1")
    for block in model.blocks.values():
        kind = block_layout(block)
        _, attn, cols, _, _, mlp, mcols, _, _ = BLOCK_LAYOUTS[kind]
        sizes = {f"{attn}.{n}": block.get_submodule(f"{attn}.{n}").out_features for n in cols}
        sizes[f"{mlp}.{mcols[-1]}"] = block.get_submodule(f"{mlp}.{mcols[-1]}").out_features
        head_dim = getattr(getattr(block, "attn", None), "cfg", None)
        head_dim = head_dim.head_dim if head_dim is not None else block.layer.self_attn.head_dim
        for name, n in sizes.items():
            units = n // head_dim if name.startswith(attn) else n
            if units % tp:
                what = "heads" if name.startswith(attn) else "outputs"
                raise PlanError(f"tp {tp} does not divide {name}'s {units} {what}; choose a tp that divides the "
                                "model's heads, key/value heads and MLP hidden size")
        break  # every block has the same shape
    if cfg.vocab_size % tp:
        raise PlanError(f"tp {tp} does not divide the vocabulary ({cfg.vocab_size}); choose a tp that divides it")
    if plan.seq_len % tp:
        raise PlanError(f"plan.seq_len ({plan.seq_len}) must divide by tp ({tp}): sequence parallelism gives each "
                        "rank an equal slice; choose another --seq or --tp")
    if plan.pp > 1 and plan.schedule == "bpipe":
        raise PlanError("BPipe's activation eviction does not move tensor-parallel activations yet; use schedule "
                        "1f1b or interleaved with tp > 1")
    units = [plan.root, *plan.blocks]
    if any(u.offload_optimizer or u.offload_params for u in units) or any(
            b.activations == "offload" for b in plan.blocks):
        raise PlanError("tensor parallelism does not combine with host offload (optimizer, parameters or "
                        "activations) yet; plan those with tp 1")


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
        parallelize_module(block, mesh, _block_plan(block_layout(block), block))
    if model.head is not None:
        # The final norm runs on the whole sequence (its weight stays a plain tensor: every tp rank computes
        # the same gradient), so the loss may slice tokens as it likes (chunked cross-entropy).
        parallelize_module(model.norm, mesh, PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True))
        head = [m for m in model.head.modules() if isinstance(m, nn.Linear)][-1]
        parallelize_module(head, mesh, ColwiseParallel(output_layouts=Replicate()))
