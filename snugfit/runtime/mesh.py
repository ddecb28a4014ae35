"""ParallelDims: the plan's pp x dp x cp x tp grid as one device mesh, and this rank's groups on it.

Every technique asks this object for its ranks and groups instead of computing them: FSDP2 shards over
`shard` (dp x cp, flattened: context-parallel ranks hold the same parameters, as data-parallel ones do), zero-0
units replicate over `replicate` (that x a size-1 dim, HSDP with one-rank shard groups), tensor parallelism splits
over `tp`, context parallelism's all-to-alls run over `cp_group`, pipeline stages talk over `pipeline_group`.
Expert parallelism has a mesh of its own over the same ranks, `experts`: the dp x cp ranks split into
(dp x cp / ep) x ep, experts split over `ep_mesh` and FSDP2-sharded over `expert_shard` (the ranks holding the
same experts). Rank arithmetic itself is `plan.RankLayout`'s (tp innermost, so tensor-parallel peers share a node;
an ep group is ep consecutive dp x cp ranks).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from snugfit.plan import Plan
from snugfit.runtime.dist import DistEnv, cached_group


@dataclass
class ParallelDims:
    plan: Plan
    rank: int
    world: DeviceMesh  # dims ("pp", "dp", "cp", "one", "tp"), and "dp_cp": dp and cp flattened
    experts: DeviceMesh | None = None  # at ep > 1: dims ("pp", "edp", "eone", "ep", "tp"), edp x ep = dp x cp

    @classmethod
    def of(cls, plan: Plan, env: DistEnv) -> "ParallelDims":
        """The mesh of `plan` (made once per process group and shape, see `cached_group`), its groups bounded
        by env.timeout_s like the default group."""
        shape = (plan.pp, plan.dp, plan.cp, 1, plan.tp)
        world = cached_group(("mesh", env.device.type, *shape, env.timeout_s), lambda: _bounded(
            _flattened(init_device_mesh(env.device.type, shape, mesh_dim_names=("pp", "dp", "cp", "one", "tp"))),
            env.timeout_s))
        experts = None
        if plan.ep > 1:
            shape = (plan.pp, plan.shard_ranks // plan.ep, 1, plan.ep, plan.tp)
            experts = cached_group(("experts", env.device.type, *shape, env.timeout_s), lambda: _bounded(
                init_device_mesh(env.device.type, shape, mesh_dim_names=("pp", "edp", "eone", "ep", "tp")),
                env.timeout_s))
        return cls(plan, env.rank, world, experts)

    @property
    def pp_rank(self) -> int:
        return self.plan.layout.coords(self.rank)[0]

    @property
    def dp_rank(self) -> int:
        return self.plan.layout.coords(self.rank)[1]

    @property
    def cp_rank(self) -> int:
        return self.plan.layout.cp_rank(self.rank)

    @property
    def dp(self) -> int:
        return self.plan.dp

    @property
    def shard_size(self) -> int:
        """The ranks FSDP2 shards over: dp x cp."""
        return self.plan.dp * self.plan.cp

    @property
    def tp(self) -> int:
        return self.plan.tp

    @property
    def shard(self) -> DeviceMesh:
        """This rank's data-parallel x context-parallel mesh: what FSDP2 shards over."""
        return _flat(self.world, "dp_cp")

    @property
    def replicate(self) -> DeviceMesh:
        """(dp x cp) x 1: zero-0 units as HSDP whose shard groups have one rank (see runtime.sharding)."""
        return _flat(self.world, "dp_cp", "one")

    @property
    def ep_mesh(self) -> DeviceMesh:
        """This rank's expert-parallel group (ep > 1 only): the ranks its MoE layers' experts are split over."""
        return self.experts["ep"]

    @property
    def expert_shard(self) -> DeviceMesh:
        """The dp x cp / ep ranks holding the same experts as this one: what FSDP2 shards and reduces them over."""
        return self.experts["edp"]

    @property
    def expert_replicate(self) -> DeviceMesh:
        """`expert_shard` x 1: zero-0 experts as HSDP whose shard groups have one rank (as `replicate`)."""
        return self.experts["edp", "eone"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.world["tp"]

    @property
    def cp_group(self):
        """The context-parallel process group (the all-to-alls around attention), or None at cp 1."""
        return self.world["cp"].get_group() if self.plan.cp > 1 else None

    @property
    def dp_group(self):
        """The ranks that share the step's tokens, data-parallel x context-parallel (loss averaging, target
        counts), or None where it is this rank alone."""
        return self.shard.get_group() if self.shard_size > 1 else None

    def pipeline_groups(self, timeout_s: float, bpipe: bool):
        """This rank's pipeline group and BPipe eviction group (None without BPipe): the pp ranks that share its
        other coordinates (plan.RankLayout.pipeline_group).

        Built with new_group (every rank creates every group, in the same order) so they carry their own timeout:
        a dead peer then fails the step within timeout_s.
        """
        layout, timeout = self.plan.layout, timedelta(seconds=timeout_s)
        mine = (None, None)
        for first in layout.stage_ranks(0):
            ranks = layout.pipeline_group(first)
            g = cached_group(("pipeline", *ranks, timeout_s), lambda: dist.new_group(ranks, timeout=timeout))
            e = (cached_group(("evict", *ranks, timeout_s), lambda: dist.new_group(ranks, timeout=timeout))
                 if bpipe else None)
            if self.rank in ranks:
                mine = (g, e)
        return mine


def _flat(mesh: DeviceMesh, *names: str) -> DeviceMesh:
    """mesh[names], a flattened dimension among them. torch warns that it will want such slices kept apart from the
    root mesh, but FSDP2 over tensor-parallel DTensors needs both on one root (as torchtitan's dp_shard_cp)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Slicing a flattened dim", UserWarning)
        return mesh[names]


def _flattened(mesh: DeviceMesh) -> DeviceMesh:
    """`mesh` with its dp and cp dimensions flattened into "dp_cp" too (torch keeps it on the root mesh)."""
    mesh["dp", "cp"]._flatten("dp_cp")
    return mesh


def _bounded(mesh: DeviceMesh, timeout_s: float) -> DeviceMesh:
    """Give every group of `mesh` the run's timeout. DeviceMesh makes its sub-groups (any dimension smaller than
    the world) with torch's default of 30 min for gloo, 10 for NCCL, whatever init_process_group was given: one
    stopped rank of a dp x tp job then hung its peers that long. init_device_mesh takes a timeout only inside
    backend-specific options objects, so it is set on the groups once made (torch's own _set_pg_timeout)."""
    for group in mesh.get_all_groups():
        if group is not dist.group.WORLD:  # the default group has the run's timeout already
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)
    return mesh
