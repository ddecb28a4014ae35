"""`snugfit export`: a checkpoint as safetensors + config (Hugging Face layout where the architecture has a twin)."""

from __future__ import annotations

import argparse
from pathlib import Path

from snugfit.errors import SnugfitError


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("export", help="write a checkpoint's model as a folder that transformers loads",
                       description="Write the model of a checkpoint (any plan, any world size) into a new folder: "
                       "a Hugging Face model's config.json + model.safetensors (LoRA adapters merged) with the base "
                       "folder's tokenizer, chat template and generation config beside them; for the built-in model, "
                       "model.safetensors + snugfit.json, and for llama or tied gpt2 shapes a config.json that "
                       "transformers loads.")
    p.add_argument("checkpoint", help="a run folder (its newest checkpoint is used) or a step_* checkpoint folder")
    p.add_argument("--out", help="output folder, new or empty (default: <run>/model)")
    p.add_argument("--model", help="the base model's folder (or hub id in the local cache) where it moved since "
                   "training; it must hold the same files")
    p.add_argument("--overwrite", action="store_true", help="replace what the output folder holds")
    return p


def run(args: argparse.Namespace) -> int:
    from snugfit.runtime.dist import DistEnv
    from snugfit.train.checkpoint import Checkpoints
    from snugfit.train.export import export_checkpoint

    path = Path(args.checkpoint)
    if (path / "checkpoints").is_dir():
        latest = Checkpoints(path / "checkpoints", 1, DistEnv()).latest()
        if latest is None:
            raise SnugfitError(f"run folder {path} has no committed checkpoint; train first or pass a step_* folder")
        run_dir, path = Path(args.checkpoint), latest
    elif path.is_dir():
        run_dir = path.parent.parent
    else:
        raise SnugfitError(f"{path} is not a folder; pass a run folder or a step_* checkpoint folder")
    out = export_checkpoint(path, Path(args.out) if args.out else run_dir / "model", args.model, args.overwrite)
    print(f"exported {path} -> {out}")
    return 0
