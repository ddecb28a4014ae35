"""build_engine: validate a Plan against the model and the launch, apply it, and return the engine that runs it.

One way for every plan: the model's parts (the model itself, or this pipeline rank's stages) are each
parallelized alike (runtime.apply.parallelize), and one Engine is handed the step runner the plan's schedule
names (plan.schedules: "accumulate", "torch", "bpipe"; `RUNNERS`, checked against the registry at import).
"""

from __future__ import annotations

import torch.nn as nn

from snugfit.plan import Plan
from snugfit.plan import schedules
from snugfit.runtime.apply import Weights, check_launch, parallelize, place, read_weights
from snugfit.runtime.bpipe import BPipe
from snugfit.runtime.dist import DistEnv, ensure_process_group
from snugfit.runtime.engine import Engine
from snugfit.runtime.mesh import ParallelDims
from snugfit.runtime.optimizer import OptimConfig
from snugfit.runtime.pipeline import TorchSchedule, stage_parts
from snugfit.runtime.precision import apply_mixed_precision
from snugfit.runtime.sharding import DTYPES
from snugfit.runtime.step_runner import Accumulate
from snugfit.runtime.tied_embeddings import TiedEmbeddings

RUNNERS = {  # the schedules registry's runner name -> the step runner (model, stages, plan, dims, env)
    "accumulate": lambda model, stages, plan, dims, env: Accumulate(model, plan),
    "torch": TorchSchedule,
    "bpipe": BPipe,
}
if set(RUNNERS) != set(schedules.RUNNERS) or any(s.runner not in RUNNERS for s in schedules.SCHEDULES.values()):
    raise ImportError(f"runtime.build.RUNNERS {sorted(RUNNERS)} does not match plan.schedules' runners "
                      f"{sorted(schedules.RUNNERS)}")


def build_engine(model: nn.Module, plan: Plan, optim: OptimConfig, env: DistEnv,
                 weights: Weights | None = None) -> Engine:
    """The engine that runs `plan` on `model` in this process.

    weights: what fills a model built on the meta device (`train.build.build_model(cfg, on_meta=True)`)
    after sharding; no process then holds the whole model.
    """
    check_launch(model, plan, env)
    ensure_process_group(env)
    dims = ParallelDims.of(plan, env)
    stages = []
    if plan.schedule_entry.pipelined:
        stages = stage_parts(model, plan, dims)
    host = place(model, plan, env.device, weights)  # a model on meta: read after sharding, this rank's part only
    last = len(plan.stage_ranges()) - 1
    for part in stages or [model]:
        parallelize(part, plan, dims, output_fp32=part is model or part.index == last)
    read_weights(model, plan, env.device, weights)
    tied = TiedEmbeddings.of(model, plan, env, host)  # a pipeline's embedding and head hold a tied weight each
    # a plan that runs unwrapped computes below fp32 through copies cast once a step (FSDP2's mixed precision else)
    cast = apply_mixed_precision(model, DTYPES[plan.compute_dtype]) if plan.runs_unwrapped else None
    runner = RUNNERS[plan.schedule_entry.runner](model, stages, plan, dims, env)
    return Engine(model, plan, optim, env.device, runner, dp_group=dims.dp_group, host=host, cast=cast,
                  tied=tied, cp_rank=dims.cp_rank)
