"""The activation policies: what a block keeps for its backward, what it recomputes, and where it keeps it.

One entry per policy, read by every layer: the profiler measures what each policy `keeps` (and what its
recomputation costs), the memory model holds it on the device or on host, the time model charges the
recomputation and the transfers, the search enumerates the entries, and runtime.activations applies them
(keyed by name, checked against this table at import). model.recompute reads `gemm_stride` to decide which
linear layers' outputs a selective policy keeps. Pure: no torch.

Adding a policy is an entry here (and, if it keeps something new, how model.recompute or runtime.activations
does it).
"""

from __future__ import annotations

from dataclasses import dataclass

from snugfit.errors import PlanError



@dataclass(frozen=True)
class ActivationPolicy:
    name: str
    words: str  # how `snugfit plan` describes a block under it
    keeps: str  # the profile's saved_bytes key (a policy the profiler runs) of what the block holds for backward
    recomputes: str = ""  # "" nothing, "forward" the whole forward, "cheap ops" the memory-bound ones (selective)
    on_host: bool = False  # what it keeps waits on host (copied back one block ahead of the backward)
    gemm_stride: int = 1  # selective: keep every n-th linear layer's output (1 all of them, 2 the 1st, 3rd, ...)
    # whether a backward may run twice over the block, as a split backward's I and W do (zero-bubble schedules);
    # torch's selective checkpoint allows one backward per region
    backward_twice: bool = True

    @property
    def recomputes_forward(self) -> bool:
        return self.recomputes == "forward"

    @property
    def selective(self) -> bool:
        return self.recomputes == "cheap ops"

    @property
    def timed_as(self) -> str:
        """The policy whose recomputation the profiler times for this one (host copies do not change it)."""
        return self.keeps


ACTIVATION_POLICIES: dict[str, ActivationPolicy] = {p.name: p for p in (
    ActivationPolicy("keep", "activations kept", keeps="keep"),
    ActivationPolicy("recompute", "recompute", keeps="recompute", recomputes="forward"),
    ActivationPolicy("selective", "selective", keeps="selective", recomputes="cheap ops", backward_twice=False),
    ActivationPolicy("selective_half", "selective, half the matmuls", keeps="selective_half", recomputes="cheap ops",
                     gemm_stride=2, backward_twice=False),
    ActivationPolicy("offload", "activations offloaded", keeps="keep", on_host=True),
    # full recomputation whose kept block input (the checkpoint) waits on host for the backward
    ActivationPolicy("recompute_offload", "recompute, checkpoints offloaded", keeps="recompute",
                     recomputes="forward", on_host=True),
)}
POLICY_NAMES = tuple(ACTIVATION_POLICIES)
ALIASES = {"none": "keep", "off": "keep", "full": "recompute"}  # accepted where a user names a policy
# What the profiler runs a block under: one checkpointed variant per way of recomputing (keep: none)
PROFILED = tuple(dict.fromkeys(p.keeps for p in ACTIVATION_POLICIES.values()))
RECOMPUTED = tuple(k for k in PROFILED if ACTIVATION_POLICIES[k].recomputes)  # model.recompute's policies
SELECTIVE = tuple(k for k in PROFILED if ACTIVATION_POLICIES[k].selective)


def policy(name: str) -> ActivationPolicy:
    """The entry of `name` (or an alias: none, off, full); an unknown name is a one-line error."""
    found = ACTIVATION_POLICIES.get(ALIASES.get(name, name))
    if found is None:
        raise PlanError(f"unknown activation policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    return found
KEEP = ACTIVATION_POLICIES["keep"]  # what the root pieces (embedding, final norm, head) do: no policy applies
