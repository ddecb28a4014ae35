"""The optimizer a plan's OptimizerPlan names, its states in checkpoints, and the `Updater` interface every way of
updating a unit implements (`DeviceUnits` here).

fp32 weights with fp32 states: torch's fused AdamW. Anything else is torchao 0.18's AdamW (pure Python on CPU; its
update is compiled on the first step): AdamW8bit / AdamW4bit for blockwise quantized states, `_AdamW` with plain
states of the chosen dtype otherwise, each with `bf16_stochastic_round` where the weights are bf16 (no fp32 copy).
Not written here: torchao's quantized states and stochastic rounding are the real parts.

Checkpoints hold every state as fp32, laid out as its parameter (a DTensor DCP reshards): quantized and bf16 states
are dequantized on the way out (on host, one tensor at a time) and quantized again on the way in by copying into the
live states. Quantizing the saved values again gives back the same scales and codes (`_dense_on_host`), so a run
resumed at the same world size continues as the uninterrupted one, bit for bit; and a checkpoint loads under another
world size (torchao quantizes a shard only if it has at least 4096 elements its block divides, so the same tensor
can be quantized at one size and plain at another) or another optimizer setup.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from snugfit.config import OPTIM_EXTRA
from snugfit.errors import SnugfitError
from snugfit.plan import OptimizerPlan
from snugfit.runtime.memory import MemoryTracker, local


@dataclass
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm (stepping in backward: each unit's share of it); 0 disables


def param_groups(params: list[torch.Tensor], weight_decay: float) -> list[dict]:
    """Decay matrices, not norms, biases or anything 1-D."""
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def make_adamw(params: list[torch.Tensor], cfg: OptimConfig) -> torch.optim.AdamW:
    """Fused AdamW where the device supports it (CPU included: 5x faster than the default here)."""
    groups = [g for g in param_groups(params, cfg.weight_decay) if g["params"]]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)


def _torchao_optim():
    try:
        import torchao.optim
    except ImportError:
        raise SnugfitError(f"bf16 master weights and bf16, 8- or 4-bit optimizer states need torchao: "
                           f"{OPTIM_EXTRA}") from None
    return torchao.optim


@functools.cache
def _torchao_adamw(states: str) -> type:
    """torchao's AdamW for `states` (AdamW8bit, AdamW4bit; `_AdamW` for plain states of a chosen dtype: its own
    take the weight's, and bf16 weights with fp32 states, or fp32 weights with bf16 states, need another), with
    what torch 2.13 needs of it:
    - quantized states look fp32 whatever the weight: torchao's view() of them (DTensor.from_local calls it on
      FSDP2's shards) drops a bf16 look, and dynamo then fails on the view's dtype (the values are the same);
    - its compiled update skips AOTAutograd's on-disk cache, where the 8- and 4-bit state subclasses hash alike:
      an 8-bit update loaded the code compiled for a 4-bit one of the same shape and failed. Inductor's own cache
      still spares later processes the compile."""
    ao = _torchao_optim()
    quantized = states in ("8bit", "4bit")
    if quantized:
        from torchao.optim.subclass_4bit import OptimState4bit
        from torchao.optim.subclass_8bit import OptimState8bit

        base, state_cls = (ao.AdamW8bit, OptimState8bit) if states == "8bit" else (ao.AdamW4bit, OptimState4bit)
    else:
        base, state_cls = ao._AdamW, None

    class TorchaoAdamW(base):
        def __init__(self, params, *, state_dtype: torch.dtype | None = None, **kw):
            super().__init__(params, **kw)
            self.state_dtype = state_dtype

        @staticmethod
        def _subclass_zeros(p: torch.Tensor, signed: bool, block_size: int) -> torch.Tensor:
            return state_cls.zeros(p.shape, signed, block_size, p.device, dtype=torch.float32)

        def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
            out = super()._new_buffer(p, signed)
            return out if self.state_dtype is None else out.to(self.state_dtype)

        def step(self, closure=None):
            with torch._functorch.config.patch(enable_autograd_cache=False):
                return super().step(closure)

    TorchaoAdamW.__name__ = f"{base.__name__}ForSnugfit"
    return TorchaoAdamW


def make_optimizer(params: list[torch.Tensor], cfg: OptimConfig, opt: OptimizerPlan) -> torch.optim.Optimizer:
    """The AdamW `opt` names over `params` (see the module docstring), with every state created (`init_states`)."""
    if not opt.needs_torchao:
        optimizer = make_adamw(params, cfg)
    else:
        groups = [g for g in param_groups(params, cfg.weight_decay) if g["params"]]
        kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                  bf16_stochastic_round=opt.master_weights == "bf16")
        if opt.states in ("fp32", "bf16"):
            kw["state_dtype"] = torch.float32 if opt.states == "fp32" else torch.bfloat16
        optimizer = _torchao_adamw(opt.states)(groups, **kw)
    init_states(optimizer)
    return optimizer


def init_states(optimizer: torch.optim.Optimizer) -> None:
    """Every parameter's states, zero, as the first step would make them: so they are counted from the start, load
    from a checkpoint before any step, and can be streamed (runtime.stream_states)."""
    new_buffer = getattr(optimizer, "_new_buffer", None)  # torchao's: plain or quantized, as its step would
    for group in optimizer.param_groups:
        for p in group["params"]:
            if optimizer.state[p]:
                continue
            if new_buffer is not None:
                state = {"step": torch.tensor(0.0), "exp_avg": new_buffer(p, True), "exp_avg_sq": new_buffer(p, False)}
            else:  # torch's fused AdamW keeps its step count on the parameter's device
                state = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                         "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            optimizer.state[p] = state


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The learning rate of the next step (torchao keeps it as a tensor, which must be filled, not replaced)."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def _host_dtensor_like(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`t` (this rank's part, on host) laid out as parameter p, staying on host: DTensor.from_local would move it to
    the mesh's device, and a model's states in fp32 do not fit there (8-bit states are a quarter of it)."""
    if not isinstance(p, DTensor):
        return t
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(p.device_mesh, p.placements, TensorMeta(p.shape, p.stride(), t.dtype))
    return DTensor(t, spec, requires_grad=False)


