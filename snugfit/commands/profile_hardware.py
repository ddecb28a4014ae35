"""`snugfit profile-hardware`: measure this machine for the time model."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from snugfit.hardware.catalogue import LocalHardware, measured_card
from snugfit.hardware.cluster import Cluster


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("profile-hardware", help="measure matmul, memory, collective and optimizer rates here")
    p.add_argument("--out", help="write here instead of ~/.cache/snugfit/hardware.json (the file plans read)")
    p.add_argument("--no-collectives", action="store_true", help="skip the 2-process gloo measurement")
    p.add_argument("--no-compile", action="store_true", help="skip timing a compiled block (it compiles one: seconds "
                                                             "to a minute on a CPU)")
    p.add_argument("--toml", help="also write this machine as a cluster file `snugfit plan --cluster` takes, e.g. "
                                  "on a GPU machine to plan for it elsewhere (its GPU as a [[gpu]] table)")
    p.set_defaults(prints_json=True)  # its stdout is the profile; messages go to stderr (cli.main)
    return p


def run(args: argparse.Namespace) -> int:
    from snugfit.calibrate.hardware import profile_hardware

    local = profile_hardware(args.out, collectives=not args.no_collectives, compiled=not args.no_compile)
    print(json.dumps(local.to_dict(), indent=2))
    if args.toml:
        Path(args.toml).write_text(machine_cluster(local).to_toml())
        print(f"cluster file: {args.toml} (plan with --cluster {args.toml})")
    return 0


def machine_cluster(local: LocalHardware) -> Cluster:
    """This machine as a one-node cluster: its accelerators as measured (named as torch names them), or its CPU."""
    import torch

    from snugfit.hardware.cluster import make_node

    if not torch.accelerator.is_available():
        node = make_node("cpu", 1)
        return Cluster([node], node.intra, "cpu")
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else local.device.name
    # with the catalogue's links for the card (an SXM node's GPUs talk over NVLink, which measuring one card does
    # not see), under its own name, so that the file carries what was measured
    device = local.device
    gpu = replace(measured_card(name, device.memory_bytes, device.sms, local), name=name)
    node = make_node(gpu.name, torch.accelerator.device_count(), host=local.host, custom={gpu.name: gpu})
    return Cluster([node], node.intra, name)
