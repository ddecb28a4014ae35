"""snugfit's single-process step against a plain PyTorch loop: same model, optimizer, data, batch.

Prints the ratio of median step times, measured in one run with the two loops
interleaved in rounds so that machine noise hits both alike. Target <= 1.02. Also the steps the trainer logs,
which count saved tensors (engine.track_memory), against the others (it was 12x on a 16-block model; target <= 1.5).
Usage: python bench/overhead.py [--steps 30] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from snugfit.config import build_config
from snugfit.data import BatchSampler, load_tokenizer, load_tokens, split
from snugfit.model import Decoder
from snugfit.runtime.build import build_engine
from snugfit.runtime.dist import DistEnv
from snugfit.runtime.optimizer import OptimConfig
from snugfit.train.autoplan import run_dtype
from snugfit.train.loop import lr_at, resolve_plan


def plain_step(model, optimizer, batch, lr, clip):
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = model(batch[:, :-1], batch[:, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=30, help="steps per loop per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    # data parallel over one rank: the whole batch in one microbatch, as the plain loop runs it
    cfg = build_config(None, {"progress": False, "plan": "dp"})
    t = cfg.train
    tokens = load_tokens("", "auto", load_tokenizer("byte"))
    data = split(tokens, t.seq_len, 0.0, cfg.model.vocab_size)

    torch.manual_seed(0)
    env = DistEnv()
    t.dtype, _ = run_dtype(t.dtype, env.device)
    plan = resolve_plan(cfg, cfg.model, env)
    engine = build_engine(Decoder(cfg.model), plan, OptimConfig(lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip), env)
    engine.track_memory = False  # as the trainer runs every step but the ones it logs
    snug_sampler = BatchSampler(data.train, t.seq_len, plan.global_batch, t.seed)

    torch.manual_seed(0)
    model = Decoder(cfg.model)
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(0.9, 0.95), fused=True)
    plain_sampler = BatchSampler(data.train, t.seq_len, plan.global_batch, t.seed)

    times = {"snugfit": [], "plain": []}
    step = 0
    for _ in range(args.rounds):
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.set_lr(lr_at(step, cfg))
            engine.train_step(snug_sampler.next_batch())
            times["snugfit"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            plain_step(model, optimizer, plain_sampler.next_batch(), lr_at(step, cfg), t.grad_clip)
            times["plain"].append(time.perf_counter() - t0)
            step += 1
    engine.track_memory = True
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.train_step(snug_sampler.next_batch())
        times.setdefault("tracked", []).append(time.perf_counter() - t0)
    warm = args.steps // 3  # first steps of the first round warm allocators and caches
    snug, plain = (statistics.median(v[warm:]) for v in (times["snugfit"], times["plain"]))
    tracked = statistics.median(times["tracked"])
    print(f"model {cfg.model.num_params() / 1e6:.2f}M params, batch {plan.global_batch} x {t.seq_len}, {len(times['plain']) - warm} steps each")
    print(f"median step: snugfit {snug * 1e3:.1f} ms, plain PyTorch {plain * 1e3:.1f} ms")
    print(f"overhead ratio (snugfit / plain): {snug / plain:.3f}  (target <= 1.02)")
    print(f"logged steps (memory counted) / others: {tracked / snug:.2f}  (target <= 1.5)")


if __name__ == "__main__":
    main()
