"""The plan `snugfit plan --json` chooses for a fixed set of rows, to check that a change to the search keeps them.

The rows are bench/plan_latency.py's cases, every `snugfit plan` docs/scale_runs.sh quotes (docs/scale.md), and
searches that reach the other parts of the search (offload on one GPU, zero-bubble and gradient-reduction modes,
the step in backward, a mixed cluster). Run it before and after a change and compare:
  .venv/bin/python bench/plan_choices.py --out before.json
  .venv/bin/python bench/plan_choices.py --out after.json --compare before.json
--compare prints each row whose chosen plan (its JSON, predictions included) differs, and exits 1 if any does.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from snugfit.plan import Plan  # noqa: E402
BF = "--dtype bfloat16 --reduce-dtype float32"
GPT3 = "--model docs/configs/gpt3-175b.json --cluster 128x8xA100-80GB --seq 2048 --micro-batch 1 --recompute full " \
       "--dtype bfloat16 --reduce-dtype bfloat16"
OPT = "--model docs/configs/opt-175b-untied.json --cluster 128x8xA100-80GB --seq 2048 --dtype bfloat16 " \
      "--reduce-dtype bfloat16"
GPT2 = "--model gpt2-xl --cluster 4xRTX4090 --seq 1024 --micro-batch 4 --pp 4 --num-microbatches 8 --zero 0 " \
       "--dtype bfloat16 --reduce-dtype bfloat16 --memory-budget 16GiB"
ROWS = [
    # bench/plan_latency.py
    "--model llama-2-7b --cluster 4xRTX4090 --global-batch 32 --seq 2048",
    "--model llama-2-70b --cluster 8x8xH100-80GB --global-batch 512 --seq 4096",
    f"{OPT} --global-batch 1024",
    f"{OPT} --global-batch 1024 --compile false",
    # docs/scale_runs.sh (docs/scale.md); all but the OPT search above evaluate one plan as given
    f"--model llama-3.1-8b --cluster 8xH100 --seq 8192 --micro-batch 2 --dp 8 --pp 1 --zero 3 "
    f"--recompute selective_half {BF}",
    f"--model llama-3.1-8b --cluster 8xH100 --seq 8192 --micro-batch 2 --dp 8 --pp 1 --zero 3 "
    f"--recompute selective_half {BF} --compile",
    f"--model llama-3-8b --cluster 8x8xA100-80GB --seq 8192 --micro-batch 1 --dp 64 --pp 1 --zero 3 "
    f"--recompute selective_half {BF}",
    f"--model docs/configs/mpt-7b.json --cluster 8xH100 --seq 2048 --micro-batch 6 --global-batch 48 --dp 8 --pp 1 "
    f"--zero 3 --recompute none {BF}",
    f"--model docs/configs/mpt-7b.json --cluster 8xH100 --seq 8192 --micro-batch 8 --num-microbatches 2 --dp 8 "
    f"--pp 1 --zero 3 --recompute full {BF}",
    *(f"--model docs/configs/zero-7.5b.json --cluster 8x8xV100-32GB --seq 1024 --micro-batch 1 --dp 64 --pp 1 "
      f"--zero {z} --recompute none --dtype float16 --reduce-dtype float16" for z in range(4)),
    f"{GPT3} --pp 8 --dp 128 --num-microbatches 8 --zero 3",
    f"{GPT3} --pp 16 --dp 64 --num-microbatches 16 --zero 1",
    f"{GPT3} --pp 1 --dp 1024 --zero 3",
    f"{OPT} --tp 8 --pp 1 --dp 128 --zero 3 --micro-batch 8 --num-microbatches 1 --recompute full",
    *(f"{GPT2} --schedule {s} --recompute {r}" for s, r in (("1f1b", "keep"), ("bpipe", "keep"),
                                                          ("1f1b", "recompute"))),
    # searches over the rest of the search
    "--model llama-3-8b --cluster 4xRTX4090 --seq 4096 --global-batch 32",
    "--model llama-2-7b --cluster 1xRTX4090 --seq 2048 --global-batch 8",
    "--model llama-2-13b --cluster 2x8xA100-80GB-SXM --seq 4096 --global-batch 128",
    "--model gpt2-xl --cluster 4xRTX4090 --seq 1024 --global-batch 64 --memory-budget 16GiB",
    "--model gpt2-xl --cluster 4xRTX4090 --seq 1024 --global-batch 64 --pp 4 --memory-budget 12GiB",
    "--model gpt2-xl --cluster 4xRTX4090 --seq 1024 --global-batch 64 --schedule zbv --memory-budget 12GiB",
    "--model llama-2-7b --cluster 8xH100 --seq 4096 --global-batch 64 --grad-reduce microbatch",
    "--model llama-2-7b --cluster 8xH100 --seq 4096 --global-batch 256",
    "--model llama-2-7b --cluster 4xRTX4090 --seq 2048 --global-batch 32 --optimizer-in-backward",
    "--model qwen2.5-14b --cluster 8xL4 --seq 2048 --global-batch 64",
    "--model llama-2-70b --cluster 4x8xA100-80GB-SXM --seq 4096 --global-batch 256",
]


def chosen(row: str) -> dict | str:
    """The plan `snugfit plan ... --json` prints for the row, or its error's last line."""
    run = subprocess.run([sys.executable, "-m", "snugfit", "plan", *row.split(), "--json"], cwd=ROOT,
                         capture_output=True, text=True)
    if run.returncode:
        return "error: " + (run.stderr.strip().splitlines() or ["(no message)"])[-1]
    return json.loads(run.stdout)


def comparable(plan: dict | str | None, like: dict | str | None = None) -> Plan | str | None:
    """A row's plan as the current code reads it (plan JSON of an earlier layout migrated), or its error; `like`:
    the plan it is compared with, whose prediction's fields alone are compared (those a later snugfit added to
    Prediction, absent there, are left out)."""
    if not isinstance(plan, dict):
        return plan
    if isinstance(like, dict) and isinstance(plan.get("predicted"), dict) and isinstance(like.get("predicted"), dict):
        plan = {**plan, "predicted": {k: v for k, v in plan["predicted"].items() if k in like["predicted"]}}
    return Plan.from_dict(plan)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file: row -> chosen plan")
    ap.add_argument("--compare", help="an earlier --out to compare with")
    args = ap.parse_args()
    plans = {}
    for i, row in enumerate(ROWS):
        plans[row] = chosen(row)
        print(f"[{i + 1}/{len(ROWS)}] {row}", file=sys.stderr, flush=True)
    Path(args.out).write_text(json.dumps(plans, indent=1))
    if not args.compare:
        return 0
    before = json.loads(Path(args.compare).read_text())
    differ = [row for row in ROWS if comparable(before.get(row)) != comparable(plans[row], before.get(row))]
    for row in differ:
        print(f"DIFFERS: {row}\n  before: {json.dumps(before.get(row))[:400]}\n  after:  {json.dumps(plans[row])[:400]}")
    print(f"{len(ROWS) - len(differ)} of {len(ROWS)} rows choose the same plan")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
