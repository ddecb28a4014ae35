"""`snugfit plan`: find the fastest plan that fits (or evaluate a fully given one) and say why.

Whatever the user fixes on the command line (--dp, --pp, --micro-batch, --zero,
--recompute, --schedule, ...) is a constraint; the rest is searched (plan/search.py)
and explained (plan/explain.py). A plan given whole (--pp, --micro-batch, --zero and
--recompute all set, or --plan-file) is evaluated as written: plan_from_options()
builds it, evaluate() profiles the model and runs the estimate, format_prediction()
renders it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from snugfit.errors import SnugfitError
from snugfit.hardware.cluster import Cluster, parse_cluster, with_host_ram
from snugfit.model.catalogue import resolve_model
from snugfit.model.decoder import ModelConfig
from snugfit.plan.estimate import estimate
from snugfit.plan.dtype import DTYPE_CHOICES, dtype_for_cluster
from snugfit.plan.explain import advise, describe_model, explain_bpipe, format_result
from snugfit.plan.options import POLICY_ALIASES, fixed_parts
from snugfit.plan.plan import ACTIVATION_POLICIES, DTYPES, SCHEDULES, BlockPlan, Plan, PlanError, Prediction
from snugfit.plan.search import Constraints, NoPlanError, search
from snugfit.profile.types import ModelProfile

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6, "gb": 1e9,
          "tb": 1e12}


def parse_bytes(text: str) -> int:
    """'20GiB', '512MiB', '24GB', '1000' -> bytes."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise SnugfitError(f"cannot read memory size {text!r}; write e.g. 20GiB, 512MiB, 24GB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass
class PlanOptions:
    """A whole plan as given on the command line (see _whole); None means 'not given'."""

    seq: int
    micro_batch: int = 1
    dp: int | None = None
    pp: int = 1
    schedule: str | None = None
    virtual_stages: int = 1
    num_microbatches: int | None = None
    global_batch: int | None = None
    zero: int = 0
    recompute: str = "keep"
    offload_optimizer: str | None = None  # "all" or a number of blocks (the first ones)
    offload_params: bool = False
    dtype: str = "float32"
    reduce_dtype: str = "float32"
    evict_bound: int | None = None


def plan_from_options(o: PlanOptions, n_blocks: int, world_size: int) -> Plan:
    """A Plan from explicit choices; SnugfitError when they cannot describe a runnable step."""
    if o.pp < 1 or world_size % o.pp:
        raise SnugfitError(f"--pp {o.pp} does not divide the cluster's {world_size} GPUs")
    dp = o.dp if o.dp is not None else world_size // o.pp
    if dp * o.pp != world_size:
        raise SnugfitError(f"--dp {dp} x --pp {o.pp} = {dp * o.pp}, but the cluster has {world_size} GPUs")
    if o.num_microbatches is not None:
        m = o.num_microbatches
        if o.global_batch is not None and o.global_batch != o.micro_batch * m * dp:
            raise SnugfitError(f"--global-batch {o.global_batch} != micro-batch {o.micro_batch} x microbatches {m} "
                               f"x dp {dp}; drop one of them")
    elif o.global_batch is not None:
        per_step = o.micro_batch * dp
        if o.global_batch % per_step:
            raise SnugfitError(f"--global-batch {o.global_batch} is not divisible by micro-batch {o.micro_batch} "
                               f"x dp {dp} = {per_step}")
        m = o.global_batch // per_step
    else:
        m = o.pp if o.pp > 1 else 1
    policy = POLICY_ALIASES.get(o.recompute, o.recompute)
    if policy not in ACTIVATION_POLICIES:
        raise SnugfitError(f"--recompute must be one of {ACTIVATION_POLICIES}, got {o.recompute!r}")
    if o.offload_params and o.zero != 3:
        raise SnugfitError("--offload-params needs --zero 3 (parameters are offloaded as shards)")
    if o.offload_optimizer in (None, "", "0", "none"):
        n_off = 0
    elif o.offload_optimizer == "all":
        n_off = n_blocks
    elif o.offload_optimizer.isdigit() and int(o.offload_optimizer) <= n_blocks:
        n_off = int(o.offload_optimizer)
    else:
        raise SnugfitError(f"--offload-optimizer takes 'all' or a number of blocks <= {n_blocks}, "
                           f"got {o.offload_optimizer!r}")
    try:
        plan = Plan.uniform(
            n_blocks, dp=dp, pp=o.pp, schedule=o.schedule, virtual_stages=o.virtual_stages,
            block=BlockPlan(zero=o.zero, offload_params=o.offload_params, activations=policy),
            root=BlockPlan(zero=o.zero, offload_params=o.offload_params, offload_optimizer=n_off == n_blocks > 0
                           and not o.offload_params),
            micro_batch_size=o.micro_batch, num_microbatches=m, seq_len=o.seq, compute_dtype=o.dtype,
            reduce_dtype=o.reduce_dtype, evict_bound=o.evict_bound,
        )
        for b in plan.blocks[:n_off]:
            b.offload_optimizer = not o.offload_params
        plan.validate(n_blocks=n_blocks)
    except PlanError as e:
        raise SnugfitError(str(e)) from None
    return plan


