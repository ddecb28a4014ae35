"""`snugfit train`: train under a plan, locally or on N ranks through torchrun's launcher."""

from __future__ import annotations

import argparse
import os
import sys

from snugfit.config import RunConfig, all_keys, build_config


def _flag(key: str) -> str:
    return "--" + key.split(".", 1)[1].replace("_", "-")


def add_parser(sub) -> argparse.ArgumentParser:
    keys, defaults = all_keys(), RunConfig()
    short_names = [k.split(".", 1)[1] for k in keys]
    p = sub.add_parser(
        "train",
        help="train a model (defaults: a small model on the embedded corpus)",
        description="Train a model. Settings come from defaults, then --config FILE (TOML with sections "
        "[model] [data] [train] [parallel]), then --key value overrides. Every key is --section.key; "
        "keys unique across sections also take the short form shown.",
    )
    p.add_argument("--config", metavar="FILE", help="TOML file with [model] [data] [train] [parallel] sections")
    for key, (section, tp) in keys.items():
        names = [f"--{key}"]
        if key == "model.name":
            names.insert(0, "--model")  # `snugfit train --model path/to/hf_folder`
        elif short_names.count(key.split(".", 1)[1]) == 1:
            names.insert(0, _flag(key))
        default = getattr(getattr(defaults, section), key.split(".", 1)[1])
        kwargs = {"dest": key, "metavar": "V", "default": argparse.SUPPRESS, "help": f"[{section}] default: {default!r}"}
        if tp is bool:
            kwargs.update(nargs="?", const="true")
        p.add_argument(*names, **kwargs)
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
    overrides = {k: v for k, v in vars(args).items() if "." in k}
    cfg = build_config(args.config, overrides)
    par = cfg.parallel
    if "RANK" not in os.environ and (par.nproc > 1 or par.nnodes > 1 or par.max_restarts > 0):
        from snugfit.runtime.launch import launch

        # The ranks re-read the same command line, less the launch options (torchrun's own parser would
        # take them for its own); inside torchrun's environment they train instead of launching.
        argv = _without_launch_options(sys.argv[1:])
        if par.plan == "auto" and par.nnodes == 1:  # the ranks' planner needs this machine measured
            import torch

            from snugfit.train.autoplan import measure_once

            measure_once(par.nproc, on_cpu=not torch.accelerator.is_available())
        return launch(argv, par.nproc, par.nnodes, par.node_rank, par.rdzv_endpoint or None, par.max_restarts)
    from snugfit.train.loop import train

    train(cfg)
    return 0