def is_plain_fp32(t: torch.Tensor) -> bool:
    """A state DCP can save as it is: an fp32 tensor, not a quantized one (nor its DTensor)."""
    loc = local(t)
    return type(loc) is torch.Tensor and loc.dtype == torch.float32


def saved_state(state: dict, p: torch.Tensor, copy: bool = False) -> dict:
    """A parameter's states as a checkpoint holds them: fp32, laid out as p. Plain fp32 ones as they are (unless
    `copy`: the live storage is about to go, runtime.stream_states), others dequantized into host memory."""
    out = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            out[key] = value
        elif is_plain_fp32(value) and not copy:  # a host master's states are its shard: laid out as p
            out[key] = value if isinstance(value, DTensor) else _host_dtensor_like(value, p)
        else:
            out[key] = _dense_on_host(value, p)
    return out


def _dense_on_host(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """An fp32 copy of a state on host, laid out as p. Quantizing it again must give back the same scales and codes:
    a block's scale is its largest magnitude, which maps to the code of 1.0, but a signed lookup table ends at 1.0
    and not at -1.0, so a block whose largest element was negative holds no element at its scale any more, and would
    come back with a smaller scale and codes moved. Its most negative element is saved at minus the scale instead
    (a change under 1%, and the code it quantizes to is its own)."""
    on_host = local(value).to("cpu")  # torchao's states move with their codes and scales
    if type(on_host) is torch.Tensor:
        return _host_dtensor_like(on_host.to(torch.float32).clone(), p)
    dense = on_host.dequantize().to(torch.float32).contiguous()
    blocks, scale = dense.view(-1, on_host.block_size), on_host.scale.float().view(-1, 1)
    lowest, low = blocks.min(dim=1, keepdim=True)
    negative = (blocks.max(dim=1, keepdim=True)[0] < scale) & (lowest < 0)
    blocks.scatter_(1, low, torch.where(negative, -scale, lowest))
    return _host_dtensor_like(dense, p)


@torch.no_grad()
def load_state(state: dict, saved: dict) -> None:
    """Copy a checkpoint's states (`saved_state`'s layout, resharded by DCP) into the live ones: quantized states
    quantize what they are given, plain ones cast it."""
    for key, value in saved.items():
        if key not in state:
            continue
        if isinstance(state[key], torch.Tensor):
            local(state[key]).copy_(local(value))
        else:
            state[key] = value


@dataclass
class OptimUnit:
    """One unit's trainable parameters (by FQN) and the optimizer that updates them: a block, or the root pieces
    (embedding, final norm, head), as FSDP2 shards them."""

    name: str
    names: list[str]
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    streamed: bool = False  # its states live on host between steps (runtime.stream_states)

    def grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return [(p, p.grad) for p in self.params if p.grad is not None]


def optimizer_units(model: nn.Module, plan, cfg: OptimConfig, skip=lambda p: False) -> list[OptimUnit]:
    """One OptimUnit per block of `model.blocks` (plan.blocks by index) and one for the rest, in the order backward
    finishes them (the last block first, the root pieces last); `skip`: parameters another optimizer owns (host
    offload). A unit without trainable parameters has none."""
    in_blocks = set()
    units = []
    for name, block in reversed(list(model.blocks.items())):
        named = [(f"blocks.{name}.{n}", p) for n, p in block.named_parameters() if p.requires_grad and not skip(p)]
        in_blocks |= {id(p) for p in block.parameters()}
        units.append((f"block {name}", plan.blocks[int(name)].stream_states, named))
    rest = [(n, p) for n, p in model.named_parameters() if id(p) not in in_blocks and p.requires_grad and not skip(p)]
    units.append(("root", plan.root.stream_states, rest))
    return [OptimUnit(name, [n for n, _ in named], [p for _, p in named],
                      make_optimizer([p for _, p in named], cfg, plan.optimizer), streamed)
            for name, streamed, named in units if named]


class Updater(Protocol):
    """One way some of this rank's trainable parameters are updated, unit by unit (a block, the root pieces), one
    technique each: `DeviceUnits` (states beside the parameters), host offload (runtime.offload.HostOffload) and
    streamed states (runtime.stream_states.StreamedStates). The engine clips every updater's gradients together and
    steps them all after backward; stepping in backward (runtime.step_in_backward) steps each unit as its gradient
    is final. `unit` None: every unit."""

    def unit_params(self) -> dict[Hashable, list[nn.Parameter]]:
        """Each unit's parameters, by the key `grads` and `step` take."""

    def grads(self, unit: Hashable | None = None) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, gradient) of the parameters that received one this step, the gradient where the update
        reads it (the global norm's input)."""

    def step(self, coef: float, skip: bool, lr: float, unit: Hashable | None = None) -> None:
        """Update with the gradients times `coef` at learning rate `lr`; `skip`: drop this step's gradients."""

    def wait(self) -> None:
        """Block until every queued update has reached the parameters."""

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Every optimizer it steps."""

    def track(self, tracker: MemoryTracker) -> None:
        """Let the memory tracker count what it holds."""

    def state_dict(self, model_sd: dict) -> dict[str, dict]:
        """Its parameters' optimizer states by parameter name (`saved_state`); puts into `model_sd` the weights
        it keeps outside the model (host masters)."""

    def load_state_dict(self, model_sd: dict, saved: dict[str, dict]) -> None:
        """Take the states (and weights kept outside the model) of its parameters from a checkpoint."""


class DeviceUnits:
    """Units whose optimizer states live beside their parameters (on the device; on host with them where FSDP2
    offloads the parameters): each unit's optimizer steps in place. `sample`: the engine's memory sampling, after
    each unit's update."""

    states_move = False  # the states' storages leave after each use (StreamedStates): checkpoints copy them

    def __init__(self, units: list[OptimUnit], sample: Callable[[], None]):
        self.order, self.sample = units, sample
        self._named = {u.name: u for u in units}

    def unit_params(self) -> dict[Hashable, list[nn.Parameter]]:
        return {u.name: u.params for u in self.order}

    def _chosen(self, unit: Hashable | None) -> list[OptimUnit]:
        return self.order if unit is None else [self._named[unit]]

    def grads(self, unit: Hashable | None = None) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return [pg for u in self._chosen(unit) for pg in u.grads()]

    def step(self, coef: float, skip: bool, lr: float, unit: Hashable | None = None) -> None:
        if skip:
            return
        units = self._chosen(unit)
        grads = [local(g) for u in units for _, g in u.grads()]
        if coef != 1.0 and grads:
            torch._foreach_mul_(grads, coef)
        for u in units:
            set_lr(u.optimizer, lr)
            with self.loaded(u):
                u.optimizer.step()
                self.sample()  # a unit's update (streamed states on the device)

    def loaded(self, unit: OptimUnit) -> AbstractContextManager:
        """The unit's states on the device while inside (here they always are)."""
        return nullcontext()

    def wait(self) -> None:
        """Nothing is queued: every update ran in `step`."""

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [u.optimizer for u in self.order]

    def track(self, tracker: MemoryTracker) -> None:
        tracker.add_optimizers(self.optimizers())  # counted where their parameters are

    def state_dict(self, model_sd: dict) -> dict[str, dict]:
        out = {}
        for u in self.order:
            with self.loaded(u):
                for name, p in zip(u.names, u.params):
                    out[name] = saved_state(u.optimizer.state[p], p, copy=self.states_move)
        return out

    def load_state_dict(self, model_sd: dict, saved: dict[str, dict]) -> None:
        for u in self.order:
            named = [(name, p) for name, p in zip(u.names, u.params) if name in saved]
            if named:
                with self.loaded(u):
                    for name, p in named:
                        load_state(u.optimizer.state[p], saved[name])
