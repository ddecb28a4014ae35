"""Where a unit's trainable state lives between steps, and where it is updated: one value per unit (BlockPlan).

One enum member per storage tier, so a combination that cannot run cannot be written, and each question the
planner and the runtime ask of a placement is a property answered here once. A further tier (NVMe: states in
files, paged in for the host's step) is one more member and its entries in the sets below, plus its memory and
time terms. Pure: no torch.
"""

from __future__ import annotations

from enum import Enum


class Placement(str, Enum):
    """A unit's state placement (its value is what plan JSON holds)."""

    DEVICE = "device"  # weights, gradients, fp32 masters and optimizer states on the device
    # fp32 master weights and optimizer states on host, stepped there; the compute weights stay on the device
    HOST_STEP = "host_step"
    # the parameters too (FSDP2's CPUOffloadPolicy), gathered to the device for each use and stepped on host;
    # needs zero 3 (they are offloaded as shards)
    PARAMS_ON_HOST = "params_on_host"
    # optimizer states on host, copied to the device for the unit's update and back (runtime.stream_states); the
    # weights and their gradients stay on the device
    STREAMED = "streamed"

    @property
    def steps_on_host(self) -> bool:
        """Whether the unit's optimizer step runs on the host (its masters and gradients cross PCIe)."""
        return self in _STEPS_ON_HOST

    @property
    def states_on_host(self) -> bool:
        """Whether the unit's optimizer states live on host between steps (updated there or on the device)."""
        return self is not Placement.DEVICE

    @property
    def params_on_host(self) -> bool:
        """Whether the unit's parameters wait on host between uses."""
        return self is Placement.PARAMS_ON_HOST

    @property
    def streams_states(self) -> bool:
        """Whether the unit's states come to the device for its update and go back after it."""
        return self is Placement.STREAMED

    @property
    def words(self) -> str:
        """How a plan's description names it ('' on the device)."""
        return _WORDS[self]


_STEPS_ON_HOST = frozenset({Placement.HOST_STEP, Placement.PARAMS_ON_HOST})
_WORDS = {Placement.DEVICE: "", Placement.HOST_STEP: "optimizer offload",
          Placement.PARAMS_ON_HOST: "parameter offload", Placement.STREAMED: "states streamed"}
