"""snugfit's plan vs FSDP2 full CPU offload on one GPU whose memory is capped.

Caps the CUDA allocator (torch.cuda.set_per_process_memory_fraction) at 0.6 x the peak
snugfit predicts for the replicated plan (no sharding, no offload, micro-batch 1), so the
model (default: a Llama-style 1.1B, random weights, bf16 compute) does not fit without
offload. Then, for that budget, it searches snugfit's plan and the fastest FSDP2 full CPU
offload plan (every block and the root ZeRO-3 + CPUOffloadPolicy, activations kept, else
recomputed), runs both through the same runtime (build_engine), 2 warm-up and --steps timed
steps each, and prints predicted vs measured step time and peak memory, tokens/s and the
speedup. The numbers also go to $OUT/gpu_bench.json (./gpu_bench.json without $OUT).

One process (a 1-rank NCCL group); a few minutes on an H100/H200. CPU CI never runs it.
Usage: python bench/gpu/run.py [--model NAME|config.json] [--seq 2048] [--batch 8] [--steps 5]
       python bench/gpu/run.py --smoke   # the same logic on CPU: tiny model, gloo, budget 0.9 x, no cap
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from snugfit.hardware.cluster import Cluster  # noqa: E402
from snugfit.model.catalogue import resolve_model  # noqa: E402
from snugfit.model.decoder import Decoder, ModelConfig  # noqa: E402
from snugfit.plan.estimate import estimate  # noqa: E402
from snugfit.plan.explain import summary  # noqa: E402
from snugfit.plan.memory import device_bytes  # noqa: E402
from snugfit.plan.plan import Plan  # noqa: E402
from snugfit.plan.search import Constraints, NoPlanError, search  # noqa: E402
from snugfit.profile.profile import profile_model  # noqa: E402
from snugfit.runtime.build import build_engine  # noqa: E402
from snugfit.runtime.dist import DistEnv, init_distributed  # noqa: E402
from snugfit.runtime.engine import OptimConfig  # noqa: E402
from snugfit.train.autoplan import local_cluster  # noqa: E402

GIB = 2**30
BUDGET_FRACTION = 0.6  # of the replicated plan's predicted peak
# On CPU the search offloads nothing (host and device are one memory), so only recomputation saves memory there
SMOKE_BUDGET_FRACTION = 0.9
WARMUP = 2
# Llama-3.2-1B's shape with a 32k vocabulary: 1.1B parameters
DEFAULT_MODEL = ModelConfig(arch="llama", vocab_size=32000, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                            ffn_dim=8192, max_seq_len=2048, rope_theta=500000.0)
SMOKE_MODEL = ModelConfig(arch="llama", vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=256)


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The built-in decoder to train: --model (a catalogue name or config.json), else the default or smoke one."""
    if args.smoke:
        cfg = ModelConfig.from_dict(SMOKE_MODEL.to_dict())
    elif args.model:
        cfg = resolve_model(args.model)
        if isinstance(cfg, dict):
            raise SystemExit(f"{args.model} is a Hugging Face config; this bench trains built-in decoders only "
                             "(gpt2*, llama*, mistral-7b, or a config.json with an 'arch' key)")
    else:
        cfg = ModelConfig.from_dict(DEFAULT_MODEL.to_dict())
    cfg.max_seq_len = max(cfg.max_seq_len, args.seq)
    return cfg


