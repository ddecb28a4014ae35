"""`snugfit train`: train under a plan, locally or on N ranks through torchrun's launcher."""

from __future__ import annotations

import argparse
import os
import sys

from snugfit.commands.options import add_config_options, config_from_args


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train",
        help="train a model (defaults: a small model on the embedded corpus)",
        description="Train a model. Settings come from defaults, then --config FILE (TOML with sections "
        "[model] [data] [train] [finetune] [parallel]), then --key value overrides. Every key is --section.key; "
        "keys unique across sections also take the short form shown. [parallel] dp, pp, zero, ... fix parts of "
        "the searched plan; the rest is searched for the launched ranks.",
    )
    add_config_options(p)
    return p


LAUNCH_KEYS = ("nproc", "nnodes", "node_rank", "rdzv_endpoint", "max_restarts")


def _without_launch_options(argv: list[str]) -> list[str]:
    names = {f"--{k.replace('_', '-')}" for k in LAUNCH_KEYS} | {f"--parallel.{k}" for k in LAUNCH_KEYS}
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True  # its value follows
        elif arg.split("=", 1)[0] not in names:
            out.append(arg)
    return out


def run(args: argparse.Namespace) -> int:
    cfg, _ = config_from_args(args)
    par = cfg.parallel
    if "RANK" not in os.environ and (par.nproc > 1 or par.nnodes > 1 or par.max_restarts > 0):
        from snugfit.runtime.launch import launch

        # The ranks re-read the same command line, less the launch options (torchrun's own parser would
        # take them for its own); inside torchrun's environment they train instead of launching.
        argv = _without_launch_options(sys.argv[1:])
        plan = None
        if par.plan not in ("auto", "dp"):
            from snugfit.train.autoplan import check_plan_file

            check_plan_file(cfg, par.nproc * par.nnodes)
        if par.plan == "auto":  # searched here, once, before any rank starts; other nodes receive node 0's
            from snugfit.runtime.launch import PlanHandoff
            from snugfit.train.autoplan import plan_for_launch

            searches = par.nnodes == 1 or par.node_rank == 0
            plan = PlanHandoff(search=(lambda: plan_for_launch(cfg, par.nproc, par.nnodes)) if searches else None)
        return launch(argv, par.nproc, par.nnodes, par.node_rank, par.rdzv_endpoint or None, par.max_restarts, plan)
    from snugfit.train.loop import train

    train(cfg)
    return 0
