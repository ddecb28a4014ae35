"""The training loop: data, plan, engine, checkpoints, metrics. nanoGPT-plain on purpose."""

from __future__ import annotations

import gc
import json
import logging
import math
import signal
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch.distributed as dist

from snugfit.config import RunConfig, optimizer_plan
from snugfit.errors import PeerFailed, SnugfitError, Stopped
from snugfit.plan import Plan, PlanError
from snugfit.runtime.build import build_engine
from snugfit.runtime.compile import compile_seconds
from snugfit.runtime.dist import DistEnv, init_distributed, launch_attempt, release_cached_groups
from snugfit.runtime.engine import Engine
from snugfit.runtime.host_alloc import return_freed_host_memory
from snugfit.runtime.launch import die_with_launcher
from snugfit.runtime.optimizer import OptimConfig
from snugfit.train.autoplan import run_dtype, search_plan
from snugfit.train.calibration import StepProbe
from snugfit.train.build import build_data, build_model, model_identity, model_weights
from snugfit.train.checkpoint import Checkpoints
from snugfit.train.metrics import (
    MetricsLog, compare_line, measured_memory, plot_losses, predicted_fields, resident_bytes, resident_record,
)
from snugfit.train.liveness import Heartbeat
from snugfit.train.preemption import StopRequests

log = logging.getLogger("snugfit")
SETTLE_S = 60.0  # how long a failing run waits for its background checkpoint write to commit