def one_rank() -> DistEnv:
    """A 1-rank process group through snugfit's init_distributed (NCCL on a GPU, gloo on CPU)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        os.environ.setdefault(key, value)
    return init_distributed()


def full_offload(profile, cluster: Cluster, batch: int, budget: int) -> Plan:
    """The fastest FSDP2 full CPU offload plan that fits: activations kept if they fit, else recomputed."""
    for acts in ("keep", "recompute"):
        try:
            return search(profile, cluster, global_batch=batch, memory_budget=budget, alternatives=0,
                          constraints=Constraints(zero=3, offload_params=True, activations=acts)).best
        except NoPlanError:
            continue
    raise SystemExit(f"FSDP2 full CPU offload fits nowhere in {budget / GIB:.3g} GiB; lower --seq or --batch")


def predicted_peak(plan: Plan, on_gpu: bool) -> int:
    """What the measurement is compared with: the allocator's part of the device peak on a GPU (no CUDA
    context, no fragmentation reserve); the MemoryTracker's device total on CPU (no allocator there)."""
    if on_gpu:
        cats = plan.predicted.memory_by_rank[0]
        return device_bytes(cats) - cats.get("reserve", 0)
    return plan.predicted.tracked_by_rank[0]["device.total"]


def measure(cfg: ModelConfig, plan: Plan, env: DistEnv, steps: int) -> dict:
    """Train `plan` for WARMUP + steps steps; the timed steps' median and peak memory.

    Step times are the gaps between consecutive step ends (device synchronised), so a
    host optimizer step that overlaps the next forward is counted as the runtime runs it.
    """
    on_gpu = env.device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    torch.manual_seed(0)
    engine = build_engine(Decoder(cfg), plan, OptimConfig(), env)
    batch = torch.randint(0, cfg.vocab_size, (plan.num_microbatches * plan.micro_batch_size, plan.seq_len + 1))
    for i in range(WARMUP):
        engine.track_memory = i == WARMUP - 1  # the last warm-up: the tracker's peak, optimizer states included
        engine.train_step(batch)
    tracked = engine.memory.peak()["device.total"]
    engine.track_memory = False
    sync()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    ends = [time.perf_counter()]
    for _ in range(steps):
        result = engine.train_step(batch)
        sync()
        ends.append(time.perf_counter())
    if engine.host is not None:
        engine.host.wait()
    times = [b - a for a, b in zip(ends, ends[1:])]
    return {"step_times_s": times, "measured_step_s": statistics.median(times), "loss": result.loss,
            "measured_peak_bytes": torch.cuda.max_memory_allocated() if on_gpu else tracked,
            "measured_reserved_bytes": torch.cuda.max_memory_reserved() if on_gpu else None,  # fragmentation too
            "measured_tracked_bytes": tracked}


