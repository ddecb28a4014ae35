"""profile_model: a model's profile, from the cache when its inputs were profiled before, else built (profile.py).

The lookup needs no torch: a hit returns plain data (types.py), so that planning a profiled model imports neither
torch nor the model code (3 of the 11 s a cached `snugfit plan` of Llama-2-70B took went to those imports). torch is
imported only on a miss, to build the profile. The cache key holds every input the profile depends on, torch's
version among them (read from its installed metadata, the version torch reports, without importing it).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path

from snugfit.model.config import ModelConfig, parse_targets
from snugfit.profile.types import PROFILE_VERSION, ModelProfile


def cache_path(cache_dir: str | Path | None, key: dict) -> Path:
    """Where the profile of these inputs is kept: cache_dir, else $XDG_CACHE_HOME/snugfit (~/.cache/snugfit)."""
    root = Path(cache_dir) if cache_dir else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "snugfit"
    digest = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return root / "profiles" / f"{digest}.json"


def profile_model(
    model: ModelConfig | dict, *, micro_batch_size: int, seq_len: int, dtype: str = "float32",
    name: str | None = None, cache_dir: str | Path | None = None, use_cache: bool = True,
    measure_on: str | None = None, repeats: int = 3, clock: Callable[[], float] = time.perf_counter,
    lora_rank: int | None = None, frozen: str | None = None, quantize_base: str = "none", kernels: str = "cpu",
    lora_targets: str = "", compile: bool = False, pack: bool = False,
) -> ModelProfile:
    """Profile a built-in ModelConfig or a Hugging Face config dict (cached by its inputs).

    pack: the run packs its examples (data.packing): the built-in decoder's documents' mask is charged
    (ModelProfile.mask_bytes) as the target device holds it, the kernels' (`flex_trains_on`): a FlexAttention
    block mask on GPUs, dense seq x seq on CPU ranks, where the blocks are recorded attending under it. Hugging
    Face layers make their own mask each (transformers' mask functions), recorded as theirs.

    compile: its blocks as torch.compile runs them (Plan.compile; profile.compiled), traced beside the eager
    profile (cached on its own: `snugfit plan` weighs both); measured times are eager's, so a compiled profile is
    not measured (measure_on is refused).

    lora_rank / lora_targets / frozen: profile the model fine-tuned as the runtime will (model.lora):
    frozen parameters have no gradients or optimizer states, and their weight-gradient
    matmuls are absent from the recorded backward. quantize_base="nf4": the frozen block
    linears are stored in 4 bits (`PieceProfile.quantized`) and dequantized for each use.

    kernels="gpu": saved tensors as GPU kernels keep them where they differ from the CPU path
    (profile.kernels: fused RMSNorm); plan GPU clusters with it, CPU ranks with "cpu".

    measure_on="cpu" also times each piece's forward and backward on this machine
    with real (random) weights: only for models that fit in host memory. `clock` is
    what times it (time.process_time on a single-threaded CPU run ignores other load).
    """
    if compile and measure_on:
        raise ValueError("a compiled profile is not measured: its times come from the time model")
    config = dict(model) if isinstance(model, dict) else model.to_dict()
    key = {"config": config, "mbs": micro_batch_size, "seq": seq_len, "dtype": dtype,
           "measure": measure_on, "v": PROFILE_VERSION, "torch": version("torch"), "lora": lora_rank,
           "lora_targets": parse_targets(lora_targets) if lora_rank else None,
           "frozen": frozen, "quantize": quantize_base, "kernels": kernels, "compile": compile,
           **({"pack": True} if pack else {})}  # unpacked profiles keep their cached keys
    path = cache_path(cache_dir, key)
    label = name or config.get("_name_or_path") or config.get("model_type") or config.get("arch", "model")
    if use_cache and path.exists():
        return replace(ModelProfile.load(path), model=label)  # models of one config share it; the name is ours
    tune = dict(lora_rank=lora_rank, frozen=frozen, quantize_base=quantize_base, kernels=kernels,
                lora_targets=lora_targets, pack=pack)
    eager = profile_model(model, micro_batch_size=micro_batch_size, seq_len=seq_len, dtype=dtype, name=name,
                          cache_dir=cache_dir, use_cache=use_cache, **tune) if compile else None
    from snugfit.profile.profile import build_profile

    prof = build_profile(model, micro_batch_size=micro_batch_size, seq_len=seq_len, dtype=dtype, label=label,
                         eager=eager, measure_on=measure_on, repeats=repeats, clock=clock, **tune)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.save(path)
    return prof
