"""Run a single-process plan of the built-in model on this machine and measure it.

The reference the memory and time models are checked against (tests, bench/):
the runtime's own engine (runtime.build.build_engine: FSDP2 units, activation
policies, fused AdamW, gradient accumulation) in one process; peak memory from
torch's MemTracker, which sees every tensor (transients too, unlike the
runtime's MemoryTracker; it works on CPU, where there are no allocator
statistics), step time from the engine's train_step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from snugfit.model.decoder import Decoder, ModelConfig
from snugfit.plan.plan import Plan


@dataclass
class MeasuredStep:
    peak_bytes: int
    step_time_s: float  # fastest of the timed steps (interference on a shared machine only adds time)


def measure_single_process(cfg: ModelConfig, plan: Plan, steps: int = 3, track_memory: bool = True,
                           clock: Callable[[], float] = time.perf_counter) -> MeasuredStep:
    """Peak bytes (MemTracker, one step after a warm-up) and best step time of `plan` (dp = pp = 1)."""
    if plan.world_size != 1:
        raise ValueError("measure_single_process runs dp = pp = 1 plans only")
    from snugfit.runtime.build import build_engine
    from snugfit.runtime.dist import DistEnv
    from snugfit.runtime.optimizer import OptimConfig

    torch.manual_seed(0)
    engine = build_engine(Decoder(cfg), plan, OptimConfig(lr=1e-4), DistEnv())
    engine.track_memory = False  # MemTracker measures; the engine's saved-tensor hooks would only add time
    batch = torch.randint(0, cfg.vocab_size, (plan.num_microbatches * plan.micro_batch_size, plan.seq_len + 1))
    engine.train_step(batch)  # warm-up: optimizer states exist from here on, as in every later step
    peak = 0
    if track_memory:
        from torch.distributed._tools.mem_tracker import MemTracker

        mt = MemTracker()
        mt.track_external(engine.model, *engine._optimizers())

        def next_microbatch(module: torch.nn.Module, _args) -> None:  # MemTracker's module stats are per call
            if module is engine.model:
                mt.reset_mod_stats()

        # registered before MemTracker's own global hook, so it runs first; the device peak is kept
        hook = torch.nn.modules.module.register_module_forward_pre_hook(next_microbatch)
        try:
            with mt:
                engine.train_step(batch)
        finally:
            hook.remove()
        peak = int(mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
    times = []
    for _ in range(steps):
        t0 = clock()
        engine.train_step(batch)
        times.append(clock() - t0)
    return MeasuredStep(peak, min(times) if times else 0.0)
