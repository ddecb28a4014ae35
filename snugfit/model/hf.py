"""Hugging Face model folders: build an `HFCausalLM` (model.hf_model) from a config or a folder, read its
weights, write it back as transformers loads it.

Loading never materialises the whole model first: the model is built on the
meta device, pruned to the blocks (and pieces) asked for, then filled tensor
by tensor from the safetensors files. Nothing is ever downloaded.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from snugfit.errors import SnugfitError
from snugfit.model.hf_layout import Source, as_transformers_saves, checkpoint_layout, read_region, stored_shape
from snugfit.model.hf_model import HFCausalLM
from snugfit.model.hub import looks_like_hub_id, not_cached
from snugfit.model.lora import init_adapters, merged_state_dict, plain_name, plain_named_tensors
from snugfit.model.quantize import is_quantized
from snugfit.model.shards import local_region, write_whole
from snugfit.quiet import quiet_imports

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


# What a model folder holds beside its weights that a user of the exported model needs: the tokenizer in every
# format transformers reads, its chat template and the generation config
COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


def fingerprint(path: str | Path) -> str:
    """A hash of what makes a base model that model: its config.json and its weight files' names, sizes and
    safetensors headers (tensor names, shapes, dtypes, offsets; read without the tensors). A checkpoint records
    it, so an export onto a base whose files changed is refused rather than written as another architecture."""
    p = Path(path)
    h = hashlib.sha256((p / "config.json" if p.is_dir() else p).read_bytes())
    for f in sorted(p.glob("*.safetensors")) if p.is_dir() else []:
        with f.open("rb") as fh:
            head = fh.read(8)
            header = fh.read(int.from_bytes(head, "little")) if len(head) == 8 else b""
        h.update(f"{f.name}:{f.stat().st_size}:".encode() + header)
    return h.hexdigest()[:16]


def _weight_index(folder: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (sharded with an index, or one file)."""
    index = folder / INDEX_FILE
    if index.is_file():
        return {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    single = folder / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {k: single for k in f.keys()}
    hint = " (pytorch_model.bin is not read: snugfit never unpickles; convert it to safetensors)" if any(
        folder.glob("*.bin")) else ""
    raise SnugfitError(f"{folder} has no {SINGLE_FILE} or {INDEX_FILE}{hint}")


def _transformers():
    """transformers, with its model classes' module imported quietly: it imports torchao where installed (quiet)."""
    with quiet_imports():
        import transformers
        import transformers.modeling_utils  # noqa: F401
    return transformers


def _hf_config(config_file: Path, attention: str = "sdpa"):
    AutoConfig = _transformers().AutoConfig  # noqa: N806

    try:
        cfg = AutoConfig.from_pretrained(str(config_file))
    except (OSError, ValueError, KeyError) as e:
        raise SnugfitError(f"cannot read Hugging Face config {config_file}: {e}") from e
    cfg._attn_implementation = attention_for(cfg, attention)
    return cfg


def attention_for(hf_cfg, requested: str = "sdpa") -> str:
    """The attention implementation a model runs: the one requested (model.attention: sdpa, or eager, which
    materialises the scores), where its transformers class implements it; eager where it does not (Gemma 2's
    attention soft-capping has no SDPA path, and transformers refuses sdpa for it)."""
    AutoModelForCausalLM = _transformers().AutoModelForCausalLM  # noqa: N806
    try:
        cls = AutoModelForCausalLM._model_mapping[type(hf_cfg)]
    except KeyError:
        return requested
    return "eager" if requested == "sdpa" and not getattr(cls, "_supports_sdpa", True) else requested


def _resolve(path: str | Path) -> tuple[Path, Path | None]:
    """(config.json, weights folder or None for a random init from the config alone)."""
    p = Path(path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise SnugfitError(f"{p} has no config.json; pass a Hugging Face model folder")
        return p / "config.json", p
    if p.is_file() and p.suffix == ".json":
        return p, None
    if looks_like_hub_id(str(path)):
        raise not_cached(str(path))
    raise SnugfitError(f"{path} is not a local folder or config.json; snugfit downloads nothing: "
                       "download the model yourself (config.json + *.safetensors) and pass its folder")


def hf_from_config(config: dict, device: str | torch.device = "meta") -> HFCausalLM:
    """An HFCausalLM from a config.json dict (what the planner and profiler are given); on meta: no memory. Its
    "attn_implementation" key (transformers' own spelling) asks for eager attention."""
    transformers = _transformers()
    AutoConfig, AutoModelForCausalLM = transformers.AutoConfig, transformers.AutoModelForCausalLM  # noqa: N806

    cfg = dict(config)
    model_type = cfg.pop("model_type", None)
    if model_type is None:
        raise SnugfitError("HF config has no model_type; pass a config.json from a Hugging Face model")
    requested = cfg.pop("attn_implementation", None) or "sdpa"
    hf_cfg = AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if not k.startswith("_")})
    hf_cfg._attn_implementation = attention_for(hf_cfg, requested)
    with torch.device(device):
        return HFCausalLM(AutoModelForCausalLM.from_config(hf_cfg))


