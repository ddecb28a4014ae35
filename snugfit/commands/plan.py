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
from dataclasses import dataclass, replace
from pathlib import Path

from snugfit.calibrate.corrections import planning_inputs
from snugfit.commands.options import add_config_options, config_from_args
from snugfit.config import optimizer_plan
from snugfit.errors import SnugfitError
from snugfit.hardware.cluster import Cluster, parse_cluster, with_host_ram
from snugfit.model.catalogue import block_count, resolve_model
from snugfit.model.config import ModelConfig
from snugfit.plan.compile_choice import search_compiled_or_eager
from snugfit.plan.estimate import estimate
from snugfit.plan.dtype import canonical_dtype, dtype_for_cluster
from snugfit.plan.advice import Variant, advise, switches
from snugfit.plan.explain import describe_model, explain_bpipe, format_result, memory_lines, phases_line, verdict_line
from snugfit.plan.options import Constraints, fixed_parts_of, refuse_fixed_parts_beside
from snugfit.plan.placement import Placement
from snugfit.plan.optimizer import describe as describe_optimizer
from snugfit.plan.plan import DTYPES, BlockPlan, OptimizerPlan, Plan, PlanError, Prediction
from snugfit.plan.policies import ACTIVATION_POLICIES
from snugfit.plan.search import NoPlanError
from snugfit.profile.cache import profile_model
from snugfit.profile.types import ModelProfile

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6, "gb": 1e9,
          "tb": 1e12}


def parse_bytes(text: str) -> int:
    """'20GiB', '512MiB', '24GB', '1000' -> bytes."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise SnugfitError(f"cannot read memory size {text!r}; write e.g. 20GiB, 512MiB, 24GB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def plan_from_options(c: Constraints, *, seq: int, global_batch: int | None, dtype: str, reduce_dtype: str,
                      n_blocks: int, world_size: int, optimizer: OptimizerPlan | None = None) -> Plan:
    """A whole Plan from the parts given (pp, micro-batch, zero and recompute at least; the rest default: tp 1, dp
    the rest of the GPUs, pp microbatches, nothing offloaded); SnugfitError when they cannot describe a runnable
    step. offload_optimizer may also be a number of blocks (the first ones); optimizer: the run config's train
    keys (plan.OptimizerPlan)."""
    tp, pp, cp, micro = c.tp or 1, c.pp, c.cp or 1, c.micro_batch
    if pp < 1 or tp < 1 or world_size % (pp * tp * cp):
        raise SnugfitError(f"--tp {tp} x --pp {pp} x --cp {cp} does not divide the cluster's {world_size} GPUs")
    dp = c.dp if c.dp is not None else world_size // (pp * tp * cp)
    if dp * tp * pp * cp != world_size:
        raise SnugfitError(f"--dp {dp} x --tp {tp} x --pp {pp} x --cp {cp} = {dp * tp * pp * cp}, but the cluster "
                           f"has {world_size} GPUs")
    if c.num_microbatches is not None:
        m = c.num_microbatches
        if global_batch is not None and global_batch != micro * m * dp:
            raise SnugfitError(f"--global-batch {global_batch} != micro-batch {micro} x microbatches {m} "
                               f"x dp {dp}; drop one of them")
    elif global_batch is not None:
        per_step = micro * dp
        if global_batch % per_step:
            raise SnugfitError(f"--global-batch {global_batch} is not divisible by micro-batch {micro} "
                               f"x dp {dp} = {per_step}")
        m = global_batch // per_step
    else:
        m = pp if pp > 1 else 1
    policy = c.activations
    if policy not in ACTIVATION_POLICIES:
        raise SnugfitError(f"--recompute must be one of {', '.join(ACTIVATION_POLICIES)}, got {c.recompute!r}")
    if c.offload_optimizer in (None, "", "0", "none"):
        n_off = 0
    elif c.offload_optimizer == "all":
        n_off = n_blocks
    elif c.offload_optimizer.isdigit() and int(c.offload_optimizer) <= n_blocks:
        n_off = int(c.offload_optimizer)
    else:
        raise SnugfitError(f"--offload-optimizer takes 'all' or a number of blocks <= {n_blocks}, "
                           f"got {c.offload_optimizer!r}")
    base = Placement.PARAMS_ON_HOST if c.offload_params else Placement.DEVICE
    offloaded = Placement.PARAMS_ON_HOST if c.offload_params else Placement.HOST_STEP  # the first n_off blocks'
    try:
        plan = Plan.uniform(
            n_blocks, dp=dp, tp=tp, pp=pp, cp=cp, ep=c.ep or 1, schedule=c.schedule, virtual_stages=c.virtual_stages,
            block=BlockPlan(zero=c.zero, placement=base, activations=policy, mlp_tiles=c.mlp_tiles or 1),
            root=BlockPlan(zero=c.zero, placement=offloaded if n_off == n_blocks > 0 else base),
            micro_batch_size=micro, num_microbatches=m, seq_len=seq, compute_dtype=dtype, reduce_dtype=reduce_dtype,
            evict_bound=c.evict_bound, grad_reduce=c.grad_reduce or "step",
            optimizer=optimizer or OptimizerPlan(),
        )
        plan.blocks[:n_off] = [replace(b, placement=offloaded) for b in plan.blocks[:n_off]]
        plan.validate(n_blocks=n_blocks)
    except PlanError as e:
        raise SnugfitError(str(e)) from None
    return plan


@dataclass
class Target:
    """What is planned: the model and its fine-tuning, as the run config gives them."""

    model: ModelConfig | dict
    name: str
    lora_rank: int = 0
    frozen: str = ""
    quantize_base: str = "none"
    cache_dir: str | None = None
    kernels: str = "cpu"  # whose saved tensors to profile: "gpu" for clusters of GPUs (profile.kernels)
    lora_targets: str = ""  # finetune.lora_targets: layer names, comma-separated, or "all-linear"
    pack: bool = False  # data.packs: packed examples' attention mask charged (profile_model's pack)

    def varied(self, v: Variant) -> "Target":
        """This target under the advice's change (plan.advice.Variant): LoRA on the default targets, QLoRA."""
        if not v.lora_rank:
            return self
        return replace(self, lora_rank=v.lora_rank, lora_targets="", frozen="",
                       quantize_base="nf4" if v.nf4 else self.quantize_base)

    def profile(self, micro_batch: int, seq: int, dtype: str, compile: bool) -> ModelProfile:
        """The model's profile for this sequence and dtype (cached; search rescales it to other micro-batches),
        its blocks eager or as torch.compile runs them (profile.compiled)."""
        if isinstance(self.model, ModelConfig) and self.model.max_seq_len < seq:
            self.model.max_seq_len = seq
        return profile_model(self.model, micro_batch_size=micro_batch, seq_len=seq, dtype=dtype, name=self.name,
                             cache_dir=self.cache_dir, lora_rank=self.lora_rank or None,
                             lora_targets=self.lora_targets, frozen=self.frozen or None,
                             quantize_base=self.quantize_base, kernels=self.kernels,
                             compile=compile, pack=self.pack)


