"""Per-block sharding through FSDP2, one decision (BlockPlan.zero) per block.

Every block becomes its own FSDP2 unit, and the root unit (the model, or a
pipeline stage's module) holds what is left: embedding, final norm, head. How
each ZeRO stage maps onto FSDP2:

    zero 3  shard parameters, gradients, optimizer states; parameters are
            re-gathered for backward (reshard_after_forward=True)
    zero 2  shard at rest; parameters stay gathered from forward through
            backward (reshard_after_forward=False); sharded gradients and states
    zero 1  same as zero 2. FSDP2 cannot keep persistent unsharded parameters,
            and a hand-written ZeRO-1 would move the same bytes (all-reduce ==
            reduce-scatter + all-gather) while holding *more* (full gradients).
            So the runtime holds what zero 2 holds, and MemoryTracker reports it:
            gradients are sharded after the reduction, unsharded only while
            accumulating (gradient sync off), as ZeRO-1 would hold them.
    zero 0  replicate: FSDP2 on a 2-D (dp, 1) mesh, i.e. HSDP whose shard groups
            have one rank: every rank holds whole parameters, gradients are
            all-reduced, the optimizer steps the whole model on every rank.
            Chosen over DDP (`_composable.replicate`) so that all blocks share
            one runtime: the same gradient-sync switch, mixed-precision policy,
            DTensor state dicts and clipping code. Cost: FSDP2 keeps a second
            (unsharded) copy of the parameters during forward/backward, counted
            as "buffers" by the tracker.

With tensor parallelism (runtime.tensor_parallel, applied first) a unit's weights
are already DTensors split over tp; FSDP2 shards each rank's piece over dp on top
(a 2-D shard), and zero 0 replicates it over dp.

With expert parallelism (runtime.expert_parallel, applied first) each MoE layer's experts are split over ep, and
are a unit of their own inside their block's, as the block's plan says, over the ranks holding the same experts
(ParallelDims.expert_shard): its gradients are reduced there and divided by all dp x cp ranks, as the dense
weights' are (every rank's loss weighs 1 / (dp x cp); the experts' gradients come from the tokens of all ep ranks).

Gradients are reduced once a step (`Plan.grad_reduce` "step": the step runners turn FSDP2's gradient sync off
for every microbatch but the last, so the unsharded gradient accumulates), or after every microbatch
("microbatch": sync stays on, so each backward reduce-scatters and only the fp32 shard accumulates, as FSDP2 and
DeepSpeed's ZeRO-2/3 do by default). Each runner asks `requires_gradient_sync` before a backward.

`offload_params` (zero 3 only, checked by the Plan) adds FSDP2's
CPUOffloadPolicy: the shard, its gradient and its optimizer step live on host.

Frozen parameters (LoRA base weights, frozen blocks) have no gradient, master or
optimizer state, so they are stored in the compute dtype (`store_frozen_in_compute_dtype`,
before sharding): FSDP2 then gathers them without a cast. A zero-0 unit leaves
them out of FSDP2 altogether (`ignored_params`): a replicated weight that is never
reduced needs no second, gathered copy, so a frozen 7B model costs its 2 bytes per
parameter once, not again as FSDP2's unsharded copy. So does a one-rank unit with
NF4 weights (torchao's all-gather hooks need a real all-gather; nothing to shard). A zero-0 block frozen whole
is then no unit at all (`needs_unit`).
"""

from __future__ import annotations

import logging
from collections import Counter
import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from snugfit.model.quantize import check_shardable, is_quantized
from snugfit.plan import BlockPlan, Plan
from snugfit.runtime.expert_parallel import expert_modules
from snugfit.runtime.mesh import ParallelDims

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def mixed_precision(plan: Plan, root: bool) -> MixedPrecisionPolicy:
    """Compute in plan.compute_dtype, reduce in plan.reduce_dtype. FSDP2 casts a parameter stored in another dtype
    (fp32 or bf16 masters, `store_masters`) when it gathers it, and none stored in the compute dtype.

    Only the root casts its output back to fp32: on a block, output_dtype breaks
    the next block's fp32 norm on CPU ("mixed dtype") and costs a cast per block.
    """
    return MixedPrecisionPolicy(
        param_dtype=DTYPES[plan.compute_dtype],
        reduce_dtype=DTYPES[plan.reduce_dtype],
        output_dtype=torch.float32 if root else None,
    )


def offload_policy(block: BlockPlan) -> OffloadPolicy:
    """FSDP2 parameter offload; pinned host memory only where an accelerator exists (CPU-only torch refuses it)."""
    if not block.offload_params:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())


def store_frozen_in_compute_dtype(model: nn.Module, plan: Plan) -> None:
    """Cast the parameters that receive no gradient to the compute dtype (before FSDP2 fixes their dtype)."""
    dtype = DTYPES[plan.compute_dtype]
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad and p.dtype != dtype and not is_quantized(p):  # NF4 stays 4-bit
                p.data = p.data.to(dtype)


