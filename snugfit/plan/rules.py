"""The compatibility rules: which parts of a plan cannot go together, each written once, with its fix.

A rule reads named parts of a plan: plan-wide ones (the Shape's: degrees, schedule, virtual stages, microbatches,
gradient reduction, evict bound, compiled blocks; the compute dtype, the step in backward) and one unit's (ZeRO
stage, state placement, activation policy). `Plan.validate` checks every
unit of a plan against the table, so the planner, `snugfit plan --plan-file` and `snugfit train` refuse a plan
with the same line. The parts a user fixes for a search (plan.options.Constraints) are checked against the same
rules wherever every part a rule reads is fixed, and the search offers a unit option only where no rule forbids
it beside the candidate's degrees and schedule (`allows`). Pure: no torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Callable

from snugfit.plan.facts import ModelFacts
from snugfit.plan.placement import Placement
from snugfit.plan.policies import ACTIVATION_POLICIES
from snugfit.plan.schedules import SCHEDULES
from snugfit.plan.shape import SHAPE_FIELDS, Shape


def _optional(annotation: str) -> str:
    return annotation if "None" in annotation else f"{annotation} | None"


# What the rules read; None where a part is not fixed (yet): Shape's fields, all optional (derived from Shape, so
# a new plan-wide part is one field there), then the plan-wide numerics and one unit's parts.
Parts = make_dataclass("Parts", [
    *((f.name, _optional(f.type), field(default=None)) for f in fields(Shape)),
    ("seq_len", int | None, field(default=None)),
    ("compute_dtype", str | None, field(default=None)),
    ("in_backward", bool | None, field(default=None)),  # each unit steps in backward (plan.OptimizerPlan)
    ("zero", int | None, field(default=None)),  # the unit's
    ("placement", Placement | None, field(default=None)),  # the unit's (plan.placement)
    ("activations", str | None, field(default=None)),  # a block's policy (the root's pieces always keep theirs)
    ("mlp_tiles", int | None, field(default=None)),  # a block's MLP tiles (model.tiled_mlp; the root's: 1)
    ("model", ModelFacts | None, field(default=None)),  # what the rules need to know of the model (plan.facts)
], frozen=True)


def parts_of(fixed: object, **rest) -> Parts:
    """The parts `fixed` gives (a Shape, a candidate, the user's Constraints: each of Shape's fields it has, None
    where it has none), and `rest` (the numerics, one unit's parts) over them."""
    return Parts(**{**{name: getattr(fixed, name, None) for name in SHAPE_FIELDS}, **rest})


@dataclass(frozen=True)
class Rule:
    reads: tuple[str, ...]  # the parts it needs fixed
    broken: Callable[[Parts], bool]
    says: Callable[[Parts], str]  # the problem; the fix


def _splits(p: Parts) -> bool:
    return SCHEDULES[p.schedule].splits_backward


def _undivided(p: Parts) -> list[str]:
    """The model's sizes (and the sequence, which sequence parallelism splits) that tp does not divide."""
    sizes = {**p.model.split_sizes(), "sequence length": p.seq_len}
    return [f"{name} ({n})" for name, n in sizes.items() if n and n % p.tp]


def _tiled(p: Parts) -> bool:
    return p.mlp_tiles > 1


# a tiled MLP (model.tiled_mlp) runs over tiles of each micro-batch's sequence, its backward in one pass
TILE_RULES = (
    Rule(("mlp_tiles", "seq_len"), lambda p: p.seq_len % p.mlp_tiles != 0,
         lambda p: f"mlp_tiles {p.mlp_tiles} must divide the sequence length ({p.seq_len}); choose tiles that divide "
                   "it"),
    Rule(("mlp_tiles", "activations"), lambda p: _tiled(p) and ACTIVATION_POLICIES[p.activations].selective,
         lambda p: f"activation policy {p.activations} keeps the MLP's matmul outputs, which a tiled MLP never "
                   f"holds whole (mlp_tiles {p.mlp_tiles}); use recompute or keep, or mlp_tiles 1"),
    Rule(("mlp_tiles", "compile"), lambda p: _tiled(p) and p.compile,
         lambda p: f"a compiled block cannot trace a tiled MLP's backward (mlp_tiles {p.mlp_tiles}); drop --compile "
                   "or use mlp_tiles 1"),
    Rule(("mlp_tiles", "tp"), lambda p: _tiled(p) and p.tp > 1,
         lambda p: f"a tiled MLP (mlp_tiles {p.mlp_tiles}) under tensor parallelism (tp {p.tp}) is not built yet; "
                   "use tp 1 or mlp_tiles 1"),
    Rule(("mlp_tiles", "schedule"), lambda p: _tiled(p) and SCHEDULES[p.schedule].splits_backward,
         lambda p: f"schedule {p.schedule!r} splits each backward into an input and a weight pass, and a tiled MLP "
                   f"(mlp_tiles {p.mlp_tiles}) differentiates both in one; use mlp_tiles 1 or another schedule"),
)
TILE_MODEL_RULE = Rule(("mlp_tiles", "model"), lambda p: _tiled(p) and p.model.untileable_mlp is not None,
                       lambda p: f"mlp_tiles {p.mlp_tiles}: {p.model.untileable_mlp} cannot be tiled; use mlp_tiles 1")


def _cp_undivided(p: Parts) -> list[str]:
    """The heads and sequence that cp x tp must divide (Ulysses splits the heads over cp within each tp rank's,
    and each cp chunk of the sequence over tp's sequence parallelism); key/value heads are repeated instead."""
    sizes = {"attention heads": p.model.heads, "sequence length": p.seq_len}
    return [f"{name} ({n})" for name, n in sizes.items() if n and n % (p.cp * p.tp)]


# Context parallelism (runtime.context_parallel): what it splits, and what it does not combine with yet; the plan's
# own parts, then beside the model's facts (compiled blocks trace its all-to-alls: torch's functional collectives)
CP_RULES: tuple[Rule, ...] = (
    Rule(("cp", "seq_len"), lambda p: p.cp > 1 and p.seq_len % p.cp,
         lambda p: f"cp {p.cp} does not divide the sequence length ({p.seq_len}); choose a cp that divides it"),
)
CP_MODEL_RULES: tuple[Rule, ...] = (
    Rule(("cp", "tp", "model", "seq_len"), lambda p: p.cp > 1 and bool(_cp_undivided(p)),
         lambda p: f"cp {p.cp} x tp {p.tp} does not divide the model's {', '.join(_cp_undivided(p))}; choose cp "
                   "and tp whose product divides them"),
    Rule(("cp", "model"), lambda p: p.cp > 1 and not p.model.sequence_splits,
         lambda p: f"context parallelism (cp {p.cp}) runs the built-in decoder's attention and Hugging Face "
                   f"attention without per-head sinks, not {p.model.attention or 'this model'}'s; plan with cp 1"),
)

# Expert parallelism (issue 44 item 2): what the model must have for it (all read beside the model's facts, as
# training and planning read them), so a user learns every fix at once
EP_RULES: tuple[Rule, ...] = (
    Rule(("ep", "model"), lambda p: p.ep > 1 and p.model.n_experts == 0,
         lambda p: f"expert parallelism (ep {p.ep}) splits Mixture-of-Experts blocks, and this model is dense; "
                   "use ep 1"),
    Rule(("ep", "model"), lambda p: p.ep > 1 and p.model.n_experts % p.ep,
         lambda p: f"ep {p.ep} does not divide the model's {p.model.n_experts} experts; choose an ep that divides "
                   "them"),
    Rule(("ep", "model"), lambda p: p.ep > 1 and p.model.n_experts and not p.model.expert_splits,
         lambda p: f"expert parallelism (ep {p.ep}) splits the built-in decoder's experts, not "
                   f"{p.model.attention or 'this model'}'s Hugging Face ones yet; use ep 1"),
)


RULES: tuple[Rule, ...] = (
    Rule(("ep", "dp", "cp"), lambda p: p.ep > 1 and (p.dp * p.cp) % p.ep,
         lambda p: f"ep {p.ep} does not divide the dp x cp ranks ({p.dp} x {p.cp}); expert groups sit within them, "
                   "so choose an ep that divides dp x cp"),
    *CP_RULES,
    Rule(("schedule", "pp", "virtual_stages", "num_microbatches"),
         lambda p: SCHEDULES[p.schedule].problem(p.pp, p.virtual_stages, p.num_microbatches) is not None,
         lambda p: SCHEDULES[p.schedule].problem(p.pp, p.virtual_stages, p.num_microbatches)),
    Rule(("schedule", "evict_bound"), lambda p: not SCHEDULES[p.schedule].evicts,
         lambda p: f"evict_bound is only meaningful with a schedule that evicts "
                   f"({', '.join(n for n, s in SCHEDULES.items() if s.evicts)}); drop it or change the schedule"),
    Rule(("tp", "schedule"), lambda p: p.tp > 1 and not SCHEDULES[p.schedule].tensor_parallel,
         lambda p: f"tp {p.tp} does not combine with schedule {p.schedule!r} yet (its activation moves are not "
                   "tensor-parallel); use tp 1 or another schedule"),
    Rule(("tp", "placement"), lambda p: p.tp > 1 and p.placement.states_on_host,
         lambda p: f"tp {p.tp} does not combine with host offload ({p.placement.words}: placement "
                   f"{p.placement.value!r}) yet; keep the unit's states on the device or use tp 1"),
    Rule(("tp", "activations"), lambda p: p.tp > 1 and ACTIVATION_POLICIES[p.activations].on_host,
         lambda p: f"tp {p.tp} does not combine with host offload (activations: {p.activations}) yet; choose a "
                   "policy that keeps them on the device or use tp 1"),
    Rule(("placement", "zero"), lambda p: p.placement.params_on_host and p.zero != 3,
         lambda p: f"placement {p.placement.value!r} (--offload-params) needs zero 3 (parameters are offloaded as "
                   "shards); set zero 3"),
    Rule(("schedule", "zero"), lambda p: _splits(p) and p.zero == 3,
         lambda p: f"schedule {p.schedule!r} splits each backward into an input and a weight pass, which needs "
                   "units gathered from forward to backward (torch finds the weights to differentiate by the "
                   "module's parameters as the input pass starts; ZeRO-3 has resharded them); use zero <= 2 or "
                   "another schedule"),
    Rule(("schedule", "activations"), lambda p: _splits(p) and not ACTIVATION_POLICIES[p.activations].backward_twice,
         lambda p: f"schedule {p.schedule!r} splits each backward into an input and a weight pass, and activation "
                   f"policy {p.activations} allows one backward (torch's selective checkpoint); choose another "
                   "policy or schedule"),
    # A split backward's weight gradients are made in W passes and reduced once, after the stage's last one (the
    # rule below): a unit's gradient is step-wide anyway, and the step in backward would save nothing
    Rule(("schedule", "in_backward"), lambda p: _splits(p) and p.in_backward,
         lambda p: f"the step in backward steps each unit as its backward reduces the gradient, but schedule "
                   f"{p.schedule!r} makes weight gradients in later weight passes, reduced once a step; step after "
                   f"backward (optimizer_in_backward false) or use a schedule that does not split backward "
                   f"({', '.join(n for n, s in SCHEDULES.items() if s.pipelined and not s.splits_backward)})"),
    Rule(("schedule", "grad_reduce"), lambda p: _splits(p) and p.grad_reduce == "microbatch",
         lambda p: f"grad_reduce 'microbatch' reduces as each backward makes the gradients, but schedule "
                   f"{p.schedule!r} makes them in a later weight pass; use grad_reduce 'step'"),
    Rule(("schedule", "compile"), lambda p: _splits(p) and p.compile,
         lambda p: f"schedule {p.schedule!r} splits each backward into an input and a weight pass, and a compiled "
                   "block has one backward graph; drop --compile or use a schedule that does not split backward "
                   f"({', '.join(n for n, s in SCHEDULES.items() if s.pipelined and not s.splits_backward)})"),
    Rule(("in_backward", "num_microbatches", "grad_reduce"),
         lambda p: p.in_backward and p.num_microbatches > 1 and p.grad_reduce == "step",
         lambda p: "the step in backward needs one microbatch per step or gradients reduced every microbatch, but "
                   f"the plan accumulates {p.num_microbatches} microbatches and reduces once a step; set grad_reduce "
                   "'microbatch' (--grad-reduce microbatch) or one microbatch"),
    Rule(("in_backward", "compute_dtype"), lambda p: p.in_backward and p.compute_dtype == "float16",
         lambda p: "the step in backward cannot run under float16's loss scaling (an overflow must be found before "
                   "any unit steps); compute in bfloat16 or step after backward"),
    *TILE_RULES,
    # what the model allows (plan.facts), read by the planner from its profile and by the runtime from the module
    Rule(("tp", "model", "seq_len"), lambda p: p.tp > 1 and bool(_undivided(p)),
         lambda p: f"tp {p.tp} does not divide the model's {', '.join(_undivided(p))}; choose a tp that divides them"),
    Rule(("tp", "model"), lambda p: p.tp > 1 and p.model.tied_embeddings,
         lambda p: "tensor parallelism cannot split tied embedding and head weights; plan with tp 1 or untie them "
                   "(model.tie_embeddings = false)"),
    Rule(("tp", "model"), lambda p: p.tp > 1 and p.model.adapters,
         lambda p: "tensor parallelism does not split LoRA adapters yet; plan LoRA with tp 1"),
    Rule(("tp", "model"), lambda p: p.tp > 1 and p.model.unsplittable_block is not None,
         lambda p: f"tensor parallelism splits the built-in decoder's and Llama-family (Llama, Mistral, Qwen2) "
                   f"blocks, not {p.model.unsplittable_block}; plan with tp 1"),
    TILE_MODEL_RULE,
    *CP_MODEL_RULES,
    *EP_RULES,
    Rule(("model",), lambda p: p.model.nf4_experts,
         lambda p: "NF4 does not quantize expert weights yet (torchao's NF4 holds 2-D weights, the experts are 3-D); "
                   "use --lora-rank without --quantize-base nf4 (a bf16 base)"),
    Rule(("seq_len", "model"), lambda p: p.model.max_seq_len is not None and p.seq_len > p.model.max_seq_len,
         lambda p: f"plan.seq_len ({p.seq_len}) exceeds the model's max_seq_len ({p.model.max_seq_len}); re-plan"),
)
PART_NAMES = tuple(f.name for f in fields(Parts))


@functools.lru_cache(maxsize=1 << 16)  # the search asks the same parts again for every candidate alike
def problem(parts: Parts) -> str | None:
    """The first rule the parts break (only rules whose parts are all fixed are read), or None."""
    for rule in RULES:
        if all(getattr(parts, name) is not None for name in rule.reads) and rule.broken(parts):
            return rule.says(parts)
    return None


def allows(parts: Parts) -> bool:
    return problem(parts) is None


def allows_unit(unit, fixed: object, root: bool = False) -> bool:
    """Whether no rule forbids `unit` (a BlockPlan; `root`: the embedding/norm/head unit, whose pieces keep their
    activations) beside the plan-wide parts `fixed` gives (`parts_of`)."""
    return allows(parts_of(fixed, zero=unit.zero, placement=unit.placement,
                           activations="keep" if root else unit.activations, mlp_tiles=1 if root else unit.mlp_tiles))
