"""A checkpoint's model as a folder that stands alone: safetensors + config (transformers' layout where there is
one), the tokenizer, chat template and generation config beside them."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

from snugfit.config import RunConfig, config_from_dict
from snugfit.errors import SnugfitError
from snugfit.model.export import save_model
from snugfit.model.hf import COMPANION_FILES, fingerprint
from snugfit.model.hub import local_model, looks_like_hub_id, not_cached
from snugfit.model.lora import merged_state_dict
from snugfit.model.quantize import is_quantized
from snugfit.train.build import build_model
from snugfit.train.checkpoint import root_cause

log = logging.getLogger("snugfit")


def _trainer_meta(path: Path) -> dict:
    meta = path / "trainer.json"
    if not meta.is_file():
        raise SnugfitError(f"{path} is not a snugfit checkpoint (no trainer.json); pass a step_* folder")
    return json.loads(meta.read_text())


def checkpoint_config(path: Path, base: str | None = None) -> RunConfig:
    """The run's config as saved with the checkpoint, its Hugging Face base found: `base` where given (a moved
    folder, or a hub id in the local cache), else where the run recorded it (its absolute path), else the path as
    the run was given it. A base whose files differ from the ones the run trained (train.build.base_record) is
    refused: its tensors would be read as another model's."""
    meta = _trainer_meta(path)
    cfg = config_from_dict(meta["config"])
    if not cfg.model.name:
        if base:
            raise SnugfitError(f"{path} trained the built-in model, which has no base folder; drop --model")
        return cfg
    recorded = meta.get("base") or {}
    folder = Path(local_model(base)) if base else Path(recorded.get("path") or cfg.model.name)
    if not folder.exists():
        if base and looks_like_hub_id(base):
            raise not_cached(base)
        raise SnugfitError(f"the base model {folder} of checkpoint {path} is not there (moved?); pass its folder "
                           "with --model")
    if recorded.get("fingerprint") and fingerprint(folder) != recorded["fingerprint"]:
        raise SnugfitError(f"the base model at {folder} is not the one checkpoint {path} was trained from (its "
                           "config or weight files changed); pass the original folder with --model")
    cfg.model.name = str(folder)
    return cfg


def load_checkpoint_model(path: Path, base: str | None = None, cfg: RunConfig | None = None) -> nn.Module:
    """The run's model rebuilt from the config saved with the checkpoint (`checkpoint_config`, unless given),
    weights read in this one process.

    DCP reshards on load, so this works whatever plan and world size saved it.
    """
    model = build_model(cfg or checkpoint_config(path, base))
    state = {"model": model.state_dict()}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (RuntimeError, ValueError, KeyError, OSError, CheckpointException) as e:
        raise SnugfitError(f"checkpoint {path} cannot be read ({root_cause(e)}); it is corrupt") from e
    model.load_state_dict(state["model"])
    return model


def export_checkpoint(path: Path, out: Path, base: str | None = None, overwrite: bool = False) -> Path:
    """A folder that stands alone: the weights (LoRA adapters merged; Hugging Face models in their own format, the
    built-in one in save_model's), and beside them the tokenizer, chat template and generation config the run
    used. Written into a fresh folder and moved into place, so `out` is never half written; a folder that holds
    files is refused unless `overwrite`."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise SnugfitError(f"{out} already holds files; export into a new or empty folder, or pass --overwrite")
    cfg = checkpoint_config(path, base)
    model = load_checkpoint_model(path, cfg=cfg)
    if any(is_quantized(p) for p in model.parameters()):
        log.info("export: NF4 base weights dequantized to bfloat16, LoRA adapters merged into them")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if hasattr(model, "hf_config"):
            from snugfit.model.hf import save_hf

            save_hf(model, staging)
        else:
            save_model(merged_state_dict(model), model.cfg, staging)
        _companions(cfg, model, staging)
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _companions(cfg: RunConfig, model: nn.Module, folder: Path) -> None:
    """The tokenizer and generation files of the base folder (or of data.tokenizer's), copied as they are; a
    generation config from the model's config where the base has none."""
    for src in (Path(p) for p in (cfg.data.tokenizer, cfg.model.name) if p and p != "byte"):
        files = [src / name for name in COMPANION_FILES] if src.is_dir() else [src] * (src.name == "tokenizer.json")
        for f in files:
            if f.is_file() and not (folder / f.name).exists():
                shutil.copy2(f, folder / f.name)
    if hasattr(model, "hf_config") and not (folder / "generation_config.json").exists():
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(model.hf_config).save_pretrained(str(folder))