def evaluate(plan: Plan, target: Target, cluster: Cluster, memory_budget: int | None = None) -> Prediction:
    """Profile the model for the plan's micro-batch, sequence and dtype, then estimate the plan."""
    prof = target.profile(plan.micro_batch_size, plan.seq_len, plan.compute_dtype, plan.compile)
    try:
        return estimate(plan, prof, cluster, memory_budget)
    except PlanError as e:
        raise SnugfitError(str(e)) from None


def max_length(model: ModelConfig | dict) -> int | None:
    """The model's longest sequence: ModelConfig.max_seq_len, or a Hugging Face config's own field for it."""
    if isinstance(model, ModelConfig):
        return model.max_seq_len
    return next((model[k] for k in ("max_position_embeddings", "n_positions", "seq_length") if model.get(k)), None)


def format_prediction(plan: Plan, pred: Prediction) -> str:
    """A plan evaluated as given: what was planned, its memory (as a searched plan's report shows it), time by
    phase, step, the verdict naming the binding limit, and the notes."""
    lines = [describe_model(plan.model)] if plan.model else []
    tp = f" x tp {plan.tp}" if plan.tp > 1 else ""
    tp += (f" x cp {plan.cp}" if plan.cp > 1 else "") + (f", experts over ep {plan.ep}" if plan.ep > 1 else "")
    every = ", gradients reduced every microbatch" if plan.grad_reduce == "microbatch" else ""
    blocks = ("blocks compiled (torch.compile)" if plan.compile else
              "blocks eager (--compile true evaluates them compiled)")
    lines += [f"plan: dp {plan.dp}{tp} x pp {plan.pp} ({plan.schedule}), micro-batch {plan.micro_batch_size} x "
             f"{plan.num_microbatches} microbatches{every}, seq {plan.seq_len}, {plan.compute_dtype}, {blocks}; "
             f"global batch {plan.global_batch}", f"optimizer: {describe_optimizer(plan.optimizer)}"]
    lines += memory_lines(pred)
    lines.append(phases_line(pred))
    lines.append(f"step {pred.step_time_s:.4g} s, {pred.tokens_per_s:,.0f} tokens/s, MFU {pred.mfu:.1%}")
    lines.append(verdict_line(pred))
    lines += [f"note: {n}" for n in pred.notes]
    return "\n".join(lines)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="find the fastest training plan that fits, and say why",
        description="Plan the run that `snugfit train` takes the same options for (--config FILE, --key value): "
        "--model is a catalogue name, a Hugging Face folder or a config.json (default: the built-in decoder of "
        "[model]). --dp --pp --zero --recompute ... fix parts of the plan, the rest is searched; all four of --pp "
        "--micro-batch --zero --recompute, or --plan-file, evaluate one plan as given. Without --seq and "
        "--global-batch a named model is planned at its maximum length, one sequence per GPU.")
    add_config_options(p)
    own = p.add_argument_group("planning")
    own.add_argument("--cluster", help="e.g. 8xH100-80GB, 2x8xA100-80GB, 2xRTX4090+2xRTX3090, 2xcpu, file.toml "
                                       "(default: --nproc x cpu)")
    own.add_argument("--reduce-dtype", default="float32", type=canonical_dtype, choices=DTYPES,
                     help="dtype of the gradient reduction (bf16, fp16, fp32 or the long names)")
    own.add_argument("--memory-budget", help="per-GPU limit, e.g. 20GiB (default: the GPU's memory)")
    own.add_argument("--host-ram", help="host memory per node, e.g. 512GiB (default: the cluster's; catalogue "
                                        "nodes 256GiB)")
    own.add_argument("--alternatives", type=int, default=3, help="runners-up to verify and show")
    own.add_argument("--explain-bpipe", action="store_true", help="compare the best plans with and without BPipe")
    own.add_argument("--profile-cache", help="directory for cached model profiles")
    own.add_argument("--json", action="store_true", help="print the plan with its predictions as JSON")
    own.add_argument("--timeline", metavar="FILE", help="draw the chosen plan's step per rank (.png, .svg or .pdf)")
    return p


