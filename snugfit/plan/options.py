"""What a block may choose: the user's fixed parts of a plan, and the per-block options they leave open.

Pure: the search enumerates these, the explanation names them.
"""

from __future__ import annotations

from dataclasses import dataclass

from snugfit.plan.plan import ACTIVATION_POLICIES, BlockPlan


@dataclass
class Constraints:
    """Parts of the plan fixed by the user; None = search it."""

    dp: int | None = None
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

    def fixed(self) -> dict:
        return {k: v for k, v in vars(self).items() if v is not None}


def block_options(c: Constraints, dp: int, root: bool = False) -> list[BlockPlan]:
    """Every per-block decision the constraints allow (with dp 1, ZeRO matters only for offload_params)."""
    acts = ["keep"] if root else ([c.activations] if c.activations else list(ACTIVATION_POLICIES))
    out = []
    for z in [c.zero] if c.zero is not None else [0, 1, 2, 3]:
        for mode in ("none", "optimizer", "params"):
            params = mode == "params"
            if (params and z != 3) or (c.offload_params is not None and params != c.offload_params):
                continue
            if (c.offload_optimizer is not None and (mode == "optimizer") != c.offload_optimizer) or \
                    (dp == 1 and c.zero is None and z != (3 if mode == "params" else 0)):
                continue
            out += [BlockPlan(z, mode == "optimizer", mode == "params", a) for a in acts]
    return out


def describe(o: BlockPlan, root: bool = False) -> str:
    parts = [f"ZeRO-{o.zero}" if o.zero else "replicated"]
    parts += ["optimizer offload"] * o.offload_optimizer + ["parameter offload"] * o.offload_params
    acts = {"keep": "activations kept", "offload": "activations offloaded"}.get(o.activations, o.activations)
    return " + ".join(parts + ([] if root else [acts]))
