"""A checkpoint's model as files: safetensors + config, in transformers' layout where there is one."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

from snugfit.config import config_from_dict
from snugfit.errors import SnugfitError
from snugfit.model.export import save_model
from snugfit.model.lora import merged_state_dict
from snugfit.model.quantize import is_quantized
from snugfit.train.build import build_model
from snugfit.train.checkpoint import root_cause

log = logging.getLogger("snugfit")


def load_checkpoint_model(path: Path) -> nn.Module:
    """The run's model rebuilt from the config saved with the checkpoint, weights read in this one process.

    DCP reshards on load, so this works whatever plan and world size saved it.
    """
    meta = path / "trainer.json"
    if not meta.is_file():
        raise SnugfitError(f"{path} is not a snugfit checkpoint (no trainer.json); pass a step_* folder")
    model = build_model(config_from_dict(json.loads(meta.read_text())["config"]))
    state = {"model": model.state_dict()}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (RuntimeError, ValueError, KeyError, OSError, CheckpointException) as e:
        raise SnugfitError(f"checkpoint {path} cannot be read ({root_cause(e)}); it is corrupt") from e
    model.load_state_dict(state["model"])
    return model


def export_checkpoint(path: Path, out: Path) -> Path:
    """LoRA adapters merged; Hugging Face models back to their own format, the built-in one to save_model's."""
    model = load_checkpoint_model(path)
    if any(is_quantized(p) for p in model.parameters()):
        log.info("export: NF4 base weights dequantized to bfloat16, LoRA adapters merged into them")
    if hasattr(model, "hf_config"):
        from snugfit.model.hf import save_hf

        return save_hf(model, out)
    return save_model(merged_state_dict(model), model.cfg, out)