def run_plan(name: str, cfg: ModelConfig, plan: Plan, env: DistEnv, steps: int) -> dict:
    """Predictions and measurements of one plan; a run the allocator cap stops is reported, not fatal."""
    pred = plan.predicted
    row = {"plan": summary(plan), "predicted_step_s": pred.step_time_s, "predicted_tokens_per_s": pred.tokens_per_s,
           "predicted_peak_bytes": predicted_peak(plan, env.device.type == "cuda"),
           "predicted_tracked_bytes": pred.tracked_by_rank[0]["device.total"], "predicted_phases_s": pred.time_by_phase}
    print(f"running {name}: {row['plan']}", flush=True)
    try:
        row.update(measure(cfg, plan, env, steps))
        row["measured_tokens_per_s"] = plan.tokens_per_step / row["measured_step_s"]
    except torch.OutOfMemoryError as err:
        row["error"] = f"out of memory: {str(err).splitlines()[0]}"
    gc.collect()  # FSDP2 modules hold reference cycles; free this plan's memory before the next
    if env.device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def print_table(rows: dict[str, dict]) -> None:
    print(f"{'':>13} {'pred s':>8} {'meas s':>8} {'err':>7} {'pred GiB':>9} {'meas GiB':>9} "
          f"{'pred tok/s':>11} {'meas tok/s':>11}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:>13} {r['predicted_step_s']:>8.3f} {r['error']}")
            continue
        err = r["predicted_step_s"] / r["measured_step_s"] - 1
        print(f"{name:>13} {r['predicted_step_s']:>8.3f} {r['measured_step_s']:>8.3f} {err:>+7.1%} "
              f"{r['predicted_peak_bytes'] / GIB:>9.3g} {r['measured_peak_bytes'] / GIB:>9.3g} "
              f"{r['predicted_tokens_per_s']:>11,.0f} {r['measured_tokens_per_s']:>11,.0f}")
    for name, r in rows.items():
        print(f"{name}: {r['plan']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="built-in decoder: catalogue name (gpt2*, llama*, mistral-7b) or config.json")
    ap.add_argument("--seq", type=int, help="sequence length (default 2048; smoke 128)")
    ap.add_argument("--batch", type=int, default=8, help="global batch in sequences")
    ap.add_argument("--steps", type=int, help="timed steps per plan (default 5; smoke 3)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, gloo: checks the logic without a GPU")
    args = ap.parse_args()
    args.seq = args.seq or (128 if args.smoke else 2048)
    args.steps = args.steps or (3 if args.smoke else 5)
    t0 = time.perf_counter()
    if args.smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # read when CUDA starts, which nothing has asked for yet
        torch.set_num_threads(1)
    env = one_rank()
    on_gpu = env.device.type == "cuda"
    if not (on_gpu or args.smoke):
        raise SystemExit("no CUDA GPU here; run with --smoke to check the logic on CPU")
    cfg = model_config(args)
    dtype = "bfloat16" if on_gpu else "float32"
    cluster = local_cluster(env)  # the catalogue's entry for this GPU, else the GPU measured now
    gpu = cluster.gpu_of(0)
    device_mem = torch.cuda.get_device_properties(env.device).total_memory if on_gpu else gpu.memory_bytes
    profile = profile_model(cfg, micro_batch_size=1, seq_len=args.seq, dtype=dtype)
    n_params = profile.num_params()
    replicated = Plan.uniform(cfg.n_layers, micro_batch_size=1, num_microbatches=args.batch, seq_len=args.seq,
                              compute_dtype=dtype)
    need = estimate(replicated, profile, cluster).peak_memory_bytes
    share = SMOKE_BUDGET_FRACTION if args.smoke else BUDGET_FRACTION
    budget = min(int(share * need), device_mem)
    fraction = budget / device_mem
    print(f"{gpu.name}, {n_params:,} parameters, seq {args.seq}, global batch {args.batch}, {dtype}")
    print(f"budget {budget / GIB:.3g} GiB = {share} x the replicated plan's predicted peak "
          f"{need / GIB:.3g} GiB" + (f"; allocator capped at {fraction:.4f} of {device_mem / GIB:.1f} GiB"
                                    if on_gpu else " (planning only: no allocator cap on CPU)"))
    if on_gpu:
        torch.cuda.set_per_process_memory_fraction(fraction, env.device)
    plans = {"snugfit": search(profile, cluster, global_batch=args.batch, memory_budget=budget, alternatives=0).best,
             "full offload": full_offload(profile, cluster, args.batch, budget)}
    rows = {name: run_plan(name, cfg, plan, env, args.steps) for name, plan in plans.items()}
    print_table(rows)
    mine, base = rows["snugfit"], rows["full offload"]
    speedup = {"predicted": base["predicted_step_s"] / mine["predicted_step_s"]}
    if "error" not in mine and "error" not in base:
        speedup["measured"] = base["measured_step_s"] / mine["measured_step_s"]
    print("speedup snugfit / full offload: " + ", ".join(f"{v:.2f}x {k}" for k, v in speedup.items()))
    elapsed = time.perf_counter() - t0
    print(f"elapsed {elapsed:.0f} s")
    out = Path(os.environ.get("OUT", ".")) / "gpu_bench.json"
    out.write_text(json.dumps({
        "device": torch.cuda.get_device_name(env.device) if on_gpu else "cpu", "cluster": cluster.spec,
        "model": cfg.to_dict(), "params": n_params, "seq_len": args.seq, "global_batch": args.batch, "dtype": dtype,
        "replicated_peak_bytes": need, "budget_bytes": budget, "memory_fraction": fraction if on_gpu else None,
        "plans": rows, "speedup": speedup, "elapsed_s": elapsed}, indent=2))
    print(f"wrote {out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
