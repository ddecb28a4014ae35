"""The training loop: data, plan, engine, then steps, with each concern of the run (its log, evaluation,
checkpoints, re-planning, stopping on a signal, bad steps) a handler called at named moments (train/run.py).
nanoGPT-plain on purpose."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from snugfit.config import RunConfig, optimizer_plan
from snugfit.errors import PeerFailed, SnugfitError, Stopped
from snugfit.plan import Plan, PlanError
from snugfit.runtime.build import build_engine
from snugfit.runtime.compile import compile_seconds
from snugfit.runtime.dist import DistEnv, init_distributed, launch_attempt, release_cached_groups
from snugfit.runtime.engine import Engine, StepResult
from snugfit.runtime.host_alloc import return_freed_host_memory
from snugfit.runtime.launch import die_with_launcher
from snugfit.runtime.optimizer import OptimConfig
from snugfit.train.autoplan import read_plan_file, run_dtype, search_plan
from snugfit.train.build import build_data, build_model, model_weights
from snugfit.train.calibration import PlanSwitch, StepProbe
from snugfit.train.checkpoint import Checkpoints
from snugfit.train.handlers import BadSteps, Checkpointing, Evaluation
from snugfit.train.liveness import Heartbeat
from snugfit.train.metrics import MetricsLog, resident_bytes
from snugfit.train.preemption import StopRequests
from snugfit.train.run import Handler, Run, StepDone, TrainResult
from snugfit.train.step_log import StepLog

log = logging.getLogger("snugfit")


def lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warmup, then cosine decay to lr * min_lr_ratio at the last step."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def resolve_plan(cfg: RunConfig, model_cfg, env: DistEnv) -> Plan:
    """The plan searched for this run (`auto`: by the launcher before the ranks started, else here), a plan file
    as written, or plain data parallelism (`dp`)."""
    t = cfg.train
    if cfg.parallel.plan == "auto":
        from snugfit.runtime.launch import handed_plan

        handed = handed_plan()
        if handed is None:  # ranks started by torchrun itself
            return search_plan(cfg, env)
        return _checked_plan_file(handed, "the launcher's plan", cfg, model_cfg, env)
    from snugfit.plan.options import refuse_fixed_parts_beside

    refuse_fixed_parts_beside(cfg.parallel)
    if cfg.parallel.plan != "dp":
        return _checked_plan_file(cfg.parallel.plan, f"plan {cfg.parallel.plan}", cfg, model_cfg, env)
    if t.batch_size % env.world_size:
        raise SnugfitError(f"train.batch_size ({t.batch_size}) must be divisible by the {env.world_size} ranks")
    per_rank = t.batch_size // env.world_size
    micro = t.micro_batch_size or per_rank
    if per_rank % micro:
        raise SnugfitError(
            f"per-rank batch ({per_rank}) must be a multiple of train.micro_batch_size ({micro}); change either"
        )
    return Plan.uniform(
        model_cfg.n_layers, dp=env.world_size, micro_batch_size=micro, num_microbatches=per_rank // micro,
        seq_len=t.seq_len, compute_dtype=t.dtype, compile=bool(t.compile), optimizer=optimizer_plan(t),
        grad_reduce="microbatch" if t.optimizer_in_backward else "step",  # the step in backward needs it
    )


def _checked_plan_file(path: str, what: str, cfg: RunConfig, model_cfg, env: DistEnv) -> Plan:
    """A plan JSON read and checked against this run: its batch, sequence, model and ranks."""
    t = cfg.train
    plan = read_plan_file(path, what)
    if (plan.global_batch, plan.seq_len) != (t.batch_size, t.seq_len):
        raise SnugfitError(
            f"{what} is for batch {plan.global_batch} x seq {plan.seq_len}, the run asks "
            f"{t.batch_size} x {t.seq_len}; set --batch-size {plan.global_batch} --seq-len {plan.seq_len}"
        )
    try:
        plan.validate(n_blocks=model_cfg.n_layers, world_size=env.world_size)
    except PlanError as e:
        raise SnugfitError(f"{what}: {e}") from None
    if plan.optimizer != optimizer_plan(t):
        o = plan.optimizer
        raise SnugfitError(
            f"{what} updates {o.master_weights} weights with {o.states} states"
            f"{' in backward' if o.in_backward else ''}, the run asks otherwise; set --master-weights "
            f"{o.master_weights} --optimizer-states {o.states} "
            f"--optimizer-in-backward {str(o.in_backward).lower()}")
    if t.compile is not None:  # --compile true|false overrides a plan file
        plan.shape = replace(plan.shape, compile=t.compile)
    return plan


def train(cfg: RunConfig) -> TrainResult:
    die_with_launcher()
    return_freed_host_memory()
    at_start = resident_bytes()[0]  # before the model: the run's own memory is what grows above it
    stops = StopRequests(cfg.train.save_on_signal, cfg.parallel.timeout_s)  # from the start: a signal during set-up stops after step 1
    env = init_distributed(cfg.parallel.timeout_s)
    heartbeat = Heartbeat(env.rank, env.world_size)
    try:
        return _train(cfg, env, stops, at_start, heartbeat)
    except (Stopped, PeerFailed):  # said by rank 0 / by the rank that failed first
        raise
    except Exception as err:  # one line from the rank that failed first; the others, failing for it, say nothing
        if not heartbeat.first_to_fail():
            raise PeerFailed(str(err)) from None
        raise
    finally:
        stops.close()
        if dist.is_initialized():
            release_cached_groups()
            dist.destroy_process_group()


def _train(cfg: RunConfig, env: DistEnv, stops: StopRequests, at_start: int,
           heartbeat: Heartbeat) -> TrainResult:
    """Set the run up (model, data, plan, engine, resumed state) and take its steps."""
    t = cfg.train
    t.dtype, why = run_dtype(t.dtype, env.device)
    if env.is_main:
        log.info("dtype %s: %s", t.dtype, why)
    out = Path(t.out_dir)
    weights = model_weights(cfg)  # read once the plan has placed the model: no process holds it whole
    model = build_model(cfg, on_meta=weights is not None)
    data = build_data(cfg, model.cfg.vocab_size)
    plan = resolve_plan(cfg, model.cfg, env)
    checkpoints = Checkpoints(out / "checkpoints", t.keep_checkpoints, env)
    resume_from = _resume_from(checkpoints, cfg)
    optim = OptimConfig(lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip)

    def engine_for(plan: Plan, model: torch.nn.Module | None = None) -> Engine:
        """The engine of `plan`, its model built anew unless given."""
        model = build_model(cfg, on_meta=weights is not None) if model is None else model
        return build_engine(model, plan, optim, env, weights)

    try:
        engine = engine_for(plan, model)
    except PlanError as e:
        raise SnugfitError(str(e)) from None
    run = Run(cfg, env, data, checkpoints, plan, engine, TrainResult(out_dir=out, last_step=0))
    if resume_from is not None:
        run.restore(resume_from)
    elif env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    if env.is_main:
        (out / "plan.json").write_text(plan.to_json())
        log.info(
            "plan dp=%d tp=%d pp=%d%s micro-batch %d x %d, %d tokens/step%s, %s",
            plan.dp, plan.tp, plan.pp, f" cp={plan.cp}" if plan.cp > 1 else "", plan.micro_batch_size, plan.num_microbatches,
            plan.tokens_per_step * data.real_share, f" (of {plan.tokens_per_step} positions; the rest padding)"
            if data.real_share < 1 else "", f"resuming at step {run.step}" if run.step else "starting",
        )
    run.metrics = MetricsLog(out / "metrics.jsonl", env.is_main, t.tensorboard)
    run.bar = _progress(run.step, t.steps) if env.is_main and t.progress else None
    probe, bad_steps = StepProbe(), BadSteps(t.max_bad_steps)
    # in this order at every moment: a step's spans are gathered before anything else of its collectives, bad steps
    # stop the run before its record is written, the plan switches after the step's evaluation and checkpoint, and
    # the heartbeat names a rank that stopped answering once everything else has settled
    handlers = [probe, bad_steps, StepLog(bad_steps, at_start), Evaluation(), Checkpointing(),
                PlanSwitch(probe, engine_for), heartbeat, stops]
    _take_steps(run, handlers, probe.train_step)
    return run.result


def _take_steps(run: Run, handlers: list[Handler], train_step: Callable[[Run, torch.Tensor], StepResult]) -> None:
    """The loop: until train.steps, set the step's learning rate, take its batch, step the engine (train_step: how,
    which traces or profiles the steps that are) and count the step; the handlers at each named moment
    (train/run.py), in order. A handler stops the run by raising."""
    t = run.cfg.train
    try:
        for handler in handlers:
            handler.on_start(run)
        while run.step < t.steps:
            for handler in handlers:
                handler.before_step(run)
            lr = lr_at(run.step, run.cfg)
            run.engine.set_lr(lr)
            batch = run.sampler.next_batch()
            t0 = time.perf_counter()
            compiling = compile_seconds() if run.plan.compile else 0.0
            result = train_step(run, batch)
            # the blocks compile in a plan's first step: said by the log, and left out of its step time
            compiling = compile_seconds() - compiling if run.plan.compile else 0.0
            seconds = time.perf_counter() - t0 - compiling
            run.result.last_step += 1
            run.result.losses[run.step] = result.loss
            done = StepDone(run.step, lr, result, seconds, compiling)
            for handler in handlers:
                handler.after_step(run, done)
    except BaseException as error:
        for handler in handlers:
            handler.on_stop(run, error)
        raise
    for handler in handlers:
        handler.on_stop(run, None)


def _resume_from(checkpoints: Checkpoints, cfg: RunConfig) -> Path | None:
    """The checkpoint to go on from: the newest with --resume or in a launch torchrun restarted, else none; a fresh
    run refuses a folder that holds another run's checkpoints."""
    t = cfg.train
    restarted = launch_attempt() > 0  # torchrun restarted the ranks
    resume_from = checkpoints.latest() if t.resume or restarted else None
    if t.resume and resume_from is None:
        raise SnugfitError(f"--resume: no checkpoint in {checkpoints.root}; drop --resume to start a new run")
    if not (t.resume or restarted) and checkpoints.committed():
        raise SnugfitError(
            f"{checkpoints.root.parent} already holds checkpoints of another run; pass --resume to continue it or "
            "choose another --out-dir"
        )
    return resume_from


def _progress(start: int, total: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)
