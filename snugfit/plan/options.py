"""What a block may choose: the user's fixed parts of a plan, and the per-block options they leave open.

Pure: the search enumerates these, the explanation names them.
"""

from __future__ import annotations

from dataclasses import dataclass

from snugfit.errors import SnugfitError
from snugfit.plan.plan import ACTIVATION_POLICIES, GRAD_REDUCE, SCHEDULES, BlockPlan

POLICY_ALIASES = {"none": "keep", "off": "keep", "full": "recompute"}


@dataclass
class Constraints:
    """Parts of the plan fixed by the user; None = search it."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    micro_batch: int | None = None
    num_microbatches: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    zero: int | None = None
    activations: str | None = None
    offload_optimizer: bool | None = None  # True: every block and the root; False: none
    offload_params: bool | None = None
    evict_bound: int | None = None
    grad_reduce: str | None = None  # plan.GRAD_REDUCE

    def fixed(self) -> dict:
        return {k: v for k, v in vars(self).items() if v is not None}


FIXED_KEYS = ("dp", "tp", "pp", "schedule", "virtual_stages", "num_microbatches", "zero", "recompute", "offload_optimizer",
              "offload_params", "evict_bound", "grad_reduce")  # the run config's [parallel] keys that fix parts of a searched plan


def fixed_parts_of(parallel, micro_batch_size: int, world_size: int) -> Constraints:
    """The fixed parts a run config gives (its [parallel] FIXED_KEYS; micro-batch 0 = searched), checked."""
    return fixed_parts(world_size, micro_batch=micro_batch_size or None,
                       **{k: getattr(parallel, k) for k in FIXED_KEYS})


def refuse_fixed_parts_beside(parallel) -> None:
    """Fixed parts belong to a searched plan (plan "auto"), not to a plan file or plain data parallelism."""
    fixed = [k for k in FIXED_KEYS if getattr(parallel, k) is not None]
    if fixed and parallel.plan != "auto":
        raise SnugfitError(f"--{fixed[0].replace('_', '-')} fixes a part of a searched plan, but --plan is "
                           f"{parallel.plan!r}; drop --plan (auto) or the fixed parts")


def fixed_parts(world_size: int, *, dp: int | None = None, tp: int | None = None, pp: int | None = None,
                micro_batch: int | None = None,
                num_microbatches: int | None = None, schedule: str | None = None, virtual_stages: int | None = None,
                zero: int | None = None, recompute: str | None = None, offload_optimizer: str | None = None,
                offload_params: bool | None = None, evict_bound: int | None = None,
                grad_reduce: str | None = None) -> Constraints:
    """The parts of a plan a user fixed (`snugfit plan` and `snugfit train` options of the same names), checked
    against the launch: one-line errors naming the fix for those that cannot work."""
    for flag, v in (("--dp", dp), ("--tp", tp), ("--pp", pp)):
        if v is not None and (v < 1 or world_size % v):
            raise SnugfitError(f"{flag} {v} does not divide the {world_size} ranks (GPUs) of the launch")
    if dp and pp and tp and dp * tp * pp != world_size:
        raise SnugfitError(f"--dp {dp} x --tp {tp} x --pp {pp} = {dp * tp * pp}, but the launch has {world_size} "
                           "ranks (GPUs)")
    if (dp or 1) * (tp or 1) * (pp or 1) > world_size or world_size % ((dp or 1) * (tp or 1) * (pp or 1)):
        raise SnugfitError(f"--dp x --tp x --pp must divide into the launch's {world_size} ranks (GPUs)")
    if tp and tp > 1 and (schedule == "bpipe" or offload_params or offload_optimizer not in (None, "none", "0")
                          or recompute in ("offload", "recompute_offload")):
        raise SnugfitError(f"--tp {tp} does not combine with BPipe or host offload yet; drop one of them")
    if pp and pp > 1 and num_microbatches and num_microbatches < pp:
        raise SnugfitError(f"--num-microbatches {num_microbatches} must be >= --pp {pp}")
    if offload_params and zero not in (None, 3):
        raise SnugfitError("--offload-params needs --zero 3 (parameters are offloaded as shards)")
    if schedule is not None and schedule not in SCHEDULES:
        raise SnugfitError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if grad_reduce is not None and grad_reduce not in GRAD_REDUCE:
        raise SnugfitError(f"--grad-reduce must be one of {', '.join(GRAD_REDUCE)}, got {grad_reduce!r}")
    if zero is not None and zero not in (0, 1, 2, 3):
        raise SnugfitError(f"--zero must be 0, 1, 2 or 3, got {zero}")
    policy = POLICY_ALIASES.get(recompute, recompute)
    if policy is not None and policy not in ACTIVATION_POLICIES:
        raise SnugfitError(f"--recompute must be one of {ACTIVATION_POLICIES}, got {recompute!r}")
    offload = {None: None, "all": True, "none": False, "0": False}.get(offload_optimizer, "?")
    if offload == "?":
        raise SnugfitError("--offload-optimizer in a search takes 'all' or 'none'; to offload the first N blocks, "
                           "give the whole plan (--pp, --micro-batch, --zero, --recompute)")
    return Constraints(dp=dp, tp=tp, pp=pp, micro_batch=micro_batch, num_microbatches=num_microbatches, schedule=schedule,
                       virtual_stages=virtual_stages, zero=zero, activations=policy, offload_optimizer=offload,
                       offload_params=offload_params or None, evict_bound=evict_bound, grad_reduce=grad_reduce)


def block_options(c: Constraints, dp: int, root: bool = False) -> list[BlockPlan]:
    """Every per-block decision the constraints allow. With dp 1, ZeRO 1 and 2 hold what ZeRO 0 holds, and ZeRO 3
    differs in memory only: FSDP2 gathers a unit's compute copy even on one rank, which ZeRO 3 frees after forward
    (the copy is the whole model again where the weights are stored in the compute dtype: bf16 masters)."""
    acts = ["keep"] if root else ([c.activations] if c.activations else list(ACTIVATION_POLICIES))
    out = []
    for z in [c.zero] if c.zero is not None else [0, 1, 2, 3]:
        for mode in ("none", "optimizer", "params", "stream"):
            params = mode == "params"
            if (params and z != 3) or (c.offload_params is not None and params != c.offload_params):
                continue
            if (c.offload_optimizer is not None and (mode == "optimizer") != c.offload_optimizer) or \
                    (dp == 1 and c.zero is None and z not in ((3,) if mode == "params" else (0, 3))):
                continue
            # streaming states pays where the device is short of memory, where ZeRO-3 holds the least too (and at
            # dp 1 costs no communication); "none": every unit's states on the device
            if mode == "stream" and (c.offload_optimizer is False or z != 3):
                continue
            out += [BlockPlan(z, mode == "optimizer", mode == "params", a, stream_states=mode == "stream")
                    for a in acts]
    return out


def describe(o: BlockPlan, root: bool = False) -> str:
    parts = [f"ZeRO-{o.zero}" if o.zero else "replicated"]
    parts += ["optimizer offload"] * o.offload_optimizer + ["parameter offload"] * o.offload_params
    parts += ["states streamed"] * o.stream_states
    acts = {"keep": "activations kept", "offload": "activations offloaded",
            "recompute_offload": "recompute, checkpoints offloaded",
            "selective_half": "selective, half the matmuls"}.get(o.activations, o.activations)
    return " + ".join(parts + ([] if root else [acts]))


def may_be_fastest(opts: list[BlockPlan]) -> list[BlockPlan]:
    """The options among which the fastest is, for lower bounds: offloading only adds time to the same work
    (copies over PCIe, the optimizer on the host), so where the constraints allow options that offload nothing,
    the fastest of them is as fast as any (tests/test_search.py checks it). Recomputation is not left out: it
    lengthens the backward that hides a block's gradient reduction."""
    lean = [o for o in opts if not (o.states_on_host or o.offloads_activations)]
    return lean or opts


def buffer_kinds(o: BlockPlan) -> int:
    """Once-per-stage buffers the option needs (`Searcher._buffers`): bit 1 ZeRO-3 prefetch copies, bit 2 the
    activation-offload window, bit 4 the checkpoint-offload window, bit 8 the streamed states' window."""
    return ((o.zero == 3) | 2 * (o.activations == "offload") | 4 * (o.activations == "recompute_offload")
            | 8 * o.stream_states)