def run(args: argparse.Namespace) -> int:
    cfg, given = config_from_args(args)
    t, par = cfg.train, cfg.parallel
    refuse_fixed_parts_beside(par)
    named = cfg.model.name
    model = resolve_model(named, cfg.model.attention) if named else cfg.model
    target = Target(model, named or f"built-in {cfg.model.arch}", cfg.finetune.lora_rank, cfg.finetune.freeze,
                    cfg.finetune.quantize_base, args.profile_cache, lora_targets=cfg.finetune.lora_targets,
                    pack=cfg.data.packs)
    spec = args.cluster or (f"{par.nproc}xcpu" if par.nproc > 1 else "cpu")

    def cluster_of() -> Cluster:
        built = parse_cluster(spec)
        return with_host_ram(built, parse_bytes(args.host_ram)) if args.host_ram else built

    cluster = cluster_of()
    for note in cluster.notes:  # first, before the search: which card a short name took
        print(note, file=sys.stderr if args.json else sys.stdout)
    target.kernels = "cpu" if all(n.gpu.name == "cpu" for n in cluster.nodes) else "gpu"
    notes: list[str] = []

    def planned_on(micro_batch: int, seq_len: int, dtype: str) -> Cluster:
        """The cluster as `snugfit train` plans it (calibrate.corrections.planning_inputs: CPU ranks measured as
        train measures them, a run's stored corrections), the line naming corrections among the notes."""
        profile = target.profile(micro_batch, seq_len, dtype, False)  # its shape keys the corrections
        found, line = planning_inputs(cluster_of, profile, cluster.nodes[0].count, _measure_cpu_ranks)
        notes.extend([line] if line else [])
        return found

    dtype, why = dtype_for_cluster(t.dtype, cluster)
    n_blocks = block_count(model)
    budget = parse_bytes(args.memory_budget) if args.memory_budget else None
    if par.plan not in ("auto", "dp"):
        plan = _read_plan(par.plan)
        if t.compile is not None:  # as train runs a plan file
            plan.shape = replace(plan.shape, compile=t.compile)
        cluster = planned_on(plan.micro_batch_size, plan.seq_len, plan.compute_dtype)
        _report(args, plan, evaluate(plan, target, cluster, budget), target, cluster, budget, notes)
        return 0
    notes.append(f"dtype {dtype}: {why}")
    seq = t.seq_len
    if named and "train.seq_len" not in given:
        seq = max_length(model)
        if seq is None:
            raise SnugfitError("--seq is required: the model's config gives no maximum length")
        notes.append(f"seq {seq}: the model's maximum length (--seq to plan another)")
    micro = t.micro_batch_size or None
    gb = t.batch_size if "train.batch_size" in given or not named else None  # None: one sequence per GPU
    if par.plan == "auto" and None not in (par.pp, micro, par.zero, par.recompute):  # whole: evaluate as written
        plan = plan_from_options(replace(par, micro_batch=micro), seq=seq, global_batch=gb, dtype=dtype,
                                 reduce_dtype=args.reduce_dtype, n_blocks=n_blocks, world_size=cluster.world_size,
                                 optimizer=optimizer_plan(t))
        # a plan given whole is not searched: eager unless --compile
        plan.shape = replace(plan.shape, compile=bool(t.compile))
        cluster = planned_on(micro, seq, dtype)
        _report(args, plan, evaluate(plan, target, cluster, budget), target, cluster, budget, notes)
        return 0
    if par.plan == "dp":  # plain data parallelism, as `snugfit train --plan dp` runs it; the micro-batch searched
        c = Constraints(dp=cluster.world_size, pp=1, zero=0, recompute="keep", offload_optimizer="none",
                        micro_batch=micro).checked(cluster.world_size)
    else:
        c = fixed_parts_of(par, t.micro_batch_size, cluster.world_size)
    if gb is None:
        dp = c.dp or cluster.world_size // ((c.pp or 1) * (c.cp or 1))
        gb = (micro or 1) * (c.num_microbatches or 1) * (dp if c.num_microbatches else cluster.world_size)
    cluster = planned_on(micro or 1, seq, dtype)
    try:
        weighed = t.compile if par.plan == "auto" else bool(t.compile)  # --plan dp: eager unless asked, as trained
        search_args = dict(global_batch=gb, constraints=c, memory_budget=budget, reduce_dtype=args.reduce_dtype,
                           alternatives=args.alternatives, compare_bpipe=args.explain_bpipe,
                           optimizer=optimizer_plan(t))

        def profile_for(compiled: bool) -> ModelProfile:
            return target.profile(micro or 1, seq, dtype, compiled)
        chosen = search_compiled_or_eager(profile_for, cluster, compile=weighed, steps=t.steps, **search_args)
    except NoPlanError as e:
        if not e.result.candidates:
            raise SnugfitError(str(e)) from None
        compiled = t.compile is not False  # where compiling is weighed, its leaner blocks are what may fit
        print("nothing fits; searching what would (shorter sequences, LoRA, more RAM or GPUs) ...", file=sys.stderr)
        advice = advise(target.profile(micro or 1, seq, dtype, compiled), cluster, global_batch=gb, constraints=c,
                        memory_budget=budget, optimizer=optimizer_plan(t),
                        reprofile=lambda v: target.varied(v).profile(micro or 1, v.seq_len or seq, dtype, compiled))
        if args.json:
            print(json.dumps({"fits": False, "error": str(e), "advice": advice,
                              "rejected": [vars(r) for r in e.result.rejected]}, indent=2))
        else:
            lines = [f"{e}; nothing is chosen (it would run out of memory)"]
            lines += [f"  {r.family}: {r.reason}" for r in e.result.rejected]
            lines += ["smallest changes that fit:"] + [f"  {a}" for a in advice]
            print("\n".join(lines))
        return 2
    res, prof = chosen.result, chosen.profile
    notes += [chosen.note] if chosen.note else []
    if args.json:
        print(res.best.to_json())
    else:
        advice = switches(prof, cluster, global_batch=gb, constraints=c, memory_budget=budget, result=res)
        print("\n".join([format_result(res, cluster), *notes, *advice]))
        if args.explain_bpipe:
            print(explain_bpipe(res))
    _draw(args, res.best, target, cluster, budget)
    return 0


