"""parallelize: turn one part of a plain model (the whole model, or one pipeline stage) into what the Plan says.

Reads like torchtitan's parallelize functions: one `apply_*` per technique, each taking only its part of the
Plan, in the order they compose: context parallelism (`apply_cp`), tensor parallelism (`apply_tp`), expert
parallelism (`shard_experts`), tiled MLPs
(`apply_mlp_tiles`), activation policies, FSDP2 (`apply_fsdp`).
Around them, once per rank and its whole (pruned) model: `place` casts frozen weights, sets up partial host
offload and moves the model to its device; `read_weights` fills a model built on the meta device after
sharding, each rank reading only what it holds. runtime.build runs them in that order.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.nn as nn

from snugfit.model.tiled_mlp import tile_mlp
from snugfit.plan import Plan, PlanError
from snugfit.runtime.activations import apply_activation_policy
from snugfit.runtime.compile import compile_block
from snugfit.runtime.context_parallel import apply_cp
from snugfit.runtime.dist import DistEnv
from snugfit.runtime.expert_parallel import shard_experts
from snugfit.runtime.mesh import ParallelDims
from snugfit.runtime.offload import HostOffload
from snugfit.runtime.sharding import DTYPES, apply_fsdp, store_frozen_in_compute_dtype, store_masters
from snugfit.runtime.tensor_parallel import apply_tp, model_facts

log = logging.getLogger(__name__)


class Weights(Protocol):
    """What fills a model built on the meta device once `read_weights` has allocated this rank's shards:
    model.hf.FolderWeights (a Hugging Face folder), train.build.InitWeights (the built-in model's init)."""

    def fill(self, model: nn.Module, device: torch.device) -> object:
        """Fill the model's allocated tensors (this rank's rows); draw adapters; tie what the model ties."""

    def master(self, model: nn.Module, name: str, like: torch.Tensor) -> torch.Tensor | None:
        """Parameter `name`'s rows that `like` holds, fp32 on CPU (host offload's masters); None if it has none."""


def check_launch(model: nn.Module, plan: Plan, env: DistEnv) -> None:
    """Refuse, before the first step, a plan this model and this launch cannot run as written: every rule of the
    plan's (plan.rules) beside the module's facts."""
    plan.validate(n_blocks=len(model.blocks), world_size=env.world_size, facts=model_facts(model))
    # the runtime's limit, not the plan's: the planner models float16 reductions (bench/plan_choices compares them)
    if plan.reduce_dtype == "float16":
        raise PlanError("plan: reduce_dtype float16 would overflow summing scaled gradients; reduce in float32")


def offload_units(model: nn.Module, plan: Plan) -> list[tuple[nn.Module, list[str]]]:
    """(unit module, trainable parameter names) of the units of `model` (this rank's part of it) whose plan says
    offload_optimizer, root first; names are FQNs in `model`, the module the state dict is taken from."""
    blocks = dict(model.blocks.items())
    block_ids = {id(p) for b in blocks.values() for p in b.parameters()}
    units = []
    if plan.root.offload_optimizer:
        units.append((model, [n for n, p in model.named_parameters() if id(p) not in block_ids and p.requires_grad]))
    for name, block in blocks.items():
        if plan.blocks[int(name)].offload_optimizer:
            units.append((block, [f"blocks.{name}.{n}" for n, p in block.named_parameters() if p.requires_grad]))
    return [(module, names) for module, names in units if names]  # frozen units have nothing to step


def apply_mlp_tiles(blocks: dict[str, nn.Module], plan: Plan) -> None:
    """Each block's MLP over mlp_tiles tiles of the sequence (model.tiled_mlp), before its activation policy, so a
    recomputed block recomputes it tiled too; blocks by their index in the model."""
    tiles = {name: plan.blocks[int(name)].mlp_tiles for name in blocks}
    for name, block in blocks.items():
        tile_mlp(block, tiles[name])
    if any(t > 1 for t in tiles.values()):
        log.debug("tiled MLP: %s", {t: list(tiles.values()).count(t) for t in sorted(set(tiles.values()))})


def apply_activations(blocks: dict[str, nn.Module], plan: Plan) -> None:
    """Saved-activation policy per block (keep, recompute, selective, offload; see runtime.activations), and each
    block compiled between its recomputation and its saved-tensor hooks where the plan compiles (runtime.compile);
    blocks by their index in the model."""
    for name, block in blocks.items():
        apply_activation_policy(block, plan.blocks[int(name)].activations, compile_block if plan.compile else None)
    policies = [plan.blocks[int(name)].activations for name in blocks]
    log.debug("activations: %s%s", {p: policies.count(p) for p in sorted(set(policies))},
             ", blocks compiled" if plan.compile else "")


def parallelize(part: nn.Module, plan: Plan, dims: ParallelDims, output_fp32: bool = True) -> None:
    """Tensor parallelism, activation policies and FSDP2 (per block, then the part as the root unit of what is
    left), on one part of the model: the model itself, or one pipeline stage (runtime.pipeline.StageModule).
    Either has `embed`, `blocks` (by their index in the model), `norm` and `head`, None where it lacks them.
    output_fp32: the root casts its output to fp32 (the last stage's logits; other stages send the compute
    dtype)."""
    blocks = dict(part.blocks.items())
    if plan.cp > 1:
        apply_cp(part, dims.cp_group, plan.cp, dims.cp_rank)
    if plan.tp > 1:
        apply_tp(part, dims.tp_mesh)
    if plan.ep > 1:
        shard_experts(part, dims.ep_mesh)
    apply_mlp_tiles(blocks, plan)
    apply_activations(blocks, plan)
    if not plan.runs_unwrapped:
        apply_fsdp(part, blocks, plan, dims, output_fp32=output_fp32)


def place(model: nn.Module, plan: Plan, device: torch.device, weights: Weights | None) -> HostOffload | None:
    """Frozen parameters and partial offload's units cast to the compute dtype, the other trainable ones to the
    master dtype (before FSDP2), then the model on `device`. A model still on the meta device stays there for
    `read_weights` after sharding."""
    store_frozen_in_compute_dtype(model, plan)
    units = offload_units(model, plan)
    master = torch.bfloat16 if plan.optimizer.master_weights == "bf16" else torch.float32
    host = HostOffload(model, units, DTYPES[plan.compute_dtype], weights, master) if units else None
    store_masters(model, plan, skip={n for _, names in units for n in names})
    if not _on_meta(model):
        model.to(device)
    return host


def read_weights(model: nn.Module, plan: Plan, device: torch.device, weights: Weights | None) -> None:
    """Allocate a sharded model still on the meta device where the plan puts each unit (on host the units
    whose parameters FSDP2 offloads, so a card never holds them, even at start-up), then fill it: each rank
    holds its own rows and at most one whole tensor more, never the whole model."""
    if weights is None or not _on_meta(model):
        return
    on_host = {id(m) for i, b in model.blocks.items() if plan.blocks[int(i)].offload_params for m in b.modules()}
    if plan.root.offload_params:
        in_blocks = {id(m) for b in model.blocks.values() for m in b.modules()}
        on_host |= {id(m) for m in model.modules() if id(m) not in in_blocks}
    for m in model.modules():
        m.to_empty(device=torch.device("cpu") if id(m) in on_host else device, recurse=False)
    weights.fill(model, device)


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())
