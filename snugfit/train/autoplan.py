"""`--plan auto` (the default): measure this machine once, profile the model, search the plan for the launched
ranks, and explain it."""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from snugfit.config import RunConfig
from snugfit.errors import SnugfitError
from snugfit.plan import Plan
from snugfit.runtime.dist import DistEnv

log = logging.getLogger("snugfit")
MEASURE_WAIT_S = 600  # how long other ranks wait for rank 0's first measurement of this machine and the search


def local_cluster(env: DistEnv) -> str:
    """The launched ranks as a cluster spec: N x this machine's CPU, or N x the local GPU from the catalogue."""
    if env.device.type == "cpu":
        return f"{env.world_size}xcpu"
    from snugfit.hardware.catalogue import get_gpu

    name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else env.device.type
    try:
        return f"{env.world_size}x{get_gpu(name.replace('NVIDIA ', '').replace(' ', '')).name}"
    except SnugfitError as e:
        raise SnugfitError(f"{e}; plan with `snugfit plan --cluster ...` and pass --plan FILE") from None


def search_plan(cfg: RunConfig, env: DistEnv) -> Plan:
    """The fastest plan that fits, found on rank 0 and sent to every rank (the profile cache is written once)."""
    plan_json = [None]
    multi = dist.is_initialized() and env.world_size > 1
    # rank 0 may first measure this machine (tens of seconds on CPU), longer than a collective's timeout
    patient = dist.new_group(backend="gloo", timeout=timedelta(seconds=MEASURE_WAIT_S)) if multi else None
    if env.is_main:
        plan_json[0] = _search(cfg, env).to_json()
    if multi:
        dist.broadcast_object_list(plan_json, src=0, group=patient)
        dist.destroy_process_group(patient)
    return Plan.from_json(plan_json[0])


def _profile(cfg: RunConfig, micro_batch_size: int):
    from snugfit.profile.profile import profile_model

    model = cfg.model if not cfg.model.name else _hf_config(cfg.model.name)
    return profile_model(model, micro_batch_size=micro_batch_size, seq_len=cfg.train.seq_len, dtype=cfg.train.dtype,
                         lora_rank=cfg.finetune.lora_rank or None)


def predicted_timeline(cfg: RunConfig, env: DistEnv, plan: Plan):
    """The time model's simulation of `plan` on the launched ranks, to draw beside a measured step."""
    from snugfit.hardware.cluster import parse_cluster
    from snugfit.report.timeline import timeline_for

    return timeline_for(plan, _profile(cfg, plan.micro_batch_size), parse_cluster(local_cluster(env)))


def measure_once(ranks: int, on_cpu: bool = True) -> None:
    """Measure this machine when the planner has no measurement of it yet (cached for later runs).

    Only CPU ranks need it (GPUs come from the catalogue). For more than one rank it
    also measures collectives and FSDP2's costs between local processes, which it
    must start itself: `snugfit train --nproc N` does that before launching. A rank
    of a job already running cannot (its process group would be inherited), so it
    measures the rest and says how to complete it.
    """
    from snugfit.hardware.catalogue import hardware_cache_path, load_local
    from snugfit.hardware.measure import profile_hardware

    local = load_local()
    multi = ranks > 1
    if not on_cpu or (local is not None and (not multi or local.host.fsdp)):
        return
    if multi and dist.is_initialized():
        log.warning("no measurement of collectives and FSDP2 costs between local ranks: the plan's time "
                    "estimates leave them out; run `snugfit profile-hardware` once to add them")
        if local is None:
            profile_hardware(collectives=False)
        return
    log.info("measuring this machine once for the planner (%s)%s", hardware_cache_path(),
             ", collectives and FSDP2 costs between local ranks included" if multi else "")
    profile_hardware(collectives=multi)


def _search(cfg: RunConfig, env: DistEnv) -> Plan:
    from snugfit.hardware.cluster import parse_cluster
    from snugfit.plan.explain import format_result
    from snugfit.plan.search import Constraints, NoPlanError, search

    t = cfg.train
    measure_once(env.world_size, env.device.type == "cpu")
    profile = _profile(cfg, 1)
    cluster = parse_cluster(local_cluster(env))
    micro = t.micro_batch_size or None
    try:
        res = search(profile, cluster, global_batch=t.batch_size, constraints=Constraints(micro_batch=micro),
                     alternatives=0)
    except NoPlanError as e:
        raise SnugfitError(f"--plan auto: {e}; try `snugfit plan` for the smallest change that fits") from None
    log.info("auto plan for %s:\n%s", cluster_name(cluster), format_result(res, cluster))
    return res.best


def cluster_name(cluster) -> str:
    return f"{cluster.world_size} x {cluster.gpu_of(0).name}"


def _hf_config(path: str) -> dict:
    import json
    from pathlib import Path

    p = Path(path)
    return json.loads((p / "config.json" if p.is_dir() else p).read_text())