def profile_for(model: ModelConfig | dict, *, micro_batch: int, seq: int, dtype: str, cache_dir: str | None = None,
                name: str | None = None, lora_rank: int | None = None, quantize_base: str = "none") -> ModelProfile:
    """The model's profile for this sequence and dtype (cached; search rescales it to other micro-batches)."""
    from snugfit.profile.profile import profile_model

    if isinstance(model, ModelConfig) and model.max_seq_len < seq:
        model.max_seq_len = seq
    return profile_model(model, micro_batch_size=micro_batch, seq_len=seq, dtype=dtype, name=name, cache_dir=cache_dir,
                         lora_rank=lora_rank or None, quantize_base=quantize_base)


def evaluate(plan: Plan, model: ModelConfig | dict, cluster: Cluster, *, memory_budget: int | None = None,
             cache_dir: str | None = None, name: str | None = None, lora_rank: int | None = None,
             quantize_base: str = "none") -> Prediction:
    """Profile the model for the plan's micro-batch, sequence and dtype, then estimate the plan."""
    prof = profile_for(model, micro_batch=plan.micro_batch_size, seq=plan.seq_len, dtype=plan.compute_dtype,
                       cache_dir=cache_dir, name=name, lora_rank=lora_rank, quantize_base=quantize_base)
    try:
        return estimate(plan, prof, cluster, memory_budget)
    except PlanError as e:
        raise SnugfitError(str(e)) from None


def max_length(model: ModelConfig | dict) -> int | None:
    """The model's longest sequence: ModelConfig.max_seq_len, or a Hugging Face config's own field for it."""
    if isinstance(model, ModelConfig):
        return model.max_seq_len
    return next((model[k] for k in ("max_position_embeddings", "n_positions", "seq_length") if model.get(k)), None)


def constraints_from_args(args: argparse.Namespace, world_size: int) -> Constraints:
    """The parts of the plan fixed on the command line (plan.options.fixed_parts checks them)."""
    return fixed_parts(world_size, dp=args.dp, pp=args.pp, micro_batch=args.micro_batch,
                       num_microbatches=args.num_microbatches, schedule=args.schedule,
                       virtual_stages=args.virtual_stages, zero=args.zero, recompute=args.recompute,
                       offload_optimizer=args.offload_optimizer, offload_params=args.offload_params,
                       evict_bound=args.evict_bound)


