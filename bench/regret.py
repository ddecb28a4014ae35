"""Does the search pick the plan that is really fastest? Regret and rank correlation on CPU ranks.

A tiny decoder on 2 (and 4) local gloo ranks with a per-rank memory budget below the
replicated footprint, so the choice matters. The grid: every (dp, pp, micro-batch,
schedule) the search would consider, each with uniform block options (ZeRO 0/2/3 x
keep/selective/recompute), kept where estimate() says it fits, plus the searched plan.
All of them are run through runtime.apply.build_engine and engine.train_step in one
launch per world size (plans build_engine refuses are reported and skipped). Prints
chosen measured / best measured (target <= 1.03) and the Spearman correlation of predicted
vs measured step time (target >= 0.9). Uses the hardware profile measured here.
Usage: .venv/bin/python bench/regret.py [--worlds 2 4] [--rounds 4]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

from snugfit.hardware import load_local, parse_cluster  # noqa: E402
from snugfit.hardware.measure import profile_hardware  # noqa: E402
from snugfit.model.decoder import Decoder, ModelConfig  # noqa: E402
from snugfit.plan.estimate import estimate  # noqa: E402
from snugfit.plan.explain import summary  # noqa: E402
from snugfit.plan.plan import BlockPlan, Plan  # noqa: E402
from snugfit.plan.search import Constraints, Searcher, budget_for, search  # noqa: E402
from snugfit.profile.profile import profile_model  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402

CFG = ModelConfig(dim=128, n_layers=4, n_heads=4, vocab_size=512, max_seq_len=128)
SEQ, GLOBAL_BATCH = 128, 8
OPTIONS = [BlockPlan(z, activations=a) for z in (0, 2, 3) for a in ("keep", "selective", "recompute")]


def _measure(env, plans: list[str], rounds: int) -> list[float | str]:
    """On every rank: each plan's best step time over `rounds` steps after a warm-up one, or why
    build_engine refused it. One engine at a time (live pipeline engines would share the gloo pairs),
    in a shuffled order so that the machine's load drift does not favour a position."""
    from snugfit.runtime.apply import build_engine
    from snugfit.runtime.engine import OptimConfig

    torch.set_num_threads(1)
    out: list[float | str] = [float("inf")] * len(plans)
    order = list(range(len(plans)))
    random.Random(0).shuffle(order)
    g = torch.Generator().manual_seed(1)
    for i in order:
        plan = Plan.from_json(plans[i])
        torch.manual_seed(0)
        try:
            engine = build_engine(Decoder(CFG), plan, OptimConfig(), env)
        except Exception as e:  # noqa: BLE001 - a plan the runtime cannot run yet is reported, not fatal
            out[i] = f"{type(e).__name__}: {e}"[:120]
            continue
        engine.track_memory = False
        rows = plan.micro_batch_size * plan.num_microbatches
        for r in range(rounds + 1):  # step 0 warms up
            batch = torch.randint(0, CFG.vocab_size, (rows, SEQ + 1), generator=g)
            torch.distributed.barrier()
            t0 = time.perf_counter()
            engine.train_step(batch)
            torch.distributed.barrier()
            if r:
                out[i] = min(out[i], time.perf_counter() - t0)
        del engine
    return out


def grid(prof, cluster, budget: int) -> list[Plan]:
    """Uniform plans over the search's outer candidates that estimate() says fit."""
    srch = Searcher(prof, cluster, GLOBAL_BATCH, Constraints(), budget)
    plans = []
    for cand in srch.candidates():
        if cand.schedule == "interleaved":
            continue
        for o in OPTIONS:
            if cand.dp == 1 and o.zero:
                continue
            plan = Plan.uniform(len(prof.blocks), dp=cand.dp, pp=cand.pp, block=o, schedule=cand.schedule,
                                micro_batch_size=cand.mbs, num_microbatches=cand.m, seq_len=SEQ)
            if estimate(plan, prof, cluster, budget).fits:
                plans.append(plan)
    return plans


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=4, help="timed steps per plan (best is kept)")
    ap.add_argument("--budget-fraction", type=float, default=0.8, help="of the replicated plan's peak")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if load_local() is None:
        profile_hardware()
    prof = profile_model(CFG, micro_batch_size=1, seq_len=SEQ, measure_on="cpu", clock=time.process_time)
    ok = True
    for world in args.worlds:
        cluster = parse_cluster(f"{world}xcpu")
        replicated = Plan.uniform(len(prof.blocks), dp=world, micro_batch_size=GLOBAL_BATCH // world, seq_len=SEQ)
        budget = int(args.budget_fraction * estimate(replicated, prof, cluster).peak_memory_bytes)
        chosen = search(prof, cluster, global_batch=GLOBAL_BATCH, memory_budget=budget_for(cluster, budget),
                        alternatives=0).best
        same = lambda a, b: {**a.to_dict(), "predicted": None} == {**b.to_dict(), "predicted": None}  # noqa: E731
        plans = [chosen] + [p for p in grid(prof, cluster, budget) if not same(p, chosen)]
        measured = run_ranks(_measure, world, [p.to_json() for p in plans], args.rounds)
        times = [max(r[i] for r in measured) if all(isinstance(r[i], float) for r in measured) else None
                 for i in range(len(plans))]
        print(f"{world} ranks, budget {budget / 2**20:.1f} MiB per rank (replicated needs "
              f"{replicated.predicted.peak_memory_bytes / 2**20:.1f}):")
        for i, (p, t) in enumerate(zip(plans, times)):
            tag = "chosen" if i == 0 else f"grid {i:2d}"
            shown = f"{t * 1e3:8.2f} ms" if t is not None else f"refused ({measured[0][i]})"
            print(f"  {tag}: predicted {p.predicted.step_time_s * 1e3:8.2f} ms, measured {shown}; {summary(p)}")
        ran = [(p.predicted.step_time_s, t) for p, t in zip(plans, times) if t is not None]
        if times[0] is None or len(ran) < 3:
            print("  too few plans ran to judge")
            ok = False
            continue
        regret = times[0] / min(t for _, t in ran)
        rho = spearmanr([a for a, _ in ran], [b for _, b in ran]).statistic
        ok &= regret <= 1.03 and rho >= 0.9
        print(f"  chosen / best measured = {regret:.3f} (target <= 1.03); Spearman predicted vs measured = "
              f"{rho:.3f} (target >= 0.9) over {len(ran)} plans")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