def load_hf(path: str | Path, blocks: set[int] | None = None, device: str | torch.device = "cpu", *,
            embed: bool = True, head: bool = True, dtype: torch.dtype = torch.float32, seed: int = 0,
            attention: str = "sdpa") -> HFCausalLM:
    """An HFCausalLM from a local HF folder (weights read tensor by tensor) or a config.json (random init).

    blocks / embed / head: load only those pieces (a pipeline stage's or a
    rank's part); the others are never allocated nor read. Parameters are held
    in `dtype` (fp32 master weights by default, whatever the files hold).
    device="meta": no memory, nothing read (planning; or shard it with FSDP2,
    then `materialize(model, device, folder)` reads each rank's rows only).
    """
    AutoModelForCausalLM = _transformers().AutoModelForCausalLM  # noqa: N806
    config_file, folder = _resolve(path)
    cfg = _hf_config(config_file, attention)
    if folder is None and str(device) != "meta":
        torch.manual_seed(seed)
        with torch.device(device):
            model = HFCausalLM(AutoModelForCausalLM.from_config(cfg, dtype=dtype))
        model.prune(blocks, embed, head)
        return model
    index = _weight_index(folder) if folder is not None else None  # fail before building anything
    with torch.device("meta"):
        model = HFCausalLM(AutoModelForCausalLM.from_config(cfg, dtype=dtype))
    model.prune(blocks, embed, head)
    if str(device) != "meta":
        materialize(model, device, folder, index)
    return model


def materialize(model: HFCausalLM, device: str | torch.device, folder: str | Path,
                index: dict[str, Path] | None = None, seed: int = 0) -> list[str]:
    """Allocate a meta-device model (possibly FSDP2-sharded) on `device` and fill it from `folder`; returns the
    names of the tensors read."""
    model.to_empty(device=device)
    return FolderWeights(Path(folder), seed).fill(model, torch.device(device), index)


@dataclass
class FolderWeights:
    """A Hugging Face folder as what fills a model built on the meta device, once the runtime has allocated
    each rank's shards (runtime.apply.Weights): every rank reads only its own rows.

    The rotary embedding's inverse frequencies are derived from the config, not
    stored, so they are recomputed; a tied head shares the embedding again; LoRA
    adapters, which no checkpoint holds, are drawn from `seed` as `apply_lora` draws them.
    """

    folder: Path
    seed: int = 0
    _layout: dict[str, Source] | None = field(default=None, repr=False)

    def fill(self, model: HFCausalLM, device: torch.device, index: dict[str, Path] | None = None) -> list[str]:
        init_adapters(model, self.seed)
        if model.cfg.tie_embeddings and model.embed is not None and model.head is not None:
            out = model.get_submodule(model.head_weight.rpartition(".")[0])
            # to_empty gives each plain module its own tensor; FSDP2's keep theirs: tied, or two stages' copies
            if out.weight is not model.embed.tokens.weight and not isinstance(out.weight, DTensor):
                out.weight = model.embed.tokens.weight
        if model.rope is not None:
            with torch.device(device):
                model.rope = type(model.rope)(config=model.hf_config)
        model.reset_derived_buffers()
        if index is not None:
            return load_weights(model, self.folder, index)
        return load_weights(model, self.folder, self.index, self.layout(model))

    def master(self, model: HFCausalLM, name: str, like: torch.Tensor) -> torch.Tensor | None:
        """The rows of parameter `name` that `like` holds, in fp32 on CPU, read from the files (host offload's
        master weights, exact whatever the device copy's dtype); None for a tensor no file holds (adapters)."""
        hf = model.hf_names.get(plain_name(model, name))
        layout = self.layout(model)
        stored = _stored_name(hf, layout, model.base_prefix) if hf is not None else None
        if stored is None:
            return None
        with _Files(self.index) as files:
            return read_region(layout[stored], local_region(like), files.get_slice, like.shape).to(torch.float32)

    @functools.cached_property
    def index(self) -> dict[str, Path]:
        return _weight_index(self.folder)

    def layout(self, model: HFCausalLM) -> dict[str, Source]:
        if self._layout is None:
            self._layout = checkpoint_layout(self.index, model.hf_class, model.hf_config.model_type)
        return self._layout


class _Files:
    """The safetensors files of a checkpoint, each opened once on first use and kept open while reading; a stored
    tensor's slice handle is made once (its shape is checked, then its rows read)."""

    def __init__(self, index: dict[str, Path]):
        self.index, self.open, self.slices = index, {}, {}

    def __enter__(self) -> "_Files":
        return self

    def __exit__(self, *exc) -> None:
        for f in self.open.values():
            f.__exit__(None, None, None)

    def get_slice(self, name: str):
        if name not in self.slices:
            file = self.index[name]
            if file not in self.open:
                self.open[file] = safe_open(str(file), framework="pt").__enter__()
            self.slices[name] = self.open[file].get_slice(name)
        return self.slices[name]


