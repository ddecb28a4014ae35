"""Tokens/s of 2-rank ZeRO-3 and 2-rank partial offload against 2-rank replicated data parallelism.

Same tiny model and batch for every plan, one spawn of two gloo ranks (CPU) or
NCCL ranks (two GPUs). Prints tokens/s and the ratio to replicated DP.

    python bench/dp.py [--dim 64] [--layers 4] [--seq 64] [--steps 6]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from snugfit.model.decoder import Decoder, ModelConfig  # noqa: E402
from snugfit.plan import BlockPlan, Plan  # noqa: E402
from snugfit.runtime.build import build_engine  # noqa: E402
from snugfit.runtime.optimizer import OptimConfig  # noqa: E402
from snugfit.runtime.spawn import run_ranks  # noqa: E402

PLANS = {
    "replicated (zero 0)": BlockPlan(zero=0),
    "zero 3": BlockPlan(zero=3),
    "partial offload (zero 0 + host AdamW)": BlockPlan(zero=0, placement="host_step"),
    "zero 3 + partial offload": BlockPlan(zero=3, placement="host_step"),
}


def measure(env, cfg: ModelConfig, plans: dict[str, Plan], steps: int) -> dict[str, float]:
    """tokens/s (all ranks) of each plan, after two warm-up steps."""
    torch.set_num_threads(1)
    out = {}
    for name, plan in plans.items():
        torch.manual_seed(0)
        engine = build_engine(Decoder(cfg), plan, OptimConfig(), env)
        rows = plan.micro_batch_size * plan.num_microbatches
        batch = torch.randint(0, cfg.vocab_size, (rows, plan.seq_len + 1))
        for _ in range(2):
            engine.train_step(batch)
        start = time.perf_counter()
        for _ in range(steps):
            engine.train_step(batch)
        if engine.host is not None:
            engine.host.wait()
        out[name] = steps * plan.tokens_per_step / (time.perf_counter() - start)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    cfg = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=4, vocab_size=256, max_seq_len=args.seq)
    plans = {name: Plan.uniform(args.layers, dp=2, block=b, micro_batch_size=4, num_microbatches=2, seq_len=args.seq)
             for name, b in PLANS.items()}
    rates = run_ranks(measure, 2, cfg, plans, args.steps)[0]
    base = rates["replicated (zero 0)"]
    print(f"model dim {args.dim}, {args.layers} blocks, {cfg.num_params() / 1e6:.2f}M params, seq {args.seq}, 2 ranks")
    for name, rate in rates.items():
        print(f"{name:40s} {rate:10.0f} tokens/s   x{rate / base:.2f} of replicated")


if __name__ == "__main__":
    main()
