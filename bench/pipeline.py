"""Per-stage peak activation memory and step time of 1F1B, BPipe, recompute-all and zero-bubble V, p=4, in one run.

    python bench/pipeline.py [--dim 64 --blocks 8 --microbatches 8 --steps 3]

Runs 4 gloo processes on this machine (CPU) or one per GPU; prints one table.
"""

import argparse
import os
import time

import torch

from snugfit.model.decoder import Decoder, ModelConfig
from snugfit.plan import BlockPlan, Plan
from snugfit.runtime.optimizer import OptimConfig
from snugfit.runtime.build import build_engine
from snugfit.runtime.spawn import run_ranks

VARIANTS = {"1f1b": ("1f1b", "keep"), "bpipe": ("bpipe", "keep"), "recompute-all": ("1f1b", "recompute"),
            "zbv": ("zbv", "keep")}


def _bench(env, args):
    if env.device.type == "cpu":  # 4 ranks share the cores: per-rank thread pools would oversubscribe them
        torch.set_num_threads(max(1, (os.cpu_count() or 4) // 4))
    cfg = ModelConfig(dim=args.dim, n_layers=args.blocks, n_heads=4, vocab_size=args.vocab, max_seq_len=args.seq)
    out = {}
    for name, (schedule, policy) in VARIANTS.items():
        plan = Plan.uniform(args.blocks, pp=4, schedule=schedule, block=BlockPlan(activations=policy),
                            micro_batch_size=args.mbs, num_microbatches=args.microbatches, seq_len=args.seq)
        torch.manual_seed(0)
        engine = build_engine(Decoder(cfg), plan, OptimConfig(), env)
        batch = torch.randint(0, args.vocab, (args.mbs * args.microbatches, args.seq + 1))
        engine.train_step(batch)  # warm-up (shape inference, allocator)
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.train_step(batch)
        out[name] = dict(engine.stage_stats(), step_s=(time.perf_counter() - start) / args.steps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag, default in (("dim", 64), ("blocks", 8), ("microbatches", 8), ("mbs", 2), ("seq", 64), ("vocab", 256),
                          ("steps", 3)):
        ap.add_argument(f"--{flag}", type=int, default=default)
    args = ap.parse_args()
    ranks = run_ranks(_bench, 4, args)
    print(f"{'variant':<14}{'stage':>6}{'peak act MiB':>14}{'peak mbs':>10}{'evict':>7}{'accept':>8}{'step s':>9}")
    for name in VARIANTS:
        for r in ranks:
            s = r[name]
            print(f"{name:<14}{s['pp_rank']:>6}{s['peak_activation_bytes'] / 2**20:>14.2f}{s['peak_microbatches']:>10}"
                  f"{s['evictions']:>7}{s['accepted']:>8}{s['step_s']:>9.3f}")


if __name__ == "__main__":
    main()
