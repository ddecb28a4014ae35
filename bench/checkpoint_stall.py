"""Step time before and after a checkpoint, in one single-process `snugfit train` run.

A save must cost only its own step: the steps after it should run as fast as the steps before it.
(A 1-rank gloo group once made every later step 45-60% slower: DCP gathered over it, gloo's thread
started a second OpenMP team, and that team oversubscribed the cores for the rest of the run.)
Prints the ratio of median step time after the save to before it. Target <= 1.05.
Usage: python bench/checkpoint_stall.py [--steps 160] [--save-at 80]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--save-at", type=int, default=80, help="the one checkpoint before the last step")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "snugfit", "train", "--steps", str(args.steps),
                        "--checkpoint-every", str(args.save_at), "--eval-every", "0", "--log-every", "1",
                        "--out-dir", out, "--plan", "dp"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["step_time_s"] for r in records if r.get("kind") == "train"}
    warm = args.save_at // 4  # skip start-up and the first steps' allocator growth
    before = [t for s, t in times.items() if warm <= s < args.save_at]
    after = [t for s, t in times.items() if args.save_at + 2 <= s < args.steps]
    b, a = statistics.median(before), statistics.median(after)
    print(f"median step before the save {b * 1e3:.1f} ms ({len(before)} steps), after {a * 1e3:.1f} ms "
          f"({len(after)} steps): ratio {a / b:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
