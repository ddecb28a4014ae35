"""Model profiles: what each piece of a model costs for one microbatch, before anything runs.

A profile is plain data (JSON, cached) so that plan/ can use it without torch.
It is built by running one fake training step (see record.py) for a given
micro_batch_size, seq_len and dtype; memory and FLOPs scale linearly in the
micro-batch size, so plan/ rescales a profile to other micro-batch sizes.

Saved-activation policies (bytes a block keeps between its forward and backward):
- keep:      everything autograd saves.
- recompute: only the block input (full activation checkpointing).
- selective: the block input plus the outputs of model.recompute.SAVED_OPS (matmuls and
             fused attention); norms, activations, rotary, softmax and masking are
             recomputed.
- selective_half: as selective, but of the linear layers' outputs only every second one.
- offload:   what "keep" saves, but moved to host memory (plan/ decides the window).
"""

from __future__ import annotations

import logging
import statistics
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import torch
import torch.nn as nn

from snugfit.model.decoder import Decoder, Documents, ModelConfig, flex_trains_on
from snugfit.model.moe import set_balanced
from snugfit.model.config import parse_targets
from snugfit.model.lora import apply_lora, freeze, trainable_by_kind
from snugfit.model.recompute import RECOMPUTE_POLICIES, recompute
from snugfit.model.tiled_mlp import mlp_of
from snugfit.profile.alike import stand_ins
from snugfit.profile.compiled import GraphCost, compiled_costs
from snugfit.profile.grouped import AnyDtypeGroupedMM
from snugfit.plan.policies import PROFILED
from snugfit.profile.kernels import gpu_kernels
from snugfit.profile.record import ModelParts, PieceRecord, record_step
from snugfit.profile.types import (
    DTYPE_BYTES, NF4_LINEAR_BYTES, NF4_LINEAR_OPS, ModelProfile, PieceProfile, nf4_bytes,
)

log = logging.getLogger(__name__)


# -- building --

def model_parts(model: nn.Module) -> ModelParts:
    """Pieces of a Decoder or an HFCausalLM (the same embed / blocks / norm / head structure)."""
    return ModelParts([model.embed], list(model.blocks.values()), [model.norm, model.head], lambda t, y: model(t, y))


def retie(model: nn.Module) -> None:
    """Restore the weight embedding and head share (fake materialisation unties them)."""
    if model.cfg.tie_embeddings:
        head = model.get_submodule(getattr(model, "head_weight", "head.weight").rpartition(".")[0])
        head.weight = model.embed.tokens.weight


def fine_tune(model: nn.Module, lora_rank: int | None, frozen: str | None, lora_targets: str = "") -> None:
    """LoRA adapters and frozen pieces, as the runtime applies them, so the profile counts trainable parameters."""
    if lora_rank:
        apply_lora(model, lora_rank, targets=parse_targets(lora_targets))
    if frozen:
        freeze(model, frozen)


def _params_by_dtype(modules: list[nn.Module], seen: set[int]) -> tuple[dict[str, int], int, int, list[int]]:
    """(dtype -> element count, trainable elements, elements of 1-D parameters, elements of each trainable matrix) of
    parameters not yet in `seen`."""
    out: dict[str, int] = {}
    trainable = vectors = 0
    matrices = []
    for m in modules:
        for p in m.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            key = str(p.dtype).removeprefix("torch.")
            out[key] = out.get(key, 0) + p.numel()
            trainable += p.numel() if p.requires_grad else 0
            vectors += p.numel() if p.dim() < 2 else 0
            if p.requires_grad and p.dim() >= 2:
                matrices.append(p.numel())
    return out, trainable, vectors, matrices


def mlp_share(rec: PieceRecord, grads: int) -> dict[str, float]:
    """A block's MLP within its recorded peaks (PieceProfile.mlp_share); grads: bytes of its trainable parameters'
    gradients. Empty where no MLP was recorded in both passes."""
    f, b = rec.fwd.mlp, rec.bwd.mlp
    if "out" not in f or "peak" not in b:
        return {}
    in_grad = rec.input_bytes  # the MLP's input has the block input's shape and dtype
    return {"fwd_before": f["before"], "fwd_at": f["at"], "out": f["out"],
            "fwd_inner": max(0.0, f["peak"] - f["at"] - f["out"]), "fwd_after": f.get("after", 0.0),
            "saved": f.get("saved", 0.0), "input_kept": f["input_kept"], "flops": f["flops"],
            "mem_bytes": f["mem_bytes"], "ops": f["ops"], "bwd_ops": b["ops"], "bwd_before": b["before"],
            "bwd_at": b["at"], "in_grad": in_grad, "grads": grads,
            "bwd_inner": max(0.0, b["peak"] - b["at"] - in_grad - grads), "bwd_after": b.get("after", 0.0)}