def format_prediction(plan: Plan, pred: Prediction) -> str:
    gib = 2**30
    lines = [describe_model(plan.model)] if plan.model else []
    lines += [f"plan: dp {plan.dp} x pp {plan.pp} ({plan.schedule}), micro-batch {plan.micro_batch_size} x "
             f"{plan.num_microbatches} microbatches, seq {plan.seq_len}, {plan.compute_dtype}; "
             f"global batch {plan.global_batch}"]
    lines.append("peak memory per rank (GiB):")
    cats = sorted({c for m in pred.memory_by_rank for c in m}, key=lambda c: (c.startswith("host:"), c))
    lines.append("  rank  " + "  ".join(f"{c:>16}" for c in cats) + f"  {'device total':>13}")
    for r, m in enumerate(pred.memory_by_rank):
        total = sum(v for k, v in m.items() if not k.startswith("host:"))
        lines.append(f"  {r:>4}  " + "  ".join(f"{m.get(c, 0) / gib:>16.3f}" for c in cats) + f"  {total / gib:>13.3f}")
    lines.append("step time by phase (s): " + ", ".join(f"{k} {v:.4g}" for k, v in pred.time_by_phase.items() if v))
    lines.append(f"step {pred.step_time_s:.4g} s, {pred.tokens_per_s:,.0f} tokens/s, MFU {pred.mfu:.1%}")
    budget = pred.memory_budget_bytes or 0
    margin = budget - pred.peak_memory_bytes
    verdict = "fits" if pred.fits else "does NOT fit"
    lines.append(f"{verdict}: peak {pred.peak_memory_bytes / gib:.2f} GiB of {budget / gib:.2f} GiB "
                 f"({'headroom' if margin >= 0 else 'over by'} {abs(margin) / gib:.2f} GiB)")
    lines += [f"note: {n}" for n in pred.notes]
    return "\n".join(lines)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="find the fastest training plan that fits, and say why")
    p.add_argument("--model", help="catalogue name (llama-3-8b, gpt2, ...) or a config.json")
    p.add_argument("--config", help="a `snugfit train` TOML: its model, sequence, batch, dtype, fine-tuning and "
                                    "[parallel] fixed parts, where the options here do not set them")
    p.add_argument("--cluster", default="cpu", help="e.g. 8xH100-80GB, 2x8xA100-80GB, 2xRTX4090+2xRTX3090, 2xcpu, "
                                                    "file.toml")
    p.add_argument("--seq", type=int, help="sequence length (default: the plan file's)")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step (default: one per GPU)")
    fixed = p.add_argument_group("fixed parts of the plan (searched when not given)")
    fixed.add_argument("--micro-batch", type=int)
    fixed.add_argument("--dp", type=int)
    fixed.add_argument("--pp", type=int)
    fixed.add_argument("--schedule", choices=SCHEDULES)
    fixed.add_argument("--virtual-stages", type=int, help="stages per pipeline rank (interleaved)")
    fixed.add_argument("--num-microbatches", type=int)
    fixed.add_argument("--zero", type=int, choices=(0, 1, 2, 3))
    fixed.add_argument("--recompute", help="keep|recompute|selective|offload (none=keep, full=recompute)")
    fixed.add_argument("--offload-optimizer", metavar="BLOCKS", help="'all', 'none' or the number of (first) blocks")
    fixed.add_argument("--offload-params", action="store_true")
    fixed.add_argument("--evict-bound", type=int, help="BPipe: most microbatches per stage")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="compute dtype; auto: bf16 where every GPU has it, else fp16 with loss scaling, fp32 on CPU")
    p.add_argument("--reduce-dtype", default="float32", choices=DTYPES)
    p.add_argument("--memory-budget", help="per-GPU limit, e.g. 20GiB (default: the GPU's memory)")
    p.add_argument("--host-ram", help="host memory per node, e.g. 512GiB (default: the cluster's; catalogue nodes "
                                      "256GiB)")
    p.add_argument("--alternatives", type=int, default=3, help="runners-up to verify and show")
    p.add_argument("--explain-bpipe", action="store_true", help="compare the best plans with and without BPipe")
    p.add_argument("--plan-file", help="evaluate this plan JSON instead of building one from options")
    p.add_argument("--profile-cache", help="directory for cached model profiles")
    p.add_argument("--json", action="store_true", help="print the plan with its predictions as JSON")
    p.add_argument("--lora-rank", type=int, default=0, help="fine-tune LoRA adapters of this rank (base weights frozen)")
    p.add_argument("--quantize-base", choices=("none", "nf4"), default="none",
                   help="nf4: the frozen base's block linears in 4 bits (QLoRA; with --lora-rank)")
    p.add_argument("--timeline", metavar="FILE", help="draw the chosen plan's step per rank (.png, .svg or .pdf)")
    return p


def _whole(args: argparse.Namespace) -> bool:
    """Did the user give the whole plan (evaluate it) rather than parts of it (search the rest)?"""
    return None not in (args.pp, args.micro_batch, args.zero, args.recompute)


def from_train_config(args: argparse.Namespace) -> None:
    """Fill what the command line left unset from a train config (`--config`), so a run is planned as it runs."""
    from snugfit.config import build_config

    cfg = build_config(args.config)
    t, f, par = cfg.train, cfg.finetune, cfg.parallel
    if args.model is None:
        args.model = cfg.model.name or None
        args.model_config = None if args.model else cfg.model  # the built-in model the config describes
    for key, value in (("seq", t.seq_len), ("global_batch", t.batch_size), ("micro_batch", t.micro_batch_size or None),
                       ("dp", par.dp), ("pp", par.pp), ("schedule", par.schedule),
                       ("virtual_stages", par.virtual_stages), ("num_microbatches", par.num_microbatches),
                       ("zero", par.zero), ("recompute", par.recompute), ("offload_optimizer", par.offload_optimizer),
                       ("evict_bound", par.evict_bound)):
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.offload_params = args.offload_params or bool(par.offload_params)
    args.lora_rank = args.lora_rank or f.lora_rank
    if args.quantize_base == "none":
        args.quantize_base = f.quantize_base
    if args.dtype == "auto":
        args.dtype = t.dtype


