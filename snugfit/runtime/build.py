"""build_engine: validate a Plan against the model and the launch, apply it, and return the engine that runs it.

Apart from runtime.apply so that applying techniques to a model part (which pipeline stages do too) and
choosing the engine (plain or pipelined) do not import each other.
"""

from __future__ import annotations

import torch.nn as nn

from snugfit.plan import Plan
from snugfit.runtime.apply import Weights, apply_plan, check_launch
from snugfit.runtime.dist import DistEnv, ensure_process_group
from snugfit.runtime.engine import Engine, OptimConfig
from snugfit.runtime.mesh import ParallelDims
from snugfit.runtime.pipeline import build_pipeline_engine


def build_engine(model: nn.Module, plan: Plan, optim: OptimConfig, env: DistEnv,
                 weights: Weights | None = None) -> Engine:
    """The engine that runs `plan` on `model` in this process.

    weights: what fills a model built on the meta device (`train.build.build_model(cfg, on_meta=True)`)
    after sharding; no process then holds the whole model.
    """
    check_launch(model, plan, env)
    ensure_process_group(env)
    if plan.pp > 1:
        return build_pipeline_engine(model, plan, optim, env, weights=weights)
    dims = ParallelDims.of(plan, env)
    model, host, cast = apply_plan(model, plan, env, dims, weights)
    return Engine(model, plan, optim, env.device, dp_group=dims.dp_group, host=host, cast=cast)
