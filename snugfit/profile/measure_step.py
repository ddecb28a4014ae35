"""Run a single-process plan of the built-in model on this machine and measure it.

The reference the memory and time models are checked against (tests, bench/):
peak memory from torch's MemTracker (works on CPU, where there are no allocator
statistics), step time from a plain loop: gradient accumulation over the plan's
microbatches, per-block recomputation as the plan says, fused AdamW.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from snugfit.model.decoder import Decoder, ModelConfig
from snugfit.plan.plan import Plan
from snugfit.profile.record import SELECTIVE_SAVE_OPS


@dataclass
class MeasuredStep:
    peak_bytes: int
    step_time_s: float  # fastest of the timed steps (interference on a shared machine only adds time)


def _selective_policy(ctx, op, *args, **kwargs):
    name = str(op._overloadpacket) if hasattr(op, "_overloadpacket") else str(op)
    return CheckpointPolicy.MUST_SAVE if name in SELECTIVE_SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_recompute(model: Decoder, plan: Plan) -> None:
    """Wrap each block's forward in activation checkpointing as plan.blocks[i].activations says."""
    for i, block in model.blocks.items():
        policy = plan.blocks[int(i)].activations
        if policy not in ("recompute", "selective"):
            continue
        inner = block.forward
        ctx = functools.partial(create_selective_checkpoint_contexts, _selective_policy) if policy == "selective" else None

        def fwd(x, rope=None, _inner=inner, _ctx=ctx):
            kw = {"context_fn": _ctx} if _ctx else {}
            return checkpoint(_inner, x, rope, use_reentrant=False, **kw)

        block.forward = fwd


def measure_single_process(cfg: ModelConfig, plan: Plan, steps: int = 3, track_memory: bool = True,
                           clock: Callable[[], float] = time.perf_counter) -> MeasuredStep:
    """Peak bytes (MemTracker, one step after a warm-up) and best step time of `plan` (dp = pp = 1)."""
    if plan.world_size != 1:
        raise ValueError("measure_single_process runs dp = pp = 1 plans only")
    torch.manual_seed(0)
    dtype = getattr(torch, plan.compute_dtype)
    model = Decoder(cfg).to(dtype)
    apply_recompute(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batches = [torch.randint(0, cfg.vocab_size, (plan.micro_batch_size, plan.seq_len)) for _ in range(plan.num_microbatches)]

    def step(between=lambda: None):
        for tokens in batches:
            (model(tokens, tokens) / plan.num_microbatches).backward()
            between()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: optimizer states exist from here on, as in every later step
    peak = 0
    if track_memory:
        from torch.distributed._tools.mem_tracker import MemTracker

        mt = MemTracker()
        mt.track_external(model, opt)
        with mt:
            step(mt.reset_mod_stats)  # module stats are per call; the device peak is kept
        peak = int(mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
    times = []
    for _ in range(steps):
        t0 = clock()
        step()
        times.append(clock() - t0)
    return MeasuredStep(peak, min(times) if times else 0.0)