@dataclass
class TrainResult:
    out_dir: Path
    last_step: int
    losses: dict[int, float] = field(default_factory=dict)  # step -> training loss
    val_losses: dict[int, float] = field(default_factory=dict)  # step -> validation loss (step 0: before training)


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
    try:
        plan = Plan.from_json(Path(path).read_text())
    except OSError as e:
        raise SnugfitError(f"cannot read plan {path}: {e.strerror}; pass an existing plan JSON") from None
    except (ValueError, TypeError) as e:
        raise SnugfitError(f"{what} is not a valid plan: {e}") from None
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
    restarted = launch_attempt() > 0  # torchrun restarted the ranks
    resume_from = checkpoints.latest() if t.resume or restarted else None
    if t.resume and resume_from is None:
        raise SnugfitError(f"--resume: no checkpoint in {out / 'checkpoints'}; drop --resume to start a new run")
    if not (t.resume or restarted) and checkpoints.committed():
        raise SnugfitError(
            f"{out} already holds checkpoints of another run; pass --resume to continue it or choose another --out-dir"
        )

    try:
        optim = OptimConfig(lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip)
        engine = build_engine(model, plan, optim, env, weights)
    except PlanError as e:
        raise SnugfitError(str(e)) from None
    dp_rank = plan.layout.coords(env.rank)[1]
    sampler = data.sampler(plan, t.seed, dp_rank)

    start = 0
    if resume_from is not None:
        start = _resume(checkpoints, resume_from, engine, sampler, cfg)
    elif env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    if env.is_main:
        (out / "plan.json").write_text(plan.to_json())
        log.info(
            "plan dp=%d tp=%d pp=%d micro-batch %d x %d, %d tokens/step, %s",
            plan.dp, plan.tp, plan.pp, plan.micro_batch_size, plan.num_microbatches,
            plan.tokens_per_step, f"resuming at step {start}" if start else "starting",
        )

    metrics = MetricsLog(out / "metrics.jsonl", env.is_main, cfg.train.tensorboard)
    result = TrainResult(out_dir=out, last_step=start)
    val = data.eval_batches(plan, t.eval_batches)

    def evaluate(step: int) -> None:
        if val:
            loss = sum(engine.eval_loss(b) for b in val) / len(val)
            result.val_losses[step] = loss
            metrics.write({"kind": "eval", "step": step, "val_loss": loss})
            if env.is_main:
                _say(f"step {step}: validation loss {loss:.4f}", bar)

    bar = _progress(start, t.steps) if env.is_main and t.progress else None
    if start == 0:
        evaluate(0)
    window: list[float] = []  # train_step seconds since the last log line
    bad_in_a_row, skipped_total, overflow_total = 0, 0, 0
    profile_checked = False  # the first measured steps against the prediction from this machine's profile
    probe = StepProbe(cfg, env, plan, start, out, metrics, lambda text: _say(text, bar))
    try:
        for step in range(start, t.steps):
            done = step + 1
            log_now = done % t.log_every == 0 or done == t.steps
            lr = lr_at(step, cfg)
            engine.set_lr(lr)
            engine.track_memory = log_now  # count saved tensors only on the steps we report
            batch = sampler.next_batch()
            t0 = time.perf_counter()
            compiling = compile_seconds() if plan.compile else 0.0
            res = probe.train_step(engine, batch, done)
            # the blocks compile in the process's first step: said at start-up, and left out of its step time
            compiling = compile_seconds() - compiling if plan.compile else 0.0
            window.append(time.perf_counter() - t0 - compiling)
            if compiling and env.is_main:
                guess = plan.predicted.compile_s if plan.predicted else 0.0
                predicted = f", ~{guess:.0f} s predicted" if guess else ""
                _say(f"compiled the blocks in {compiling:.1f} s (step {done}{predicted}; not counted in its step "
                     "time)", bar)
            probe.after(engine, done)
            result.losses[done] = res.loss
            result.last_step = done
            # float16 overflows are the loss scale finding its level, not a run going bad
            bad_in_a_row = bad_in_a_row + 1 if res.skipped and not res.overflow else 0
            skipped_total += res.skipped
            overflow_total += res.overflow
            if bad_in_a_row >= t.max_bad_steps:
                # Skipped steps left weights and optimizer untouched: what is saved is the last good state.
                saved = checkpoints.save(done, engine.state_dict(), _trainer_state(sampler, cfg, plan, engine))
                raise SnugfitError(
                    f"loss or gradients were not finite for {bad_in_a_row} steps in a row (up to step {done}); "
                    f"the last good state is saved in {saved}; lower train.lr or check the data, then --resume"
                )
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{res.loss:.3f}", refresh=False)
            if log_now:
                step_time = statistics.median(window)
                record = {
                    "kind": "train", "step": done, "loss": res.loss, "lr": lr, "grad_norm": res.grad_norm,
                    "skipped": res.skipped, "skipped_total": skipped_total, "overflow_total": overflow_total,
                    "step_time_s": step_time,
                    "tokens_per_s": plan.tokens_per_step / step_time, **measured_memory(engine, step_time),
                }
                record.update(predicted_fields(plan))
                metrics.write(record)
                if env.is_main:
                    _say(compare_line(record), bar)
                    if not profile_checked and done >= 3 and env.device.type == "cpu" and plan.predicted:
                        profile_checked = True
                        _check_profile(step_time, plan.predicted.step_time_s, bar)
                window = []
            if (t.eval_every and done % t.eval_every == 0) or done == t.steps:
                evaluate(done)
            if (t.checkpoint_every and done % t.checkpoint_every == 0) or done == t.steps:
                in_background = t.async_checkpoint and done < t.steps  # the last one is complete on return
                t0 = time.perf_counter()
                save = checkpoints.save_async if in_background else checkpoints.save
                save(done, engine.state_dict(), _trainer_state(sampler, cfg, plan, engine))
                metrics.write({"kind": "checkpoint", "step": done, "async": in_background,
                               "blocked_s": time.perf_counter() - t0})
            if probe.switch_to is not None and done < t.steps:  # replan = "switch" chose another plan
                saved = checkpoints.save(done, engine.state_dict(), _trainer_state(sampler, cfg, plan, engine))
                plan, engine, sampler = probe.switch_to, None, None  # the old plan's engine goes before the new one
                engine, sampler = _switch(cfg, env, plan, saved, checkpoints, optim, weights, data)
                val = data.eval_batches(plan, t.eval_batches)
                probe.switched(plan, done)
            heartbeat.beat(done)
            stop = stops.agreed()
            if stop and done < t.steps:
                saved = checkpoints.save(done, engine.state_dict(), _trainer_state(sampler, cfg, plan, engine))
                if bar is not None:
                    bar.close()
                metrics.close()
                raise Stopped(f"stopped by {signal.Signals(stop).name} at step {done}; checkpoint {saved.name}; "
                              "resume with --resume", stop)
    except BaseException as err:
        checkpoints.settle(min(SETTLE_S, cfg.parallel.timeout_s))  # a save in flight still commits if it can
        if isinstance(err, RuntimeError):  # a collective or transfer gave up waiting: name the rank that stopped
            latest = checkpoints.latest()
            heartbeat.explain(err, result.last_step, cfg.parallel.timeout_s, latest.name if latest else None)
        raise
    probe.finish()
    if bar is not None:
        bar.close()
    end = resident_record(result.last_step, at_start)
    metrics.write(end)
    metrics.close()
    if env.is_main:
        _report(cfg, out, result, checkpoints, end)
    return result


