"""Fine-tuning: LoRA adapters and frozen pieces, for the built-in Decoder and HFCausalLM alike.

A small own `LoRALinear` rather than peft: snugfit needs the adapters inside
the block they adapt (each block is one FSDP2 unit, so adapter and frozen base
shard and gather together), stable parameter names the plan and checkpoints
can address, and one wrapper for both nn.Linear and GPT-2's transposed Conv1D.
peft brings its own model wrapper and adapter registry for none of which the
runtime has a use.

Frozen parameters have requires_grad False: the engine builds its optimizer
over trainable parameters only, so they get neither gradients nor optimizer
states; `trainable_summary` tells the plan report and the memory model how many
of each piece's parameters are which.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from snugfit.errors import SnugfitError
from snugfit.model.moe import grouped_mm, local
from snugfit.model.quantize import dequantized, is_quantized
from snugfit.model.shards import write_whole

# Default adapted projections: attention, per architecture (the built-in Decoder's names under "snugfit").
LORA_TARGETS = {
    "snugfit": ("attn.q", "attn.k", "attn.v", "attn.o"),
    "gpt2": ("attn.c_attn", "attn.c_proj"),
    "opt": ("q_proj", "k_proj", "v_proj", "out_proj"),
    "phi3": ("qkv_proj", "o_proj"),  # q, k and v in one fused projection
    "default": ("q_proj", "k_proj", "v_proj", "o_proj"),
}
ALL_LINEAR = "all-linear"  # a target: every linear layer of a block (peft's name for it), experts included
ROUTER = "router"  # a target: every Mixture-of-Experts router (the built-in's `router`, transformers' `gate`)
# PEFT's target names (Llama's), and the layers that compute the same projection under other names: the built-in
# decoder's, fused ones (Phi-3's qkv_proj and gate_up_proj, GPT-2's c_attn), OPT's and GPT-2's. A name a model
# has no layer of is read as the first of these it has, so `--lora-targets q_proj,v_proj` means the same
# everywhere; a model's own names always win.
PEFT_NAMES = {
    "q_proj": ("attn.q", "qkv_proj", "c_attn"),
    "k_proj": ("attn.k", "qkv_proj", "c_attn"),
    "v_proj": ("attn.v", "qkv_proj", "c_attn"),
    "o_proj": ("attn.o", "out_proj", "attn.c_proj"),
    "gate_proj": ("mlp.gate", "gate_up_proj"),
    "up_proj": ("mlp.up", "gate_up_proj", "fc1", "mlp.c_fc"),
    "down_proj": ("mlp.down", "fc2", "mlp.c_proj"),
}


def _is_linear(mod: nn.Module) -> bool:
    return isinstance(mod, nn.Linear) or type(mod).__name__ == "Conv1D"


def _dims(base: nn.Module) -> tuple[int, int]:
    """(in, out) of a Linear, or of a GPT-2 Conv1D whose weight is stored (in, out)."""
    if isinstance(base, nn.Linear):
        return base.in_features, base.out_features
    if _is_linear(base):
        return base.weight.shape[0], base.weight.shape[1]
    raise SnugfitError(f"LoRA adapts linear layers; {type(base).__name__} is not one")


class LoRALinear(nn.Module):
    """base(x) + alpha/rank * B(A(dropout(x))); the base is frozen, B starts at zero (no change at step 0)."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        d_in, d_out = _dims(base)
        w = base.weight
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.empty(rank, d_in, dtype=w.dtype, device=w.device))
        self.lora_b = nn.Parameter(torch.zeros(d_out, rank, dtype=w.dtype, device=w.device))
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_adapter()

    def reset_adapter(self, generator: torch.Generator | None = None) -> None:
        _reset_pair(self.lora_a, self.lora_b, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (self.dropout(x) @ self.lora_a.t() @ self.lora_b.t()) * self.scale

    def delta(self, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
        """The weight update in the base's own layout (Conv1D stores its weight transposed)."""
        d = (lora_b.float() @ lora_a.float()) * self.scale
        return d if isinstance(self.base, nn.Linear) else d.t()


@torch.no_grad()
def _reset_pair(lora_a: torch.Tensor, lora_b: torch.Tensor, generator: torch.Generator | None) -> None:
    """A ~ Kaiming-uniform over its input dimension (as nn.Linear), B = 0; drawn whole on CPU, so a sharded A
    (FSDP2's rows, expert parallelism's experts, or both) keeps its own part of it."""
    bound = 1.0 / math.sqrt(lora_a.shape[-1])
    a = torch.rand(lora_a.shape, generator=generator, dtype=torch.float32) * 2 * bound - bound
    write_whole(lora_a, a)
    local(lora_b).zero_()


class LoRAExpertWeight(nn.Module):
    """A parametrization of one 3-D expert weight (E x out x in; E x in x out where `transposed`, as gpt-oss
    stores it): W_e + alpha/rank * B_e A_e for every expert e, A E x rank x in, B E x out x rank, B zero at the
    start (no change at step 0).

    A parametrization (torch.nn.utils.parametrize) rather than a wrapper: the experts' forward stays their own
    (transformers' grouped GEMMs in any of its experts implementations, the built-in GroupedExperts) and reads
    the adapted weight where it reads the weight; the base (`original`) stays frozen. Adapter dropout, which acts
    on a linear layer's input, does not apply here."""

    def __init__(self, weight: torch.Tensor, rank: int, alpha: float, transposed: bool = False):
        super().__init__()
        experts, d_out, d_in = weight.shape
        if transposed:
            d_out, d_in = d_in, d_out
        self.lora_a = nn.Parameter(torch.empty(experts, rank, d_in, dtype=weight.dtype, device=weight.device))
        self.lora_b = nn.Parameter(torch.zeros(experts, d_out, rank, dtype=weight.dtype, device=weight.device))
        self.scale, self.transposed = alpha / rank, transposed
        self.reset_adapter()

    def reset_adapter(self, generator: torch.Generator | None = None) -> None:
        _reset_pair(self.lora_a, self.lora_b, generator)

    def delta(self, lora_a: torch.Tensor, lora_b: torch.Tensor) -> torch.Tensor:
        """alpha/rank * B_e A_e for every expert, in the base's own layout."""
        d = torch.bmm(lora_b, lora_a) * self.scale
        return d.transpose(1, 2) if self.transposed else d

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.delta(self.lora_a, self.lora_b).to(weight.dtype)

    def low_rank(self, x: torch.Tensor) -> bool:
        """Whether `project` can run at x's dtype: grouped GEMM wants each row of its operands in whole 16 bytes
        (torch's meta kernel checks it, CUDA's kernel needs it), so rank 4 in bf16 takes the merged weight."""
        return self.lora_a.shape[1] * x.element_size() % 16 == 0

    def project(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """The adapter's part of x W_e^T for tokens x sorted by expert (e's ending at offs[e]): alpha/rank *
        (x A_e^T) B_e^T through two grouped GEMMs, rank wide in between, where the grouped forward is ours
        (model.moe.GroupedExperts, whose weights are E x out x in): no merged weight made, no gradient of one
        computed."""
        low = grouped_mm(x, local(self.lora_a).transpose(1, 2), offs)
        return grouped_mm(low, local(self.lora_b).transpose(1, 2), offs) * self.scale


def expert_weights(block: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """'mlp.experts.gate_up_proj' -> (its experts module, 'gate_up_proj'): the 3-D weights of every module named
    `experts` in `block` (model.moe.GroupedExperts, transformers 5's experts), adapted or not."""
    out = {}
    for name, mod in block.named_modules():
        if name.rpartition(".")[2] == "experts":
            leaves = [n for n, p in mod.named_parameters(recurse=False) if p.dim() == 3]
            leaves += [n for n, p in getattr(mod, "parametrizations", {}).items() if p.original.dim() == 3]
            out.update({f"{name}.{leaf}": (mod, leaf) for leaf in leaves})
    return out


def routers(root: nn.Module) -> dict[str, nn.Module]:
    """The Mixture-of-Experts routers under `root` by name: a module's `router` or `gate` beside its `experts`
    (the built-in MoEMLP's router; transformers' gate, gpt-oss's router). Never adapted, trained whole when named."""
    return {f"{name}.{leaf}" if name else leaf: mod._modules[leaf] for name, mod in root.named_modules()
            if "experts" in mod._modules for leaf in ("router", "gate") if mod._modules.get(leaf) is not None}


def _default_targets(model: nn.Module) -> tuple[str, ...]:
    hf_cfg = getattr(model, "hf_config", None)
    if hf_cfg is None:
        return LORA_TARGETS["snugfit"]
    return LORA_TARGETS.get(hf_cfg.model_type, LORA_TARGETS["default"])


def apply_lora(model: nn.Module, rank: int, alpha: float | None = None,
               targets: Iterable[str] | None = None, dropout: float = 0.0, seed: int = 0) -> list[str]:
    """Wrap the target projections of every block in LoRALinear, adapt the target expert weights
    (LoRAExpertWeight), and freeze everything else.

    targets: module-name suffixes inside a block ("q_proj", "attn.q"), expert weights ("experts" for both,
    "gate_up_proj", "down_proj"), ROUTER or a router's own name ("gate") to train the routers whole, or ALL_LINEAR
    for every nn.Linear and Conv1D of a block and its experts (the routers stay frozen); default by architecture
    (LORA_TARGETS). alpha defaults to rank (scale 1). Adapters are initialised from `seed` in block order, so
    every rank (and every pipeline split) starts from the same adapters. Returns the adapted module (or expert
    weight) names.
    """
    if rank <= 0:
        raise SnugfitError(f"LoRA rank must be a positive integer, got {rank}")
    targets = _own_names(model, tuple(targets) if targets is not None else _default_targets(model))
    alpha = float(alpha if alpha is not None else rank)
    model.requires_grad_(False)
    wrapped, candidates, matched = [], set(), set()
    for bname, block in model.blocks.items():
        gates = routers(block)
        for name, router in gates.items():
            candidates.add(re.sub(r"^layer\.", "", name))
            hits = {t for t in targets if t == ROUTER or _matches(name, t)}
            router.requires_grad_(bool(hits))
            matched |= hits
        for name, mod in list(block.named_modules()):
            linear = _is_linear(mod) and name not in gates
            if linear:
                candidates.add(re.sub(r"^layer\.", "", name))
            hits = {t for t in targets if name and linear and (_matches(name, t) or t == ALL_LINEAR)}
            if hits and not isinstance(mod, LoRALinear):
                parent_name, _, leaf = name.rpartition(".")
                setattr(block.get_submodule(parent_name), leaf, LoRALinear(mod, rank, alpha, dropout))
                wrapped.append(f"blocks.{bname}.{name}")
                matched |= hits
        for name, (experts, leaf) in expert_weights(block).items():
            candidates.add(re.sub(r"^layer\.", "", name))
            owner = name.rpartition(".")[0]
            hits = {t for t in targets if t == ALL_LINEAR or _matches(name, t) or _matches(owner, t)}
            if hits and not parametrize.is_parametrized(experts, leaf):
                weight = getattr(experts, leaf)
                adapter = LoRAExpertWeight(weight, rank, alpha, bool(getattr(experts, "is_transposed", False)))
                parametrize.register_parametrization(experts, leaf, adapter)
                wrapped.append(f"blocks.{bname}.{name}")
                matched |= hits
    unmatched = [t for t in targets if t not in matched]
    if unmatched and len(model.blocks):  # a typo among targets would otherwise go unnoticed
        # the candidates: linear layers, expert weights and routers
        raise SnugfitError(f"LoRA targets {unmatched} match no layer; linear layers of a block: {sorted(candidates)}")
    init_adapters(model, seed)
    return wrapped


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def _own_names(model: nn.Module, targets: tuple[str, ...]) -> tuple[str, ...]:
    """`targets` in the model's own layer names: a PEFT name the model has no layer (expert weight, router) of
    becomes the first of its equivalents (PEFT_NAMES) among its linear layers and expert weights; fused
    equivalents appear once."""
    block = next(iter(model.blocks.values()), None)
    if block is None:
        return targets
    gates = routers(block)
    names = [n for n, m in block.named_modules() if _is_linear(m) and n not in gates] + [*expert_weights(block)]
    out: list[str] = []
    for t in targets:
        if t not in (ALL_LINEAR, ROUTER) and not any(_matches(n, t) for n in [*names, *gates]):
            t = next((alt for alt in PEFT_NAMES.get(t, ()) if any(_matches(n, alt) for n in names)), t)
        out += [t] if t not in out else []
    return tuple(out)


def init_adapters(model: nn.Module, seed: int) -> None:
    """Adapters from one generator per block (seed, block index), in module order: the same values on every
    rank and pipeline split, and again after a meta-device model is allocated (`runtime.apply.read_weights`)."""
    for bname, block in model.blocks.items():
        gen = torch.Generator().manual_seed(seed * 100_003 + int(bname))
        for mod in block.modules():
            if isinstance(mod, (LoRALinear, LoRAExpertWeight)):
                mod.reset_adapter(gen)


_PIECES = ("embed", "norm", "head", "blocks")


def _block_range(spec: str, n_layers: int) -> range:
    """'blocks' (all), 'blocks:3' or 'blocks:0-5' (inclusive)."""
    _, _, rng = spec.partition(":")
    if not rng:
        return range(n_layers)
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", rng)
    if m is None:
        raise SnugfitError(f"frozen spec {spec!r}: write blocks:N or blocks:A-B (inclusive)")
    lo, hi = int(m[1]), int(m[2] or m[1])
    if hi < lo or hi >= n_layers:
        raise SnugfitError(f"frozen spec {spec!r}: blocks go from 0 to {n_layers - 1}")
    return range(lo, hi + 1)


def freeze(model: nn.Module, spec: str | Iterable[str]) -> None:
    """Freeze pieces: "embed", "norm", "head", "blocks", "blocks:0-5" (comma-separated or a list).

    Pieces this rank does not hold (pipeline stages) are skipped; the spec is
    checked against the full model all the same.
    """
    items = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    for item in filter(None, items):
        piece = item.partition(":")[0]
        if piece not in _PIECES:
            raise SnugfitError(f"frozen spec {item!r}: pieces are {', '.join(_PIECES)} (blocks:A-B for a range)")
        if piece == "blocks":
            for i in _block_range(item, model.cfg.n_layers):
                if str(i) in model.blocks:
                    model.blocks[str(i)].requires_grad_(False)
        elif getattr(model, piece) is not None:
            getattr(model, piece).requires_grad_(False)


def _piece_of(name: str) -> str:
    """Piece names as the profile uses them: embed, block.i, head (final norm and head together)."""
    if name.startswith("blocks."):
        return "block." + name.split(".")[1]
    return "embed" if name.startswith("embed.") else "head"


def trainable_summary(model: nn.Module) -> dict[str, dict[str, int]]:
    """{piece: {"trainable": n, "frozen": n}} for embed, block.i, head, and "total"; tied weights counted once."""
    out: dict[str, dict[str, int]] = {}
    for name, p in model.named_parameters():
        counts = out.setdefault(_piece_of(name), {"trainable": 0, "frozen": 0})
        counts["trainable" if p.requires_grad else "frozen"] += p.numel()
    out["total"] = {k: sum(c[k] for c in out.values()) for k in ("trainable", "frozen")}
    return out


KINDS = ("attention", "MLP", "experts", "router", "other")  # other: embeddings, norms, the head
_KIND_KEYS = (("attention", (".attn.", ".self_attn.", ".attention.")),
              ("MLP", (".mlp.", ".ffn.", ".feed_forward.", ".block_sparse_moe.")))


def trainable_by_kind(model: nn.Module) -> dict[str, int]:
    """Trainable parameters per kind (KINDS): shows a target that misses the experts. Experts and routers are
    found by structure (`expert_weights`, `routers`: their adapters are the experts'), the rest by name; tied
    weights counted once. `snugfit plan` reads the same counts off the profile, which calls this."""
    out = dict.fromkeys(KINDS, 0)
    gates = tuple(f"{name}." for name in routers(model))
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        dotted = f".{name}."
        kind = ("router" if name.startswith(gates) else "experts" if ".experts." in dotted else
                next((k for k, keys in _KIND_KEYS if any(key in dotted for key in keys)), "other"))
        out[kind] += p.numel()
    return out


def plain_named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers under their names without adapters (a LoRA base's weight as the layer's own)."""
    wrappers = _wrappers(model)
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        plain = plain_name(model, name, wrappers)
        if plain is not None:
            out[plain] = t
    return out


_PARAMETRIZED = re.compile(r"(.*)\.parametrizations\.([^.]+)\.(.+)")  # parametrize's names: X.parametrizations.W.*


def plain_name(model: nn.Module, name: str, wrappers: list[str] | None = None) -> str | None:
    """`name` without a LoRA wrapper's `base.` or an adapted expert weight's `parametrizations.W.original` (the
    layer's own name for its base weight); None for an adapter."""
    if found := _PARAMETRIZED.fullmatch(name):
        return f"{found[1]}.{found[2]}" if found[3] == "original" else None
    prefix = next((w for w in (wrappers if wrappers is not None else _wrappers(model)) if name.startswith(w)), None)
    if prefix is None:
        return name
    return prefix + name.removeprefix(prefix + "base.") if name.startswith(prefix + "base.") else None


def _wrappers(model: nn.Module) -> list[str]:
    return [name + "." for name, m in model.named_modules() if isinstance(m, LoRALinear)]


@torch.no_grad()
def merged_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The state dict without adapters: W + alpha/rank * B A under the base layer's plain name; NF4 base weights
    (QLoRA) dequantized to bf16 first, merged or not, so the result is plain tensors any loader reads.

    `state_dict` (full tensors under the model's names) defaults to the model's own.
    """
    sd = {k: dequantized(v) if is_quantized(v) else v
          for k, v in (state_dict if state_dict is not None else model.state_dict()).items()}
    for name, mod in model.named_modules():
        if isinstance(mod, LoRALinear):
            a, b = sd.pop(f"{name}.lora_a"), sd.pop(f"{name}.lora_b")
            for leaf in [k.removeprefix(f"{name}.base.") for k in sd if k.startswith(f"{name}.base.")]:
                t = sd.pop(f"{name}.base.{leaf}")
                sd[f"{name}.{leaf}"] = (t.float() + mod.delta(a, b)).to(t.dtype) if leaf == "weight" else t
        elif isinstance(mod, LoRAExpertWeight):  # name: X.parametrizations.W.0 (parametrize's)
            owner, _, weight, _ = name.rsplit(".", 3)
            a, b = sd.pop(f"{name}.lora_a"), sd.pop(f"{name}.lora_b")
            t = sd.pop(f"{owner}.parametrizations.{weight}.original")
            sd[f"{owner}.{weight}"] = (t.float() + mod.delta(a.float(), b.float())).to(t.dtype)
    return sd
