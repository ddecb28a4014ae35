"""Tiled MLP of one block: the MLP runs over the sequence in tiles, so its intermediates never exist whole.

At long contexts a block's MLP intermediates dominate its working peak: SwiGLU's gate, up and their product are
3 x tokens x ffn_dim x bytes (some 27 GB for Llama-3.1-8B at 321k tokens), inside the block's forward and again in
its recompute. ALST's TiledMLP runs the MLP a tile of tokens at a time: the forward runs each tile without
autograd and keeps only the MLP's input; the backward recomputes each tile with autograd and differentiates it,
summing the parameters' gradients and writing each tile's input gradient. The MLP is token-wise, so the result
is the untiled one up to float summation order; the price is one more MLP forward in backward.

A model-level transformation, as model.recompute: the runtime applies it per the plan (BlockPlan.mlp_tiles,
runtime.apply), inside a block's activation policy (a recomputed block recomputes its MLP tiled too).

How it is applied, and why this way: `tile_mlp(block, tiles)` puts a `TiledMLP` where the block's MLP was. A
wrapper module holding the MLP as a child would rename every MLP parameter (`mlp.up.weight` would become
`mlp.inner.up.weight`), and plan-independent checkpoints, Hugging Face names (model.hf_model's hf_names) and LoRA
targets all address parameters by name. So `TiledMLP` keeps the original MLP out of the module tree and shares its
child, parameter and buffer tables (the same dicts, not copies): names, state dicts, FSDP2's and tensor
parallelism's parameter swaps and LoRA all see one set of modules under the old names. Nothing of the MLP's class
is patched; the MLP's own forward (and its hooks) runs per tile, on whatever parameters are registered then (FSDP2's
gathered ones, LoRA adapters, NF4 bases).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.func import functional_call

from snugfit.errors import SnugfitError
from snugfit.plan.facts import MOE_UNTILEABLE, UNTILEABLE_TYPES  # one list for the planner's rule and this

def mlp_of(block: nn.Module) -> tuple[nn.Module, str] | None:
    """(the module holding the block's MLP, its attribute name): the built-in Block's `mlp`, or a Hugging Face
    layer's (`block.layer.mlp`: Llama, Qwen, Mistral, Gemma, Phi-3, OLMo2); None where it has none."""
    for parent in (block, getattr(block, "layer", None)):
        if parent is not None and isinstance(getattr(parent, "mlp", None), nn.Module):
            return parent, "mlp"
    return None


def untileable(block: nn.Module) -> str | None:
    """Why the block's MLP cannot be tiled (one phrase), or None where it can."""
    found = mlp_of(block)
    kind = getattr(getattr(getattr(block, "layer", None), "config", None), "model_type", None)
    if kind in UNTILEABLE_TYPES:  # GPT-2's MLP carries dropout (a tile's mask would not be the whole's); OPT's
        return UNTILEABLE_TYPES[kind]  # fc1/fc2 sit on the layer itself
    if found is None:
        return f"{type(getattr(block, 'layer', block)).__name__} (no `mlp` module found)"
    mlp = getattr(*found)
    if any(hasattr(mlp, name) for name in ("router", "experts", "gate_up_proj_experts")):
        return MOE_UNTILEABLE
    return None


def _spans(n: int, tiles: int) -> list[tuple[int, int]]:
    step = -(-n // tiles)
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def _run_tiles(x: torch.Tensor, mlp: nn.Module, tiles: int) -> torch.Tensor:
    """The MLP's output, computed a tile at a time into one tensor (each tile's intermediates freed before the
    next tile runs)."""
    out, x = None, x.detach()  # a view of an input that requires grad would ask module hooks for its grad_fn
    for a, b in _spans(x.shape[1], tiles):
        y = mlp(x[:, a:b])
        if out is None:
            out = y.new_empty((*x.shape[:2], *y.shape[2:]))
        out[:, a:b] = y
    return out


class _Tiled(torch.autograd.Function):
    """The MLP over tiles of the sequence (dim 1): forward without autograd, keeping its input; backward
    recomputes and differentiates each tile. The trainable parameters are inputs, so their gradients flow as
    autograd's (accumulated by it, reduced by FSDP2's hooks) rather than written into .grad on the side."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mlp: nn.Module, tiles: int, names: tuple[str, ...],
                *params: torch.Tensor) -> torch.Tensor:
        ctx.mlp, ctx.tiles, ctx.names = mlp, tiles, names
        ctx.save_for_backward(x, *params)
        return _run_tiles(x, mlp, tiles)  # autograd is off inside a Function's forward

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, *params = ctx.saved_tensors
        # the parameters autograd saw in forward, not whatever the module holds now (runtime.precision swaps its
        # compute copies in for each forward only)
        weights = dict(zip(ctx.names, params))
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grads: list[torch.Tensor | None] = [None] * len(params)
        for a, b in _spans(x.shape[1], ctx.tiles):
            tile = x[:, a:b].detach().requires_grad_(grad_x is not None)
            with torch.enable_grad():
                y = functional_call(ctx.mlp, weights, (tile,), strict=False)
            wrt = ([tile] if grad_x is not None else []) + params
            found = torch.autograd.grad(y, wrt, grad[:, a:b], allow_unused=True) if wrt else ()
            if grad_x is not None:
                grad_x[:, a:b] = found[0]
                found = found[1:]
            grads = [g if s is None else (s if g is None else g.add_(s)) for g, s in zip(grads, found)]
        return (grad_x, None, None, None, *grads)


class TiledMLP(nn.Module):
    """Stands in for a block's MLP under the same names (see the module docstring): its children, parameters and
    buffers are the MLP's own tables; `forward` runs the MLP in `tiles` tiles of the sequence."""

    def __init__(self, mlp: nn.Module, tiles: int):
        super().__init__()
        if tiles < 1:
            raise SnugfitError(f"mlp_tiles must be >= 1, got {tiles}")
        self.tiles = tiles
        self.__dict__["inner"] = mlp  # outside the module tree: its tables are ours
        self.__dict__.update(_modules=mlp._modules, _parameters=mlp._parameters, _buffers=mlp._buffers,
                             _non_persistent_buffers_set=mlp._non_persistent_buffers_set)
        self.training = mlp.training

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # the MLP's plain attributes (a config, flags) read through the stand-in
            return getattr(self.__dict__["inner"], name)

    def train(self, mode: bool = True) -> "TiledMLP":
        self.inner.training = mode
        return super().train(mode)

    def extra_repr(self) -> str:
        return f"tiles={self.tiles}, mlp={type(self.inner).__name__}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles == 1 or x.shape[1] < 2:
            return self.inner(x)
        if not torch.is_grad_enabled():  # evaluation: tiles, nothing kept
            return _run_tiles(x, self.inner, self.tiles)
        trainable = [(n, p) for n, p in self.inner.named_parameters() if p.requires_grad]
        return _Tiled.apply(x, self.inner, self.tiles, tuple(n for n, _ in trainable), *(p for _, p in trainable))


def tile_mlp(block: nn.Module, tiles: int) -> nn.Module:
    """Make `block` run its MLP in `tiles` tiles of the sequence (1: as it is); a one-line SnugfitError where its
    MLP cannot be tiled (`untileable`)."""
    if tiles == 1:
        return block
    why = untileable(block)
    if why is not None:
        raise SnugfitError(f"mlp_tiles {tiles}: {why} cannot be tiled; use mlp_tiles 1")
    parent, name = mlp_of(block)
    mlp = getattr(parent, name)
    if isinstance(mlp, TiledMLP):
        mlp.tiles = tiles
    else:
        setattr(parent, name, TiledMLP(mlp, tiles))
    return block
