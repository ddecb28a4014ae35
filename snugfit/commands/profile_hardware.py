"""`snugfit profile-hardware`: measure this machine for the time model."""

from __future__ import annotations

import argparse
import json


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("profile-hardware", help="measure matmul, memory, collective and optimizer rates here")
    p.add_argument("--out", help="write here instead of ~/.cache/snugfit/hardware.json (the file plans read)")
    p.add_argument("--no-collectives", action="store_true", help="skip the 2-process gloo measurement")
    return p


def run(args: argparse.Namespace) -> int:
    from snugfit.hardware.measure import profile_hardware

    local = profile_hardware(args.out, collectives=not args.no_collectives)
    print(json.dumps(local.to_dict(), indent=2))
    return 0
