"""What a run trains on: the model (built-in or Hugging Face, with LoRA or frozen pieces) and its data."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from snugfit.config import RunConfig
from snugfit.data import BatchSampler, ByteTokenizer, eval_batches, load_tokenizer, load_tokens, split
from snugfit.data.chat import load_chat
from snugfit.data.instruct import IGNORE, Examples, InstructSampler, instruct_eval_batches, load_instruct
from snugfit.data.packing import Packed, pack
from snugfit.data.tokenizer import Tokenizer
from snugfit.errors import SnugfitError
from snugfit.model import Decoder
from snugfit.model.decoder import init_name, initial_value, tensor_generator
from snugfit.model.hf import FolderWeights, fingerprint, load_hf
from snugfit.model.config import parse_targets
from snugfit.model.lora import (apply_lora, freeze, init_adapters, plain_name, plain_named_tensors, trainable_by_kind,
                                trainable_summary)
from snugfit.model.shards import local_shard
from snugfit.model.quantize import quantize_base
from snugfit.plan import Plan
from snugfit.profile.types import kinds_text
from snugfit.runtime.apply import Weights

log = logging.getLogger("snugfit")


def model_identity(cfg: RunConfig) -> dict:
    """What a checkpoint must match to be resumed by this run."""
    f = cfg.finetune
    base = {"hf": cfg.model.name} if cfg.model.name else cfg.model.to_dict()
    return {**base, "lora_rank": f.lora_rank, "lora_targets": f.lora_targets, "freeze": f.freeze,
            "quantize_base": f.quantize_base}


def base_record(cfg: RunConfig) -> dict | None:
    """Which Hugging Face base a run trains, for export (train.export): its absolute path, so the export works from
    any directory, and its fingerprint, so a base that changed since is refused. Not part of model_identity: a
    resume keeps comparing what the run was configured with."""
    if not cfg.model.name:
        return None
    path = Path(cfg.model.name).resolve()
    return {"path": str(path), "fingerprint": fingerprint(path)}


def model_weights(cfg: RunConfig) -> Weights | None:
    """What fills the model `build_model(cfg, on_meta=True)` builds once the runtime has placed it: the Hugging
    Face folder's tensors, or the built-in model's seeded init. None for a Hugging Face config.json alone (its
    random init is transformers', on CPU)."""
    if not cfg.model.name:
        return InitWeights(cfg.train.seed)
    folder = Path(cfg.model.name)
    return FolderWeights(folder, cfg.train.seed) if folder.is_dir() else None


@dataclass
class InitWeights:
    """The built-in Decoder's init as what fills it after the runtime has allocated each rank's shards
    (runtime.apply.Weights): each tensor drawn whole from its own generator, this rank's part kept, so every
    plan starts from the same values and no rank holds more than one whole tensor beyond its shards."""

    seed: int

    def fill(self, model: Decoder, device: torch.device) -> None:
        # to_empty gives each plain module its own tensor; FSDP2's keep theirs: tied, or two stages' copies
        if model.cfg.tie_embeddings and model.head is not None and model.embed is not None and not isinstance(
                model.head.weight, DTensor):
            model.head.weight = model.embed.tokens.weight
        model.init_weights(self.seed, self._plain_parameters(model))
        init_adapters(model, self.seed)

    def master(self, model: Decoder, name: str, like: torch.Tensor) -> torch.Tensor | None:
        """The fp32 rows of parameter `name` that `like` holds, drawn again; None for LoRA adapters."""
        plain = plain_name(model, name)
        if plain is None:
            return None
        plain = init_name(model.cfg, plain)
        return local_shard(initial_value(plain, tuple(like.shape), model.cfg.n_layers,
                                         tensor_generator(self.seed, plain)), like)

    @staticmethod
    def _plain_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
        params = {id(p) for p in model.parameters()}
        return {n: t for n, t in plain_named_tensors(model).items() if id(t) in params}


def build_model(cfg: RunConfig, on_meta: bool = False) -> nn.Module:
    """The model, identical on every rank (same seed); adapters, frozen pieces and NF4 base weights applied.

    on_meta: built on the meta device, holding nothing: the runtime fills it (`model_weights`) after it has
    sharded and placed it (`runtime.build.build_engine`). Otherwise on CPU, with the same values. A Hugging Face
    config.json alone is always built on CPU (transformers' random init).
    """
    torch.manual_seed(cfg.train.seed)
    weights = model_weights(cfg)
    meta = weights is not None
    if cfg.model.name:
        model = load_hf(cfg.model.name, device="meta" if meta else "cpu", seed=cfg.train.seed,
                        attention=cfg.model.attention)
        if model.hf_config._attn_implementation != cfg.model.attention:
            log.info("attention: %s (%s has no %s path in transformers)", model.hf_config._attn_implementation,
                     model.hf_class, cfg.model.attention)
        if model.is_moe:
            log.info("experts: %s is a Mixture-of-Experts; the run trains the language-model loss only, as "
                     "transformers' forward computes it by default: the router's load-balancing loss "
                     "(output_router_logits, router_aux_loss_coef) is not added", model.hf_class)
    else:
        with torch.device("meta"):
            model = Decoder(cfg.model)
    f = cfg.finetune
    if f.freeze:
        freeze(model, f.freeze)
    if f.lora_rank:
        apply_lora(model, f.lora_rank, f.lora_alpha or None, parse_targets(f.lora_targets), f.lora_dropout,
                   seed=cfg.train.seed)
    if f.quantize_base == "nf4":
        log.info("quantized %.2fM frozen weights to NF4", quantize_base(model) / 1e6)
    counts = trainable_summary(model)["total"]
    log.info("model %s parameters, %s trainable", count_text(counts["trainable"] + counts["frozen"]),
             count_text(counts["trainable"]))
    log.info("trainable by kind: %s", kinds_text(trainable_by_kind(model)))
    if meta and not on_meta:
        model.to_empty(device="cpu")
        weights.fill(model, torch.device("cpu"))
    return model


def count_text(n: int) -> str:
    """A parameter count in units that show it: '1.94M', '3,584' (not '0.00M')."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n:,}"


def run_tokenizer(cfg: RunConfig) -> Tokenizer:
    """The configured tokenizer; a Hugging Face model folder's own tokenizer.json when left at 'byte'."""
    spec = cfg.data.tokenizer
    if spec == "byte" and cfg.model.name and Path(cfg.model.name).is_dir():
        if (Path(cfg.model.name) / "tokenizer.json").is_file():
            spec = str(Path(cfg.model.name) / "tokenizer.json")
        else:
            log.warning("%s has no tokenizer.json: training with the byte tokenizer (256 tokens), which is not the "
                        "model's; point data.tokenizer at the model's tokenizer.json", cfg.model.name)
    return load_tokenizer(spec)


def chat_folder(cfg: RunConfig) -> Path:
    """Where chat data's template comes from: data.tokenizer when it names a folder, else the model's folder."""
    for spec in (cfg.data.tokenizer, cfg.model.name):
        if spec and Path(spec).is_dir():
            return Path(spec)
    raise SnugfitError("chat data is rendered with a model's chat template: train a local Hugging Face model "
                       "folder (--model.name) or point --data.tokenizer at one")


@dataclass
class RunData:
    """Training and validation data of one kind: a token stream, or instruction examples (N, 2, seq+1), packed ones
    (N, 3, seq+1) with their document ids (data.packing)."""

    train: np.ndarray
    val: np.ndarray
    instruct: bool
    real_share: float = 1.0  # of the training rows' positions, those that are tokens, not padding (tokens/s count them)

    def sampler(self, plan: Plan, seed: int, dp_rank: int) -> BatchSampler | InstructSampler:
        if self.instruct:
            return InstructSampler(self.train, plan.global_batch, seed, dp_rank, plan.dp)
        return BatchSampler(self.train, plan.seq_len, plan.global_batch, seed, dp_rank, plan.dp)

    def eval_batches(self, plan: Plan, count: int, dp_rank: int) -> list[torch.Tensor]:
        """This data-parallel rank's part of a fixed set of validation batches, each of the global batch's size:
        the same held-out examples, so the same loss of the same weights, whatever the ranks or the plan (the
        engine averages the parts over the data-parallel group)."""
        whole = (instruct_eval_batches(self.val, plan.global_batch, count) if self.instruct
                 else eval_batches(self.val, plan.seq_len, plan.global_batch, count))
        per = plan.global_batch // plan.dp
        return [b[dp_rank * per:(dp_rank + 1) * per] for b in whole]


def build_data(cfg: RunConfig, vocab_size: int) -> RunData:
    d, seq = cfg.data, cfg.train.seq_len
    tokenizer = run_tokenizer(cfg)
    if d.format != "bin" and tokenizer.vocab_size > vocab_size:
        raise SnugfitError(
            f"the tokenizer has {tokenizer.vocab_size} tokens, the model's vocabulary only {vocab_size}; "
            "raise model.vocab_size or use the model's own tokenizer"
        )
    if d.format not in ("instruct", "chat"):
        tokens = load_tokens(d.path, d.format, tokenizer, d.text_field, d.bin_dtype)
        splits = split(tokens, seq, d.val_fraction, vocab_size)
        log.info("data: %d tokens from %s (%d held out for validation); tokenizer %s", len(tokens),
                 d.path or "the embedded corpus", len(splits.val), tokenizer.describe())
        return RunData(splits.train, splits.val, instruct=False)
    if not d.path:
        raise SnugfitError(f"data.format {d.format!r} needs data.path: a .jsonl, .parquet or .arrow file with "
                           + ("prompt/response fields" if d.format == "instruct" else "messages"))
    if d.format == "chat":
        folder = chat_folder(cfg)
        examples = load_chat(d.path, folder, seq, d.messages_field)
        tokens_from = f"the tokenizer and chat template of {folder}"
    else:
        # The byte tokenizer has no end-of-sequence token: responses end with byte 0, which text never holds. A
        # vocabulary's own is its folder's (data.tokenizer.HFTokenizer), never guessed
        eos = 0 if isinstance(tokenizer, ByteTokenizer) else None
        examples = load_instruct(d.path, tokenizer, seq, d.prompt_field, d.response_field, eos_id=eos)
        tokens_from = f"tokenizer {tokenizer.describe()}"
    n_val = int(len(examples) * d.val_fraction)
    if len(examples) - n_val < 1:
        raise SnugfitError(f"{d.path} has too few examples to hold out {d.val_fraction:.0%} for validation")
    n = len(examples) - n_val
    train = (pack(examples.rows[:n], examples.lengths[:n], examples.pad_id) if d.packs
             else Packed(examples.rows[:n], n, int(examples.lengths[:n].sum())))
    log.info("data: %s from %s, %d held out for validation; %s; %s", examples.describe(seq), d.path, n_val,
             tokens_from, data_line(examples, train, cfg.train.batch_size))
    # validation stays one example a row: the same held-out examples, and so the same loss, packed or not
    return RunData(train.rows, examples.rows[n:], instruct=True, real_share=1 - train.padding)


def data_line(examples: Examples, train: Packed, batch: int) -> str:
    """What a step trains on: '1,234 tokens in 190 examples packed into 63 sequences (packing ratio 3.02, padding
    4%); about 310 learned tokens a step (of 2,048 positions)'."""
    rows = train.rows
    learned = float((rows[:, 1, 1:] != IGNORE).sum()) / max(len(rows), 1) * batch
    into = (f" packed into {len(rows):,} sequences (packing ratio {train.ratio:.2f}, " if rows.shape[1] == 3
            else ", one a sequence (unpacked, ")
    return (f"{train.tokens:,} tokens in {train.examples:,} training {examples.noun}{into}padding "
            f"{train.padding:.0%}); about {learned:.0f} learned tokens a step (of {batch * (rows.shape[-1] - 1):,} "
            "positions)")