def store_masters(model: nn.Module, plan: Plan, skip: set[str] = frozenset()) -> None:
    """Cast the trainable parameters to the master dtype (plan.optimizer.master_weights: bf16 weights are updated
    in place, with stochastic rounding) before FSDP2 fixes their dtype; `skip`: names host offload keeps masters of
    on host, whose device copies are in the compute dtype."""
    if plan.optimizer.master_weights != "bf16":
        return
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and name not in skip and p.dtype != torch.bfloat16:
                p.data = p.data.to(torch.bfloat16)


def needs_unit(module: nn.Module, block: BlockPlan) -> bool:
    """Whether FSDP2 has anything to do for `module`: a zero-0 block whose every parameter is frozen has nothing to
    gather, reduce or cast (its weights are ignored and stored in the compute dtype), and runs without FSDP2's
    hooks, which would otherwise run around each of its forwards and backwards for nothing."""
    return block.zero > 0 or any(p.requires_grad for p in module.parameters())


def shard_unit(module: nn.Module, block: BlockPlan, dims: ParallelDims, mp: MixedPrecisionPolicy,
               ignored: set[nn.Parameter] = frozenset(), experts: bool = False) -> None:
    """Make `module` one FSDP2 unit as `block.zero` says (see the module docstring); `ignored`: parameters of
    its submodules that run without FSDP2 (`needs_unit`); `experts`: split over ep (the module docstring)."""
    shard, replicate = (dims.expert_shard, dims.expert_replicate) if experts else (dims.shard, dims.replicate)
    frozen = {p for p in module.parameters() if not p.requires_grad and (block.zero == 0 or (
        shard.size() == 1 and is_quantized(p)))} | set(ignored)  # torchao's NF4 all-gather fails on one rank
    if block.zero > 0:
        check_shardable(module, shard.size())
    fully_shard(
        module,
        mesh=replicate if block.zero == 0 else shard,
        reshard_after_forward=block.zero == 3,
        mp_policy=mp,
        offload_policy=offload_policy(block),
        ignored_params=frozen or None,
    )
    if experts:
        divide_experts_gradients(module, dims.shard_size, reduce_scatters=block.zero > 0 and shard.size() > 1)


def divide_experts_gradients(module: nn.Module, ranks: int, reduce_scatters: bool) -> None:
    """Divide an experts unit's reduced gradients by all `ranks` (dp x cp) instead of the ranks it reduces over.
    torch 2.13 runs a divide factor other than the group's size as PREMUL_SUM, which gloo lacks; summing then
    dividing instead (`set_force_sum_reduction_for_comms`) is right where a reduce-scatter runs, but where none
    does (one rank per shard group, zero 0's HSDP included) FSDP2 divides the copy by the factor and then again."""
    module.set_gradient_divide_factor(float(ranks))
    module.set_force_sum_reduction_for_comms(reduce_scatters)


def requires_gradient_sync(plan: Plan, last: bool) -> bool:
    """Whether FSDP2 reduces the gradients in this backward: in every one where the plan reduces every microbatch,
    else in the step's `last` only (one microbatch: its backward is the last)."""
    return last or plan.grad_reduce == "microbatch"


def apply_fsdp(
    root: nn.Module, blocks: dict[str, nn.Module], plan: Plan, dims: ParallelDims, output_fp32: bool = True,
) -> None:
    """Shard `blocks` (their index in the model, as a string -> block; block i follows plan.blocks[i]) then the
    root unit. `output_fp32`: the root casts its output to fp32; a pipeline stage before the last sends hidden
    states in the compute dtype instead (half the bytes in bf16, as the time model charges).
    """
    indices = [int(name) for name in blocks]
    mp = mixed_precision(plan, root=False)
    plain: set[nn.Parameter] = set()  # of frozen blocks that need no unit
    for i, block in zip(indices, blocks.values()):
        if plan.ep > 1:
            for experts in expert_modules(block):
                shard_unit(experts, plan.blocks[i], dims, mp, experts=True)
        if needs_unit(block, plan.blocks[i]):
            shard_unit(block, plan.blocks[i], dims, mp)
        else:
            plain |= set(block.parameters())
    shard_unit(root, plan.root, dims, mixed_precision(plan, root=output_fp32), plain)
    stages = Counter(f"zero{plan.blocks[i].zero}" + ("+offload_params" if plan.blocks[i].offload_params else "")
                     for i in indices)
    frozen = sum(not needs_unit(b, plan.blocks[i]) for i, b in zip(indices, blocks.values()))
    log.debug(  # every engine the calibration builds says it too: the printed plan is the user's line
        "fsdp: dp x cp=%d, %d blocks %s%s, root zero%d%s, params %s, reduce %s every %s",
        dims.shard_size, len(indices), dict(stages), f" ({frozen} frozen ones without FSDP2)" if frozen else "",
        plan.root.zero,
        "+offload_params" if plan.root.offload_params else "", plan.compute_dtype, plan.reduce_dtype,
        plan.grad_reduce,
    )
