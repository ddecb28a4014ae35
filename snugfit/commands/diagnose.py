"""`snugfit diagnose RUN_DIR`: where a run departs from its plan's predictions, with stragglers named."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "diagnose", help="say where a run's measurements depart from its plan (stragglers, terms, memory)",
        description="Read a run's plan.json, metrics.jsonl and traces (--trace-step, and the calibration step of "
        "[train] replan), print measured against predicted per term and rank, and one line per finding: "
        "stragglers with the phase, the model's terms that are off, memory, checkpoints' blocking time.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the --out-dir of a `snugfit train` run")
    p.add_argument("--picture", help="where to draw the picture (default: RUN_DIR/diagnose.png); 'none' to skip")
    return p


def run(args: argparse.Namespace) -> int:
    from snugfit.report.diagnose import diagnose

    run_dir = Path(args.run_dir)
    picture = None if args.picture == "none" else Path(args.picture or run_dir / "diagnose.png")
    print("\n".join(diagnose(run_dir, picture).lines()))
    return 0
