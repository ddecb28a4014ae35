"""Memory model: bytes per rank, by category, at the rank's peak moment of a step.

The moments of a rank's step and what each holds are footprint.py (rank_footprint); here its busiest is a
rank's prediction, with the device's reserve and the host's bytes beside it.

Activations: each (stage, microbatch) a rank holds costs the bytes its pieces save
under their policy (profile.saved_bytes; "offload" and "recompute_offload" keep
none on device but a two-block window, and hold on host what the block saves, or
its input). Which ones are held comes from the schedule simulation. On top
comes a walk through the running stage's pieces (walks.py).

`tracked` predicts what runtime.memory.MemoryTracker reports: it sees tensors held
(parameters, gradients, optimizer states, saved activations, gathered copies), not
transients (logits before the loss, matmul outputs consumed at once), and it samples
gradients only between passes; so its peak is the held part of a step, without the
walk's working memory. Comparing it is how tests check the model on multi-rank CPU
runs, where no allocator sees the transients.
"""

from __future__ import annotations

from dataclasses import dataclass

from snugfit.hardware.catalogue import GPU
from snugfit.plan.footprint import RankFootprint, rank_footprint
from snugfit.plan.plan import Plan
from snugfit.plan.simulate import SimResult
from snugfit.profile.types import ModelProfile

FRAGMENTATION = 0.05  # allocator slack on GPUs (caching allocator rounding, fragmentation)
TRACKER_KEYS = {"parameters": "parameters", "frozen_parameters": "parameters", "comm_buffers": "buffers",
                "gradients": "gradients", "optimizer_states": "optimizer", "master_weights": "optimizer",
                "activations": "activations", "staging": "buffers", "reduce_buffers": "buffers"}


@dataclass
class RankMemory:
    """One rank's prediction: categories at its device peak (plus 'host:*'), notes, and the tracker's view."""

    cats: dict[str, int]
    notes: list[str]
    tracked: dict[str, int]  # MemoryTracker keys ("device.parameters", ..., "device.total", "host.total")
    footprint: RankFootprint  # every moment of the step, the peak's among them


def rank_memory(plan: Plan, prof: ModelProfile, gpu: GPU, rank: int, sim: SimResult, staging: int) -> RankMemory:
    """Categories of bytes on `rank` at its peak (device) plus 'host:*' categories, notes, and tracked peak;
    `staging`: footprint.largest_tensor_bytes."""
    fp = rank_footprint(plan, prof, plan.layout.coords(rank)[0], sim, staging)
    cats = dict(fp.static)
    for k, v in fp.moments[fp.peak].cats.items():
        cats[k] = cats.get(k, 0) + v
    notes = [f"rank {rank}: peak at the optimizer step"] if fp.peak == "step" else []
    if gpu.name != "cpu":
        cats["reserve"] = gpu.context_bytes + int(FRAGMENTATION * sum(cats.values()))
    cats = {k: v for k, v in cats.items() if v}
    cats.update({f"host:{k}": v for k, v in fp.host.items() if v})
    return RankMemory(cats, notes, _tracked(fp), fp)


def _tracked(fp: RankFootprint) -> dict[str, int]:
    """The MemoryTracker's peak: the held part of the step's busiest moment, or the optimizer step's."""
    moving = fp.tracked_step if sum(fp.tracked_step.values()) >= sum(fp.tracked_pass.values()) else fp.tracked_pass
    out: dict[str, int] = {}
    # offloaded activations live under their policy's own saved-tensor hooks, out of the tracker's sight
    host = {k: v for k, v in fp.host.items() if k != "activations"}
    for place, cats in (("device", fp.static), ("device", moving), ("host", host)):
        for k, v in cats.items():
            key = f"{place}.{TRACKER_KEYS.get(k, k)}"
            out[key] = out.get(key, 0) + v
    for place in ("device", "host"):
        out[f"{place}.total"] = sum(v for k, v in out.items() if k.startswith(place + "."))
    return out


def device_bytes(cats: dict[str, int]) -> int:
    return sum(v for k, v in cats.items() if not k.startswith("host:"))


def host_bytes(cats: dict[str, int]) -> int:
    return sum(v for k, v in cats.items() if k.startswith("host:"))

