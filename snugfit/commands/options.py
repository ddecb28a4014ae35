"""One option set for `snugfit train` and `snugfit plan`: every field of the run config (snugfit/config.py).

Each key is `--section.key` on both commands, and `--key` where that name is unique across sections; the
plan command's own spellings are aliases of the same keys. Adding a field to a config dataclass is the
only step needed to give both commands its option.
"""

from __future__ import annotations

import argparse

from snugfit.config import RunConfig, all_keys, build_config, load_toml

# Spellings `snugfit plan` had before it read the run config, kept as aliases of the keys.
ALIASES = {
    "model.name": ["--model"],  # a catalogue name, a Hugging Face folder or hub id (local cache), a config.json
    "train.seq_len": ["--seq"],
    "train.batch_size": ["--global-batch"],
    "train.micro_batch_size": ["--micro-batch"],
    "parallel.plan": ["--plan-file"],
}


def _flag(key: str) -> str:
    return "--" + key.split(".", 1)[1].replace("_", "-")


def add_config_options(p: argparse.ArgumentParser) -> None:
    """--config FILE and one option per config key (dest 'section.key', absent unless given)."""
    keys, defaults = all_keys(), RunConfig()
    short_names = [k.split(".", 1)[1] for k in keys]
    p.add_argument("--config", metavar="FILE", help="TOML file with [model] [data] [train] [finetune] [parallel] "
                                                   "sections; --key value options override it")
    group = p.add_argument_group("run config (every key is also --section.key)")
    for key, (section, tp) in keys.items():
        names = [*ALIASES.get(key, []), f"--{key}"]
        if short_names.count(key.split(".", 1)[1]) == 1 and key != "model.name":
            names.insert(len(ALIASES.get(key, [])), _flag(key))
        default = getattr(getattr(defaults, section), key.split(".", 1)[1])
        kwargs = {"dest": key, "metavar": "V", "default": argparse.SUPPRESS, "help": f"[{section}] default: {default!r}"}
        if tp is bool or tp == bool | None:
            kwargs.update(nargs="?", const="true")
        group.add_argument(*names, **kwargs)


def config_from_args(args: argparse.Namespace) -> tuple[RunConfig, set[str]]:
    """The run config the options describe, and the keys the user set (in --config or on the command line)."""
    overrides = {k: v for k, v in vars(args).items() if "." in k}
    cfg = build_config(args.config, overrides)
    given = set(overrides) | (set(load_toml(args.config)) if args.config else set())
    return cfg, given