def run(args: argparse.Namespace) -> int:
    args.model_config = None
    if args.config:
        from_train_config(args)
    if args.model is None and args.model_config is None:
        raise SnugfitError("give --model (a catalogue name or config.json) or --config (a train TOML)")
    model = args.model_config or resolve_model(args.model)
    args.model = args.model or f"{Path(args.config).name} [model]"
    cluster = parse_cluster(args.cluster)
    if args.host_ram:
        cluster = with_host_ram(cluster, parse_bytes(args.host_ram))
    args.dtype, why = dtype_for_cluster(args.dtype, cluster)
    n_blocks = model.n_layers if isinstance(model, ModelConfig) else int(model["num_hidden_layers"])
    budget = parse_bytes(args.memory_budget) if args.memory_budget else None
    notes = [f"dtype {args.dtype}: {why}"] if not args.plan_file else []
    if args.seq is None and not args.plan_file:
        args.seq = max_length(model)
        if args.seq is None:
            raise SnugfitError("--seq is required: the model's config gives no maximum length")
        notes.append(f"seq {args.seq}: the model's maximum length (--seq to plan another)")
    if args.plan_file or _whole(args):
        plan = _read_plan(args.plan_file) if args.plan_file else _given_plan(args, n_blocks, cluster.world_size)
        pred = evaluate(plan, model, cluster, memory_budget=budget, cache_dir=args.profile_cache, name=args.model,
                        lora_rank=args.lora_rank, quantize_base=args.quantize_base)
        plan.model = profile_for(model, micro_batch=plan.micro_batch_size, seq=plan.seq_len, dtype=plan.compute_dtype,
                                 cache_dir=args.profile_cache, name=args.model, lora_rank=args.lora_rank,
                                 quantize_base=args.quantize_base).summary()
        print(plan.to_json() if args.json else "\n".join([format_prediction(plan, pred), *notes]))
        _draw(args, plan, model, cluster, budget)
        return 0
    c = constraints_from_args(args, cluster.world_size)
    dp = args.dp or (cluster.world_size // args.pp if args.pp else cluster.world_size)
    gb = args.global_batch or (args.micro_batch or 1) * (args.num_microbatches or 1) * (
        dp if args.num_microbatches else cluster.world_size)
    prof = profile_for(model, micro_batch=args.micro_batch or 1, seq=args.seq, dtype=args.dtype,
                       cache_dir=args.profile_cache, name=args.model, lora_rank=args.lora_rank,
                       quantize_base=args.quantize_base)
    try:
        res = search(prof, cluster, global_batch=gb, constraints=c, memory_budget=budget,
                     reduce_dtype=args.reduce_dtype, alternatives=args.alternatives, compare_bpipe=args.explain_bpipe)
    except NoPlanError as e:
        if not e.result.candidates:
            raise SnugfitError(str(e)) from None
        advice = advise(prof, cluster, global_batch=gb, constraints=c, memory_budget=budget, result=e.result)
        if args.json:
            print(json.dumps({"fits": False, "error": str(e), "advice": advice,
                              "rejected": [vars(r) for r in e.result.rejected]}, indent=2))
        else:
            lines = [f"{e}; nothing is chosen (it would run out of memory)"]
            lines += [f"  {r.family}: {r.reason}" for r in e.result.rejected]
            lines += ["smallest changes that fit:"] + [f"  {a}" for a in advice]
            print("\n".join(lines))
        return 2
    if args.json:
        print(res.best.to_json())
    else:
        print("\n".join([format_result(res, cluster), *notes]))
        if args.explain_bpipe:
            print(explain_bpipe(res))
    _draw(args, res.best, model, cluster, budget)
    return 0


def _draw(args: argparse.Namespace, plan: Plan, model: ModelConfig | dict, cluster: Cluster, budget: int | None) -> None:
    """--timeline: the plan's simulated step per rank with memory over time (the time model's own simulation)."""
    if not args.timeline:
        return
    from snugfit.report.timeline import draw_timeline, timeline_for

    prof = profile_for(model, micro_batch=plan.micro_batch_size, seq=plan.seq_len, dtype=plan.compute_dtype,
                       cache_dir=args.profile_cache, name=args.model, lora_rank=args.lora_rank,
                       quantize_base=args.quantize_base)
    sim, detail = timeline_for(plan, prof, cluster, budget)
    out = draw_timeline(sim, plan, args.timeline, detail=detail)
    print(f"timeline: {out}", file=sys.stderr if args.json else sys.stdout)


def _read_plan(path_text: str) -> Plan:
    path = Path(path_text)
    if not path.exists():
        raise SnugfitError(f"plan file {path} does not exist")
    try:
        return Plan.from_json(path.read_text())
    except (PlanError, json.JSONDecodeError, TypeError) as e:
        raise SnugfitError(f"cannot read plan file {path}: {e}") from None


def _given_plan(args: argparse.Namespace, n_blocks: int, world_size: int) -> Plan:
    return plan_from_options(PlanOptions(
        seq=args.seq, micro_batch=args.micro_batch, dp=args.dp, pp=args.pp, schedule=args.schedule,
        virtual_stages=args.virtual_stages or 1, num_microbatches=args.num_microbatches,
        global_batch=args.global_batch, zero=args.zero, recompute=args.recompute,
        offload_optimizer=args.offload_optimizer, offload_params=args.offload_params, dtype=args.dtype,
        reduce_dtype=args.reduce_dtype, evict_bound=args.evict_bound,
    ), n_blocks, world_size)