def _stored_name(hf_name: str, index: dict, prefix: str) -> str | None:
    """The key of `index` (a checkpoint layout) for `hf_name`: older checkpoints (e.g. the original gpt2) store names
    without the base-model prefix."""
    if hf_name in index:
        return hf_name
    bare = hf_name.removeprefix(prefix + ".")
    return bare if bare in index else None


@torch.no_grad()
def load_weights(model: HFCausalLM, folder: str | Path, index: dict[str, Path] | None = None,
                 layout: dict[str, Source] | None = None) -> list[str]:
    """Copy the stored tensors into the model's own (present) parameters; returns the names read.

    Tensors are read one by one (an MoE layer's experts from one stored matrix per expert where the checkpoint
    holds them so: model.hf_layout), so at most one tensor beyond the model is ever held. Parameters already
    sharded by FSDP2 (a model built on the meta device, sharded, then `to_empty`) read only their local rows.
    """
    folder = Path(folder)
    index = index if index is not None else _weight_index(folder)
    layout = layout if layout is not None else checkpoint_layout(index, model.hf_class, model.hf_config.model_type)
    targets = plain_named_tensors(model)  # LoRA-wrapped layers load their base weights
    wanted: list[tuple[str, str]] = []
    missing = []
    for ours, hf in model.hf_names.items():
        if ours not in targets:  # the tied head: the same tensor as the embedding, already listed
            continue
        tied_head = model.cfg.tie_embeddings and ours == model.head_weight
        stored = _stored_name(hf, layout, model.base_prefix)
        if stored is None and tied_head:  # a stage with the head but not the embedding
            stored = _stored_name(model.tokens_hf_name, layout, model.base_prefix)
        if stored is None:
            missing.append(hf)
            continue
        wanted.append((ours, stored))
    if missing:
        raise SnugfitError(f"{folder} lacks {len(missing)} weights of this model, e.g. {missing[0]}; "
                           "is config.json from the same model?")
    read = []
    first = {k: (v if isinstance(v, str) else v.names()[0]) for k, v in layout.items()}
    with _Files(index) as files:
        for ours, stored in sorted(wanted, key=lambda w: (str(index[first[w[1]]]), w[0])):  # file by file
            _read_into(layout[stored], stored, targets[ours], files.get_slice)
            read += [layout[stored]] if isinstance(layout[stored], str) else layout[stored].names()
    log.info("loaded %d tensors from %s", len(read), folder)
    return read


def _read_into(source: Source, name: str, target: torch.Tensor, get_slice) -> None:
    """Copy one model tensor (stored whole, or per expert) into `target`; a sharded (FSDP2 DTensor) target reads
    only its own rows."""
    shape = stored_shape(source, get_slice)
    if shape != tuple(target.shape):
        raise SnugfitError(f"the checkpoint's {name} has shape {shape}, the config says "
                           f"{tuple(target.shape)}; is config.json from the same model?")
    if is_quantized(target):  # NF4 quantizes whole tensors (its scales' mean is per tensor), then shards
        write_whole(target, read_region(source, tuple(slice(0, n) for n in shape), get_slice, shape))
    elif isinstance(target, DTensor):
        target.to_local().copy_(read_region(source, local_region(target), get_slice, shape))
    else:
        target.copy_(read_region(source, local_region(target), get_slice, shape))


def save_hf(model: nn.Module, folder: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write config.json + model.safetensors that transformers' from_pretrained loads as-is, in the layout its
    save_pretrained writes (MoE experts one matrix each: model.hf_layout).

    LoRA adapters are merged into the base weights (W + alpha/rank * B A), so
    the folder is a plain HF model. `state_dict`: full tensors under the
    model's names (e.g. gathered from a sharded engine); default: the model's own.
    """
    if not isinstance(model, HFCausalLM):
        raise SnugfitError("save_hf needs an HFCausalLM; export the built-in Decoder with `snugfit export`")
    sd = merged_state_dict(model, state_dict)
    out = {}
    for ours, hf in model.hf_names.items():
        if model.cfg.tie_embeddings and ours == model.head_weight:
            continue  # tied: stored once, under the embedding's name
        if ours not in sd:
            raise SnugfitError(f"cannot save: {ours} is not in the state dict (a pruned model or partial state)")
        out[hf] = sd[ours].detach().to("cpu").contiguous()
    out = as_transformers_saves(out, model.hf_config, model.hf_class)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(out, str(folder / SINGLE_FILE), metadata={"format": "pt"})
    model.hf_config.architectures = [model.hf_class]
    model.hf_config.dtype = next(iter(out.values())).dtype  # transformers loads in the config's dtype
    model.hf_config.save_pretrained(str(folder))
    return folder