def _mlp_grad_bytes(block: nn.Module, itemsize: int) -> int:
    found = mlp_of(block)
    return sum(p.numel() for p in getattr(*found).parameters() if p.requires_grad) * itemsize if found else 0


def _piece(name: str, rec: PieceRecord, params: tuple[dict[str, int], int, int, list[int]],
           is_block: bool, mlp_grads: int = 0) -> PieceProfile:
    keep = rec.saved
    saved = {"keep": keep}
    if is_block:
        saved["recompute"] = rec.input_bytes
        saved.update({policy: min(keep, rec.input_bytes + extra) for policy, extra in rec.selective_extra.items()})
    return PieceProfile(
        name=name, params=params[0], trainable=params[1], vectors=params[2], matrices=params[3],
        input_bytes=rec.input_bytes,
        output_bytes=rec.output_bytes,
        saved_bytes=saved,
        fwd_peak_bytes=rec.fwd.peak_delta, bwd_peak_bytes=rec.bwd.peak_delta, fwd_flops=rec.fwd.flops,
        bwd_flops=rec.bwd.flops, fwd_mem_bytes=rec.fwd.mem_bytes, bwd_mem_bytes=rec.bwd.mem_bytes,
        fwd_fresh_bytes=rec.fwd.fresh_bytes, bwd_fresh_bytes=rec.bwd.fresh_bytes,
        fwd_ops=rec.fwd.ops, bwd_ops=rec.bwd.ops, gemms=[list(g) for g in rec.fwd.gemms], head_dim=rec.head_dim,
        expert_gemms=list(rec.fwd.expert_gemms),
        mlp_share=mlp_share(rec, mlp_grads) if is_block else {},
    )


def _compiled(piece: PieceProfile, fwd: GraphCost, bwd: GraphCost) -> PieceProfile:
    """A block's profile as torch.compile runs it (profile.compiled): what the partitioner keeps, the fused
    kernels' traffic and launches. Recomputing policies keep what eager keeps, so no more than compiled "keep"."""
    keep = max(fwd.saved_bytes, piece.input_bytes)
    saved = {k: keep if k == "keep" else min(keep, v) for k, v in piece.saved_bytes.items()}
    return replace(piece, saved_bytes=saved, fwd_mem_bytes=fwd.mem_bytes, bwd_mem_bytes=bwd.mem_bytes,
                   fwd_fresh_bytes=fwd.fresh_bytes, bwd_fresh_bytes=bwd.fresh_bytes,
                   fwd_ops=fwd.launches, bwd_ops=bwd.launches, compiled=True)