def _check_profile(measured_s: float, predicted_s: float, bar) -> None:
    """When the first measured steps are far from what this machine's cached profile predicts, set the profile
    aside (`hardware.json.stale`), so the next run measures the machine again: it may have been taken while
    another job ran, or on other hardware. Once set aside and measured again, a mismatch is the time model's, and
    the new profile stays."""
    from snugfit.hardware.catalogue import hardware_cache_path

    ratio = measured_s / predicted_s
    if 1 / 1.5 <= ratio <= 1.5:
        return
    path = hardware_cache_path()
    stale = path.with_name(path.name + ".stale")
    said = f"warning: steps take {ratio:.2f}x the {predicted_s:.3g} s predicted"
    if path.exists() and not stale.exists():
        path.replace(stale)
        _say(f"{said}; this machine's profile may have been taken while it was busy: it is set aside ({stale}) "
             "and the next run measures the machine again (or `snugfit profile-hardware` now)", bar)
    else:
        _say(f"{said}, with a profile measured again after an earlier mismatch: the time model is off for this "
             f"plan, not the profile ({path} stays; delete {stale.name} to have the next mismatch set it aside)", bar)


def _switch(cfg: RunConfig, env: DistEnv, plan: Plan, saved: Path, checkpoints: Checkpoints, optim: OptimConfig,
            weights, data) -> tuple[Engine, object]:
    """Go on under `plan` from the checkpoint just `saved`, as --resume under another plan would: the same data
    order, optimizer state and learning-rate schedule, in this launch."""
    gc.collect()  # the old engine's modules, before the new plan's are built
    try:
        engine = build_engine(build_model(cfg, on_meta=weights is not None), plan, optim, env, weights)
    except PlanError as e:
        raise SnugfitError(f"switching to the re-planned {plan.dp} x {plan.tp} x {plan.pp} plan: {e}") from None
    sampler = data.sampler(plan, cfg.train.seed, plan.layout.coords(env.rank)[1])
    done = _resume(checkpoints, saved, engine, sampler, cfg)
    if env.is_main:
        (Path(cfg.train.out_dir) / "plan.json").write_text(plan.to_json())
        log.info("switched at step %d (checkpoint %s) to plan dp=%d tp=%d pp=%d micro-batch %d x %d", done,
                 saved.name, plan.dp, plan.tp, plan.pp, plan.micro_batch_size, plan.num_microbatches)
    return engine, sampler


def _resume(checkpoints: Checkpoints, path: Path, engine: Engine, sampler, cfg: RunConfig) -> int:
    state = engine.state_dict()
    trainer_state = checkpoints.load(path, state, model_identity(cfg))
    engine.load_state_dict(state)
    if engine.scaler is not None and "loss_scale" in trainer_state:  # a float16 run goes on at its scale
        engine.scaler.load_state_dict(trainer_state["loss_scale"])
    sampler.load_state_dict(trainer_state["sampler"])
    saved = Plan.from_dict(trainer_state["plan"]).world_size if "plan" in trainer_state else None
    if saved and saved != engine.plan.world_size and (not dist.is_initialized() or dist.get_rank() == 0):
        log.info("the checkpoint was written by %d ranks; %s for the %d launched", saved,
                 "re-planned" if cfg.parallel.plan == "auto" else "resuming under the given plan",
                 engine.plan.world_size)
    if trainer_state["step"] >= cfg.train.steps:
        raise SnugfitError(
            f"checkpoint {path} is at step {trainer_state['step']}, not before train.steps ({cfg.train.steps}); "
            "raise --steps to train further"
        )
    return trainer_state["step"]


def _trainer_state(sampler, cfg: RunConfig, plan: Plan, engine: Engine) -> dict:
    state = {"sampler": sampler.state_dict(), "model": model_identity(cfg), "plan": plan.to_dict(),
             "config": cfg.to_dict()}
    if engine.scaler is not None:
        state["loss_scale"] = engine.scaler.state_dict()
    return state


def _progress(start: int, total: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True)


def _say(text: str, bar) -> None:
    if bar is not None:
        bar.write(text)
    else:
        log.info(text)


def _report(cfg: RunConfig, out: Path, result: TrainResult, checkpoints: Checkpoints, end: dict) -> None:
    plot = plot_losses(out / "metrics.jsonl", out / "loss.png") if cfg.train.plot else None
    first = result.val_losses.get(0)
    last = result.val_losses.get(result.last_step)
    if first is not None and last is not None:
        log.info("validation loss %.4f -> %.4f (%.0f%% lower)", first, last, 100 * (1 - last / first))
    log.info("peak resident memory per process (MiB): %s",
             " ".join(f"{b / 2**20:.0f}" for b in end["peak_resident_bytes"]))
    log.info("metrics: %s", out / "metrics.jsonl")
    if plot:
        log.info("loss curve: %s", plot)
    log.info("checkpoint: %s", checkpoints.latest())
