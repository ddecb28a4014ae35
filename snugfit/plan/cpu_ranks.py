"""What CPU ranks (gloo, on this machine) cost each other, for the time model (plan.timing).

Nothing overlaps on CPU ranks: collectives and compute share the same cores. Ranks slow each other's compute,
and FSDP2's gathers, copies, hooks and gradient reduction cost what profile_hardware measured among as many
local ranks (Host.fsdp: a fixed and a per-byte part, replicated and sharded units apart, measured for 2 ranks
and for twice the cores): on small models that is most of a multi-rank step. So are tensor parallelism's and
the pipeline runtime's own costs.
"""

from __future__ import annotations

from snugfit.hardware.cluster import Node
from snugfit.plan.corrections import corrected
from snugfit.plan.piece_memory import StagePiece, wrapped_params
from snugfit.profile.types import DTYPE_BYTES


def local_ranks(node: Node, busy: float = 1.0, group: int | None = None) -> tuple[dict[str, list[float]], float]:
    """(FSDP2 costs, how many times slower each rank runs) for the node's CPU ranks, from the measurement
    at the nearest rank count at or below theirs, slowed in proportion where they are more.

    busy: the share of the ranks working at any moment (below 1 where pipeline ranks wait on each other):
    the measured slowdown had all of them working, and ranks beyond the cores only slow the others while
    they work. group: the ranks FSDP2's collectives run among (the data-parallel group), when fewer than
    the node's: its costs come from the measurement among as many ranks (a ring of that many), and the
    crowding of the node's other ranks is in the slowdown, which callers divide by the measurement's own.
    Without a measurement: no FSDP2 costs, and ranks beyond the cores share them evenly.
    """
    measured = {int(k): v for k, v in node.host.fsdp.items()}
    if node.count == 1 or not measured:
        return {}, max(1.0, busy * node.count / node.host.cores)
    world = max([w for w in measured if w <= node.count], default=min(measured))
    more = max(1.0, node.count / world) if node.count > node.host.cores else 1.0
    members = max([w for w in measured if w <= min(group or node.count, node.count)], default=min(measured))
    return measured[members], max(1.0, busy * measured[world]["contention"][0] * more)


def cpu_share(node: Node, busy: float = 1.0) -> float:
    """How many times slower each rank computes because the node's ranks share its CPU (1 on GPUs):
    shared caches and memory bandwidth, the division of the cores among more ranks than cores, and, for more
    than one rank, their running one thread each (torchrun's OMP_NUM_THREADS=1) where the device's rates were
    measured with every core."""
    if node.gpu.name != "cpu":
        return 1.0
    one_thread = (node.host.thread_slowdown or 1.0) if node.count > 1 else 1.0
    return local_ranks(node, busy)[1] * one_thread


def cpu_tp_time(node: Node) -> float:
    """What tensor parallelism adds per piece and microbatch on CPU ranks beyond split compute and its
    collectives' bytes (DTensor's dispatch; profile_hardware measured it), 0 elsewhere."""
    if node.gpu.name != "cpu":
        return 0.0
    costs, share = local_ranks(node)
    return costs["tp"][0] * share / costs["contention"][0] if costs else 0.0


def cpu_stage_time(node: Node) -> float:
    """What the pipeline runtime itself costs per stage and microbatch on CPU ranks, as profile_hardware measured
    (in a pipeline, so with its ranks as busy as a pipeline's), corrected where a run measured it (the one place:
    the stage times, the cost model's bound and the solver's score all read it here)."""
    costs, share = local_ranks(node)
    return corrected("pipeline_runtime", costs["stage"][0] * share / costs["contention"][0], node) if costs else 0.0


def line_cost(cost: list[float], nbytes: float) -> float:
    """A measured [seconds, seconds per byte] cost at nbytes."""
    return cost[0] + cost[1] * nbytes


def fsdp_units(pieces: list[StagePiece], nbytes: list[float]) -> list[tuple[float, int, bool]]:
    """(bytes, zero, is a block) per FSDP2 unit of a stage, given bytes per piece: each block is its own unit,
    the root pieces (embedding, final norm, head) are one."""
    units = [(b, sp.decision.zero, True) for sp, b in zip(pieces, nbytes) if sp.is_block]
    root = [(b, sp.decision.zero) for sp, b in zip(pieces, nbytes) if not sp.is_block]
    return units + ([(sum(b for b, _ in root), root[0][1], False)] if root else [])


def cpu_fsdp_time(pieces: list[StagePiece], node: Node, dtype: str, dp: int, cost: str = "",
                  busy: float = 1.0, gathers: int = 1) -> float:
    """FSDP2's copies, hooks and gathers per microbatch on CPU ranks, from the costs profile_hardware measured:
    every unit (each block, and the stage's root: embedding/norm/head) as runtime/sharding.py wraps it —
    replicated (zero 0, or one data-parallel rank) or sharded and gathered in forward (zero-1/2 units once per
    `gathers` microbatches, hooks only on the others), zero-3 blocks again in backward. `cost`: instead, that one
    measured cost summed over the units."""
    costs, share = local_ranks(node, busy, group=dp)
    if not costs:
        return 0.0
    units = fsdp_units(pieces, [wrapped_params(sp, dp) * DTYPE_BYTES[dtype] for sp in pieces])
    if cost:
        return sum(line_cost(costs[cost], nbytes) for nbytes, _, _ in units) * share / costs["contention"][0]

    def forward(nbytes: float, zero: int) -> float:
        if not zero or dp == 1:
            return line_cost(costs["replicate"], nbytes)
        every = 1 if zero == 3 else gathers
        return (line_cost(costs["gather"], nbytes) + (every - 1) * line_cost(costs["replicate"], nbytes)) / every

    total = sum(forward(nbytes, zero) for nbytes, zero, _ in units)
    total += sum(line_cost(costs["regather"], nbytes)
                 for nbytes, zero, block in units if block and zero == 3 and dp > 1)
    # measured among ranks already running side by side: only more ranks than measured slow it further
    return total * share / costs["contention"][0]