@contextmanager
def _faked(model: nn.Module, parts: ModelParts) -> Iterator[ModelParts]:
    """The model on fake tensors, running only the blocks that stand for the others (alike.stand_ins):
    the parts it then runs (the others stay on the meta device, unrecorded)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    kept = sorted(set(stand_ins(parts.embed, parts.blocks)))
    every = model.blocks
    model.blocks = nn.ModuleDict({name: every[name] for name in [list(every)[i] for i in kept]})
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            retie(model)
            yield replace(parts, blocks=[parts.blocks[i] for i in kept])
    finally:
        model.blocks = every


def _by_block(parts: ModelParts, per_kept: list) -> list:
    """What was found for each block that stands for others (in order), given to every block it stands for."""
    stand_in = stand_ins(parts.embed, parts.blocks)
    kept = sorted(set(stand_in))
    return [per_kept[kept.index(j)] for j in stand_in]


def packed_documents(seq_len: int, dtype: str, flex: bool | None) -> Callable[[int], Documents]:
    """A packed microbatch's documents of `rows` rows, on fake tensors (only shapes count): for the built-in
    decoder (`flex` given) with their mask made as the target device makes it (`Documents.flex`), the one its blocks
    share; for Hugging Face layers (None) without, as each layer makes its own (recorded as the layer's)."""
    def make(rows: int) -> Documents:
        docs = Documents(torch.ones(rows, seq_len, dtype=torch.long), flex)
        if flex is not None:
            docs.mask(getattr(torch, dtype))
        return docs
    return make


def _recorded(model: nn.Module, parts: ModelParts, tokens: torch.Tensor, docs: Documents | None
              ) -> dict[str, PieceRecord]:
    """One fake step; with packed documents, the blocks attend under their masks, a shared one's bytes the
    profile's mask_bytes, not the blocks'. A block mask's FlexAttention has no backward on CPU to record: the
    causal flash path stands in for it (both hold O(seq), not the scores)."""
    if docs is None or docs.flex:
        return record_step(model, parts, tokens)
    return record_step(model, replace(parts, loss=lambda t, y: model(t, y, docs)), tokens, tuple(docs.held()))


def profile_module(
    model: nn.Module, parts: ModelParts, *, name: str, config: dict, micro_batch_size: int, seq_len: int,
    dtype: str, vocab_size: int, documents: Callable[[int], Documents] | None = None,
) -> ModelProfile:
    """Profile a model built on the meta device: counts its (trainable) parameters, then records one fake step of
    one block of each kind (alike.stand_ins), each block profiled as the one that stands for it. documents: the
    examples are packed, a microbatch's documents of so many rows (`packed_documents`)."""
    model.to(getattr(torch, dtype))
    seen: set[int] = set()
    embed_ids = {id(p) for m in parts.embed for p in m.parameters()}
    tied = sum(p.numel() for m in parts.last for p in m.parameters() if id(p) in embed_ids)
    embed_p = _params_by_dtype(parts.embed, seen)
    block_p = [_params_by_dtype([b], seen) for b in parts.blocks]
    # leftovers (e.g. OPT's project_in/out) are charged to the last piece
    head_p = _params_by_dtype([*parts.last, model], seen)
    with _faked(model, parts) as recorded, AnyDtypeGroupedMM():
        # again at twice the micro-batch: what of each peak does not grow with it (ModelProfile.scaled)
        docs = {rows: documents(rows) if documents else None for rows in (micro_batch_size, 2 * micro_batch_size)}
        recs, twice = [_recorded(model, recorded, torch.randint(0, vocab_size, (rows, seq_len)), docs[rows])
                       for rows in (micro_batch_size, 2 * micro_batch_size)]
        mask_bytes = docs[micro_batch_size].held_bytes() if documents else 0
    kinds = len(recorded.blocks)
    one, two = ([r["embed"], *_by_block(parts, [r[f"block.{j}"] for j in range(kinds)]), r["head"]]
                for r in (recs, twice))
    itemsize = DTYPE_BYTES[dtype]
    blocks = [_piece(f"block.{i}", rec, p, True, _mlp_grad_bytes(b, itemsize))
              for i, (rec, p, b) in enumerate(zip(one[1:-1], block_p, parts.blocks))]
    prof = ModelProfile(
        model=name, config=config, micro_batch_size=micro_batch_size, seq_len=seq_len, dtype=dtype,
        embed=_piece("embed", one[0], embed_p, False), blocks=blocks,
        head=_piece("head", one[-1], head_p, False), tied_params=tied, mask_bytes=mask_bytes,
    )
    for piece, a, b in zip(prof.pieces, one, two):
        piece.fwd_peak_fixed_bytes = min(max(0, 2 * a.fwd.peak_delta - b.fwd.peak_delta), a.fwd.peak_delta)
        piece.bwd_peak_fixed_bytes = min(max(0, 2 * a.bwd.peak_delta - b.bwd.peak_delta), a.bwd.peak_delta)
    return prof


def compile_module(prof: ModelProfile, model: nn.Module, parts: ModelParts, vocab_size: int) -> ModelProfile:
    """The model's eager profile `prof` with its blocks as torch.compile runs them, traced (profile.compiled) one
    of each kind; `prof` itself, with the reason logged, where they cannot be traced: the plan then runs them
    eager, as the runtime would."""
    model.to(getattr(torch, prof.dtype))
    with _faked(model, parts) as traced:
        tokens = torch.randint(0, vocab_size, (prof.micro_batch_size, prof.seq_len))
        try:
            costs = compiled_costs(model, traced.blocks, lambda: traced.loss(tokens, tokens))
        except Exception as err:  # noqa: BLE001 - any tracing failure means the same: plan these blocks eager
            log.warning("compile: the blocks cannot be traced as torch.compile runs them (%s); planned eager",
                        str(err).strip().splitlines()[0][:200])
            return prof
    blocks = [_compiled(b, *c) for b, c in zip(prof.blocks, _by_block(parts, costs))]
    return replace(prof, blocks=blocks)


def build_profile(
    model: ModelConfig | dict, *, micro_batch_size: int, seq_len: int, dtype: str, label: str,
    eager: ModelProfile | None, measure_on: str | None, repeats: int, clock: Callable[[], float],
    lora_rank: int | None, frozen: str | None, quantize_base: str, kernels: str, lora_targets: str, pack: bool,
) -> ModelProfile:
    """The profile profile.cache.profile_model found no copy of (its arguments; label: the model's name there):
    recorded on the meta device, or with `eager`, the model's eager profile, its blocks traced as torch.compile
    runs them."""
    is_hf = isinstance(model, dict)
    config = dict(model) if is_hf else model.to_dict()
    if is_hf:
        from snugfit.model.hf import hf_from_config

        net = hf_from_config(config)
    else:
        cfg = ModelConfig.from_dict(config)
        cfg.max_seq_len = max(cfg.max_seq_len, seq_len)
        with torch.device("meta"):
            net = Decoder(cfg)
    fine_tune(net, lora_rank, frozen, lora_targets)
    set_balanced(net)  # experts priced at balanced routing: fake (or random) weights route by chance
    with gpu_kernels(net) if kernels == "gpu" else nullcontext():
        if eager is not None:
            prof = compile_module(eager, net, model_parts(net), net.cfg.vocab_size)
        else:
            prof = profile_module(net, model_parts(net), name=label, config=config, micro_batch_size=micro_batch_size,
                                  seq_len=seq_len, dtype=dtype, vocab_size=net.cfg.vocab_size,
                                  documents=packed_documents(seq_len, dtype, None if is_hf else flex_trains_on(
                                      "cuda" if kernels == "gpu" else "cpu")) if pack else None)
    prof.trainable_by_kind = trainable_by_kind(net)  # counted as `snugfit train` counts the model it trains
    # traced blocks' traffic and launches replace the eager ones NF4's were charged to, so they are charged again
    if quantize_base == "nf4" and prof.compiled == (eager is not None):
        count_quantized(prof, net)
    if measure_on and not is_hf:
        measure_times(prof, cfg, measure_on, repeats, clock, lora_rank, frozen, lora_targets)
    return prof


def count_quantized(prof: ModelProfile, net: nn.Module) -> None:
    """Mark the weights NF4 will hold, block by block, and charge their dequantization to each forward and
    backward, which recomputation repeats (the meta-device recording never runs torchao's): eager, torchao's
    operators and their traffic (NF4_LINEAR_OPS per linear, NF4_LINEAR_BYTES per weight); compiled, one fused
    kernel per linear that reads the 4-bit weight and writes it in the compute dtype."""
    from snugfit.model.quantize import quantizable

    c = DTYPE_BYTES[prof.dtype]
    for piece, block in zip(prof.blocks, net.blocks.values()):
        linears = quantizable(block).values()
        piece.quantized = sum(m.weight.numel() for m in linears)
        moved = (nf4_bytes(piece.quantized) + piece.quantized * c if piece.compiled
                 else piece.quantized * NF4_LINEAR_BYTES)
        piece.fwd_mem_bytes += moved
        piece.bwd_mem_bytes += moved
        # compiled, each weight's dequantization fuses into one kernel per pass
        ops = (1, 1) if piece.compiled else NF4_LINEAR_OPS
        piece.fwd_ops += ops[0] * len(linears)
        piece.bwd_ops += ops[1] * len(linears)


SPAN = 4  # measured times are taken at the profile's micro-batch and at SPAN times it


def measure_times(prof: ModelProfile, cfg: ModelConfig, device: str, repeats: int = 3,
                  clock: Callable[[], float] = time.perf_counter, lora_rank: int | None = None,
                  frozen: str | None = None, lora_targets: str = "") -> None:
    """Fill fwd/bwd_time_s of every piece, and each block's recompute_time_s: the extra
    seconds of a step with the block under each of RECOMPUTE_POLICIES (checkpointing has
    overheads beyond re-running the forward, large for small blocks).

    The variants are timed in rounds, one step of each per round, and a recompute extra is
    the median of its per-round differences: on a shared machine whose speed drifts over
    seconds, variants timed one after another would each see a different machine. The price:
    four copies of the model (one per policy) are alive at once.
    """
    tune = (lora_rank, frozen, lora_targets)
    timers = {policy: _PieceTimer(cfg, prof, device, clock, policy, tune) for policy in PROFILED}
    mbs = prof.micro_batch_size
    tokens = {rows: torch.randint(0, cfg.vocab_size, (rows, prof.seq_len), device=device) for rows in (mbs, SPAN * mbs)}
    # "wide": keep at SPAN times the micro-batch, for the intercept of the line through both sizes (the part no
    # batch size changes: dispatch, launches) that lets ModelProfile.scaled() move across the sizes searched
    # (recomputation has its own fixed part: checkpointing's per-operator overheads, large for small blocks)
    runs = {"keep": ("keep", mbs), "wide": ("keep", SPAN * mbs), **{p: (p, mbs) for p in RECOMPUTE_POLICIES},
            **{f"{p} wide": (p, SPAN * mbs) for p in RECOMPUTE_POLICIES}}
    samples: dict[str, list[dict[tuple[str, str], float]]] = {name: [] for name in runs}
    try:
        for it in range(repeats + 2):  # two warm-ups
            for name, (policy, rows) in runs.items():
                sample = timers[policy].step(tokens[rows])
                if it >= 2:
                    samples[name].append(sample)
    finally:
        for timer in timers.values():
            timer.close()
    # the fastest of the repeats: on a shared machine, interference only ever adds time
    # a piece with no backward (frozen, nothing before it needing gradients) has no "bwd" sample: it takes 0
    keep, wide = (defaultdict(float, {k: min(s[k] for s in samples[name]) for k in samples[name][0]})
                  for name in ("keep", "wide"))
    for piece in prof.pieces:
        piece.fwd_time_s, piece.bwd_time_s = keep[(piece.name, "fwd")], keep[(piece.name, "bwd")]
        piece.fwd_fixed_s, piece.bwd_fixed_s = (
            min(max(0.0, (SPAN * keep[(piece.name, ph)] - wide[(piece.name, ph)]) / (SPAN - 1)), keep[(piece.name, ph)])
            for ph in ("fwd", "bwd"))
    for policy in RECOMPUTE_POLICIES:
        for piece in prof.blocks:
            narrow, broad = (
                max(0.0, statistics.median(sum(s.get((piece.name, ph), 0.0) - k.get((piece.name, ph), 0.0)
                                               for ph in ("fwd", "bwd"))
                                           for s, k in zip(samples[name], samples[base])))
                for name, base in ((policy, "keep"), (f"{policy} wide", "wide")))
            piece.recompute_time_s[policy] = narrow
            piece.recompute_fixed_s[policy] = min(max(0.0, (SPAN * narrow - broad) / (SPAN - 1)), narrow)
    prof.device = device


class _PieceTimer:
    """One model under one activation policy, with hooks that time each piece's forward and backward.

    Piece boundaries come from module hooks; each piece's time runs until the next
    piece starts (so glue code between pieces is charged to the piece before it).
    """

    def __init__(self, cfg: ModelConfig, prof: ModelProfile, device: str, clock: Callable[[], float], policy: str,
                 tune: tuple[int | None, str | None, str]):
        torch.manual_seed(0)
        self.model = Decoder(cfg).to(device=device, dtype=getattr(torch, prof.dtype))
        fine_tune(self.model, *tune)
        set_balanced(self.model)
        if policy in RECOMPUTE_POLICIES:
            for block in self.model.blocks.values():
                recompute(block, policy)
        parts = model_parts(self.model)
        names = ["embed"] + [f"block.{i}" for i in range(len(parts.blocks))] + ["head"]
        mods = [parts.embed[0], *parts.blocks, parts.last[0]]
        self.marks: list[tuple[str, str, float]] = []
        sync = torch.accelerator.synchronize if device != "cpu" else (lambda: None)

        def mark(name, phase):
            def hook(*_):
                sync()
                self.marks.append((name, phase, clock()))
            return hook

        self.mark = mark
        self.handles = [m.register_forward_pre_hook(mark(n, "fwd")) for n, m in zip(names, mods)]
        self.handles += [m.register_full_backward_pre_hook(mark(n, "bwd")) for n, m in zip(names[:-1], mods[:-1])]

    def step(self, tokens: torch.Tensor) -> dict[tuple[str, str], float]:
        """(piece, fwd|bwd) -> seconds of one forward and backward."""
        self.marks.clear()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")  # embedding: int inputs
            loss = self.model(tokens, tokens)
            self.mark("head", "bwd")()
            loss.backward()
            self.mark("end", "end")()
        self.model.zero_grad(set_to_none=True)
        return {(n, ph): t1 - t0 for (n, ph, t0), (_, _, t1) in zip(self.marks, self.marks[1:])}

    def close(self) -> None:
        for h in self.handles:
            h.remove()
