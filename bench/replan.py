"""Does `--replan switch` make a run faster when the hardware profile is wrong? On 2 local gloo ranks.

The hardware profile given to the run makes FSDP2's collectives and optimizer work 50x too cheap (this machine's
own profile, scaled), so the search picks data parallelism; the calibration step corrects those terms from what
it measured, the corrected model prefers another plan and the run switches to it. Prints the replan record's
corrections, the wrong term's corrected cost against its measured one, and the measured gain against the
predicted one (the median step before the calibration against the median after the switch, warm-ups left out).
Usage: .venv/bin/python bench/replan.py [--steps 40] [--replan-after 10] [--scale 0.02]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snugfit.hardware.catalogue import hardware_cache_path  # noqa: E402
from snugfit.train.metrics import read_metrics  # noqa: E402

MODEL = ["--dim", "64", "--n-layers", "2", "--n-heads", "4", "--seq-len", "32", "--max-seq-len", "32",
         "--batch-size", "4"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--replan-after", type=int, default=10)
    ap.add_argument("--scale", type=float, default=0.02, help="what FSDP2's measured costs are multiplied by")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="snugfit-replan-"))
    wrong = json.loads(hardware_cache_path().read_text())
    for name, cost in wrong["host"]["fsdp"]["2"].items():
        if name != "contention":
            wrong["host"]["fsdp"]["2"][name] = [x * args.scale for x in cost]
    (tmp / "hardware.json").write_text(json.dumps(wrong))
    env = {**os.environ, "SNUGFIT_HARDWARE_PROFILE": str(tmp / "hardware.json"),
           "SNUGFIT_CORRECTIONS": str(tmp / "corrections.json")}
    run = subprocess.run([sys.executable, "-m", "snugfit", "train", "--nproc", "2", *MODEL, "--steps",
                          str(args.steps), "--replan", "switch", "--replan-after", str(args.replan_after),
                          "--log-every", "1", "--eval-every", "0", "--checkpoint-every", "0", "--progress", "false",
                          "--plot", "false", "--out-dir", str(tmp / "run")], env=env, capture_output=True, text=True)
    if run.returncode:
        print(run.stderr[-3000:])
        return 1
    records = read_metrics(tmp / "run" / "metrics.jsonl")
    (replan,) = [r for r in records if r["kind"] == "replan"]
    print("corrections:", ", ".join(f"{t} x{f:.2f}" for t, f in sorted(replan["corrections"].items())))
    term = "dp_comm_exposed"
    fixed, measured = replan["corrected_terms_s"][term], replan["measured_terms_s"][term]
    print(f"{term}: uncorrected {replan['predicted_terms_s'][term] * 1e3:.2f} ms, corrected {fixed * 1e3:.2f} ms, "
          f"measured {measured * 1e3:.2f} ms ({fixed / measured - 1:+.0%})")
    if not replan["switched"]:
        print("no switch:", "the corrected model keeps the plan" if replan.get("same_plan") else
              f"predicted gain {replan['predicted_gain']:.0%} under replan_gain")
        return 1
    times = {r["step"]: r["step_time_s"] for r in records if r["kind"] == "train"}
    start = replan["step"]
    before = statistics.median(t for s, t in times.items() if 1 < s < start)
    after = statistics.median(t for s, t in times.items() if s > start + 3)
    print(f"switched at step {start + 1} from dp {replan['old_plan']['dp']} x pp {replan['old_plan']['pp']} to "
          f"dp {replan['new_plan']['dp']} x pp {replan['new_plan']['pp']}: step {before * 1e3:.1f} ms before, "
          f"{after * 1e3:.1f} ms after: {1 - after / before:.0%} faster measured, "
          f"{replan['predicted_gain']:.0%} predicted")
    return 0 if after < before else 1


if __name__ == "__main__":
    raise SystemExit(main())