def _report(args: argparse.Namespace, plan: Plan, pred: Prediction, target: Target, cluster: Cluster,
            budget: int | None, notes: list[str]) -> None:
    """A plan evaluated as given: what was planned, the prediction, the notes (or all as JSON)."""
    plan.model = target.profile(plan.micro_batch_size, plan.seq_len, plan.compute_dtype, plan.compile).summary()
    print(plan.to_json() if args.json else "\n".join([format_prediction(plan, pred), *notes]))
    _draw(args, plan, target, cluster, budget)


def _draw(args: argparse.Namespace, plan: Plan, target: Target, cluster: Cluster, budget: int | None) -> None:
    """--timeline: the plan's simulated step per rank with memory over time (the time model's own simulation)."""
    if not args.timeline:
        return
    from snugfit.report.timeline import draw_timeline, timeline_for

    prof = target.profile(plan.micro_batch_size, plan.seq_len, plan.compute_dtype, plan.compile)
    sim, detail = timeline_for(plan, prof, cluster, budget)
    out = draw_timeline(sim, plan, args.timeline, detail=detail)
    print(f"timeline: {out}", file=sys.stderr if args.json else sys.stdout)


def _measure_cpu_ranks(ranks: int) -> None:
    """train.autoplan.measure_once, imported only where CPU ranks are planned (it needs torch)."""
    from snugfit.train.autoplan import measure_once

    measure_once(ranks)


def _read_plan(path_text: str) -> Plan:
    path = Path(path_text)
    if not path.exists():
        raise SnugfitError(f"plan file {path} does not exist")
    try:
        return Plan.from_json(path.read_text())
    except (PlanError, json.JSONDecodeError, TypeError) as e:
        raise SnugfitError(f"cannot read plan file {path}: {e}") from None
