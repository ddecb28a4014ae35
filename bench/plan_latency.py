"""How long the plan search takes (profiles cached, so only the search is timed).

Targets: <= 0.2 s for a 7B model on 4 GPUs, <= 1 s for a 70B model on 64 GPUs, <= 5 s for a 175B model on
1024 GPUs. Prints the best of --repeats runs in wall-clock and in process CPU seconds (the CPU figure ignores
other jobs on a shared machine), with how many candidates were solved and verified.
Usage: .venv/bin/python bench/plan_latency.py [--alternatives 0] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snugfit.hardware import parse_cluster  # noqa: E402
from snugfit.model.catalogue import resolve_model  # noqa: E402
from snugfit.plan.explain import summary  # noqa: E402
from snugfit.plan.kernels import gemm_cache_clear  # noqa: E402
from snugfit.plan.search import search  # noqa: E402
from snugfit.profile.cache import profile_model  # noqa: E402

CASES = [  # model, cluster, global batch, sequence, target seconds
    ("llama-2-7b", "4xRTX4090", 32, 2048, 0.2),
    ("llama-2-70b", "8x8xH100-80GB", 512, 4096, 1.0),
    # 1024 ranks: every estimate() walks them (docs/scale.md row 5)
    ("docs/configs/opt-175b-untied.json", "128x8xA100-80GB", 1024, 2048, 5.0),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alternatives", type=int, default=0, help="runners-up verified besides the chosen plan")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile-cache", help="directory for cached model profiles")
    args = ap.parse_args()
    ok = True
    for name, spec, gb, seq, target in CASES:
        prof = profile_model(resolve_model(name), micro_batch_size=1, seq_len=seq, dtype="bfloat16",
                             cache_dir=args.profile_cache)
        cluster = parse_cluster(spec)
        wall = cpu = float("inf")
        for _ in range(args.repeats):
            gemm_cache_clear()  # each repeat from a cold cache, as one `snugfit plan` runs
            w0, c0 = time.perf_counter(), time.process_time()
            res = search(prof, cluster, global_batch=gb, alternatives=args.alternatives)
            wall, cpu = min(wall, time.perf_counter() - w0), min(cpu, time.process_time() - c0)
        ok &= cpu <= target
        print(f"{name} on {spec}, global batch {gb}, seq {seq}: {wall:.3f} s wall, {cpu:.3f} s CPU "
              f"(target {target} s: {'met' if cpu <= target else 'MISSED'}); {res.candidates} candidates, "
              f"{res.solved} solved, {res.verified} verified by estimate() in {res.verify_s:.3f} s wall")
        print(f"  chosen: {summary(res.best)}; {res.best.predicted.tokens_per_s:,.0f} tokens/s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
