"""Where a replicated step's time goes on a GPU, for the time model: the step through snugfit's engine and through
plain PyTorch (a bf16 model, fused AdamW), at the acceptance suite's shape and at a tiny one whose kernels take
next to nothing (so its step time is the host's: Python, dispatch and launches), one step's kernels under
torch.profiler (busy time, launches, the top kernels), and what the profile counts and the model predicts.

Writes diagnose.json under $OUT (./ without $OUT). Usage: python bench/gpu/diagnose.py [--smoke]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import torch
from run import DEFAULT_MODEL, OPTIM, OUT, SMOKE_MODEL, build, free_memory, one_rank  # noqa: I001 (bench/gpu)

from snugfit.model.decoder import Decoder, ModelConfig
from snugfit.plan.estimate import estimate
from snugfit.plan.plan import Plan
from snugfit.profile.cache import profile_model
from snugfit.runtime.build import build_engine
from snugfit.train.autoplan import local_cluster

STEPS = 3


def timed(step, sync, steps: int = STEPS) -> float:
    """Median seconds of `step` after two warm-up calls, the device synchronised around each."""
    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def plain_step(cfg: ModelConfig, weights, batch: torch.Tensor, mbs: int, device, dtype):
    """A training step as plain PyTorch runs it: the model in the compute dtype, fused AdamW where there is one."""
    model = build(cfg, weights, "").to(device=device, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=OPTIM.lr, fused=device.type == "cuda")
    micro = batch.to(device).split(mbs)

    def step():
        for mb in micro:
            (model(mb[:, :-1], mb[:, 1:]) / len(micro)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def kernels(step, sync) -> dict:
    """One step under torch.profiler: the GPU's busy time (kernels and copies), launches, aten ops, top kernels."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    with profile(activities=activities) as prof:
        step()
        sync()
    device_events = [e for e in prof.key_averages() if e.device_type != torch.autograd.DeviceType.CPU]
    busy = lambda e: getattr(e, "self_device_time_total", 0.0)  # noqa: E731 (microseconds)
    top = sorted(device_events, key=busy, reverse=True)[:15]
    cpu = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
    return {"device_busy_s": sum(busy(e) for e in device_events) / 1e6,
            "device_launches": sum(e.count for e in device_events),
            "aten_ops": sum(e.count for e in cpu if e.key.startswith("aten::")),
            "top": [{"kernel": e.key[:90], "count": e.count, "ms": busy(e) / 1e3} for e in top]}


def case(cfg: ModelConfig, weights, seq: int, mbs: int, env, cluster, dtype: str) -> dict:
    """One shape: the engine's and plain PyTorch's step, timed and under the profiler, beside the prediction."""
    sync = torch.cuda.synchronize if env.device.type == "cuda" else (lambda: None)
    batch = torch.randint(0, cfg.vocab_size, (2 * mbs, seq + 1), generator=torch.Generator().manual_seed(1))
    plan = Plan.uniform(cfg.n_layers, micro_batch_size=mbs, num_microbatches=2, seq_len=seq, compute_dtype=dtype)
    prof = profile_model(cfg, micro_batch_size=mbs, seq_len=seq, dtype=dtype,
                         kernels="gpu" if env.device.type == "cuda" else "cpu")
    pred = estimate(plan, prof, cluster)
    block = prof.pieces[1]
    out = {"seq": seq, "micro_batch": mbs, "microbatches": 2, "predicted_step_s": pred.step_time_s,
           "predicted_phases_s": pred.time_by_phase,
           "profile_ops_per_block": {"fwd": block.fwd_ops, "bwd": block.bwd_ops},
           "profile_ops_total": sum(p.fwd_ops + p.bwd_ops for p in prof.pieces)}
    engine = build_engine(build(cfg, weights, ""), plan, OPTIM, env)
    # a bound method, not a lambda over the name: `del engine` below would leave a lambda's body naming nothing
    engine_step = functools.partial(engine.train_step, batch)
    out["engine_tracked_step_s"] = timed(engine_step, sync)  # the steps the trainer logs count saved tensors
    engine.track_memory = False  # as the trainer runs the others
    out["engine_step_s"] = timed(engine_step, sync)
    out["engine_kernels"] = kernels(engine_step, sync)
    del engine, engine_step
    free_memory(env)
    step = plain_step(cfg, weights, batch, mbs, env.device, getattr(torch, dtype))
    out["plain_step_s"] = timed(step, sync)
    out["plain_kernels"] = kernels(step, sync)
    del step
    free_memory(env)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model: checks the logic without a GPU")
    args = ap.parse_args()
    if args.smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        torch.set_num_threads(1)
    env = one_rank()
    on_gpu = env.device.type == "cuda"
    cfg = ModelConfig.from_dict((DEFAULT_MODEL if on_gpu else SMOKE_MODEL).to_dict())
    dtype = "bfloat16" if on_gpu else "float32"
    cluster = local_cluster(env)
    shape = (1024, 2) if on_gpu else (64, 2)
    torch.manual_seed(0)
    weights = Decoder(cfg).state_dict()
    report = {"device": torch.cuda.get_device_name(env.device) if on_gpu else "cpu", "dtype": dtype,
              "shape": case(cfg, weights, *shape, env, cluster, dtype),
              "tiny": case(cfg, weights, 16, 1, env, cluster, dtype)}
    (OUT / "diagnose.json").write_text(json.dumps(report, indent=1))
    for name in ("shape", "tiny"):
        r = report[name]
        print(f"{name}: engine {r['engine_step_s']:.4f} s (memory counted {r['engine_tracked_step_s']:.4f} s), "
              f"plain {r['plain_step_s']:.4f} s, predicted {r['predicted_step_s']:.4f} s; device busy "
              f"{r['engine_kernels']['device_busy_s']:.4f} s over {r['engine_kernels']['device_launches']} launches "
              f"(plain {r['plain_kernels']['device_busy_s']:.4f} s, {r['plain_kernels']['device_launches']}); "
              f"profile ops/block {r['profile_ops_per_block']}")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
