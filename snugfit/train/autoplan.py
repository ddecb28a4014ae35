"""`--plan auto` (the default): measure this machine once, profile the model, search the plan for the launched
ranks, and explain it."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from snugfit.calibrate.corrections import planning_inputs
from snugfit.config import RunConfig, optimizer_plan
from snugfit.errors import PeerFailed, SnugfitError
from snugfit.hardware.cluster import Cluster, Node, get_link, make_node, parse_cluster
from snugfit.model.catalogue import block_count, resolve_model
from snugfit.plan import Plan, PlanError
from snugfit.runtime.dist import DistEnv

log = logging.getLogger("snugfit")
MEASURE_WAIT_S = 600  # how long other ranks wait for rank 0's first measurement of this machine and the search


def local_cluster(env: DistEnv) -> Cluster:
    """The launched ranks as a cluster (cluster_here), from inside one of them."""
    return cluster_here(env.device, env.world_size, int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size)))


def cluster_here(device: torch.device, world_size: int, per_node: int) -> Cluster:
    """`world_size` ranks, `per_node` on each node, as a cluster: N x this machine's CPU, or this node's GPUs on
    each node, with this host: the card and host as `snugfit profile-hardware` measured them here, else the
    catalogue's entry for the card's name, else the card measured now (never refused). The launcher calls it
    too, before any rank starts: it only reads the device's properties (no CUDA context is made) unless the card
    is unknown and must be measured."""
    if device.type == "cpu":
        return parse_cluster(f"{world_size}xcpu")
    from snugfit.hardware.catalogue import Host, Link, gpu_for_device, host_ram, load_local, measured_card
    from snugfit.calibrate.hardware import measure_accelerator
    from snugfit.runtime.dist import disable_p2p_without_peer_access

    nodes = world_size // per_node if world_size % per_node == 0 else 1
    per_node = world_size // nodes
    props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    name = props.name if props else device.type
    host = Host(ram_bytes=host_ram(), cores=os.cpu_count() or 1)
    local = load_local()
    measured = measured_card(name, props.total_memory, props.multi_processor_count, local) if props else None
    gpu = measured or gpu_for_device(name, props.total_memory if props else None)
    if measured is not None:  # `snugfit profile-hardware` ran here: its figures override the catalogue's
        log.info("planning with %s and this host as profile-hardware measured them", name)
        node = make_node(gpu.name, per_node, host=local.host, custom={gpu.name: gpu})
    elif gpu is not None:
        node = make_node(gpu.name, per_node, host=host)
    else:
        gpu, pcie = measure_accelerator(name)
        log.warning("GPU %r is not in snugfit's catalogue: planning with its measured rates (%s TFLOPS, "
                    "%.0f GB/s memory, %.1f GB/s host link); add it to a cluster TOML to plan elsewhere", name,
                    ", ".join(f"{d} {t:.0f}" for d, t in gpu.tflops.items()), gpu.hbm_gbps, pcie.gbps)
        node = Node(gpu, per_node, pcie, pcie, host)
    if device.type == "cuda" and disable_p2p_without_peer_access(per_node, torch.cuda.can_device_access_peer):
        # each byte crosses PCIe twice, out to host memory and in to the peer, over one root complex
        node.intra = Link(f"{node.pcie.name}-via-host", node.pcie.gbps / 2, 2 * node.pcie.latency_s)
    inter = get_link(gpu.inter) if nodes > 1 else node.intra
    return Cluster([replace(node) for _ in range(nodes)], inter, f"{nodes}x{per_node}x{gpu.name}")


def launch_device() -> torch.device:
    """The device the launched ranks will train on, as the launcher sees it: the first accelerator (without
    selecting it, which would give the launcher a CUDA context of its own), else the CPU."""
    if torch.accelerator.is_available():
        return torch.device(torch.accelerator.current_accelerator().type, 0)
    return torch.device("cpu")


def run_dtype(requested: str, device: torch.device) -> tuple[str, str]:
    """The compute dtype for this launch's device (plan.dtype.choose_dtype; bf16 as torch finds the device)."""
    from snugfit.plan.dtype import choose_dtype

    if device.type == "cuda":
        has_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        return choose_dtype(requested, torch.cuda.get_device_name(device.index or 0), has_bf16, on_cpu=False)
    return choose_dtype(requested, device.type, True, on_cpu=device.type == "cpu")


def plan_for_launch(cfg: RunConfig, nproc: int, nnodes: int = 1) -> str:
    """`--plan auto` under `snugfit train --nproc N`: the launcher measures this machine (CPU ranks), profiles the
    model, searches and validates the plan once, before any rank starts, so that a plan error is one line and
    starts nothing. Returns the plan as JSON, which the ranks read (runtime.launch hands it to them)."""
    device = launch_device()
    world = nproc * nnodes
    fixed = fixed_constraints(cfg, world)
    dtype, _ = run_dtype(cfg.train.dtype, device)
    cfg = replace(cfg, train=replace(cfg.train, dtype=dtype))
    return _search(cfg, lambda: cluster_here(device, world, nproc), nproc, device, fixed).to_json()


def read_plan_file(path: str | Path, what: str) -> Plan:
    """A plan JSON from a file, or one line saying why it is none."""
    try:
        return Plan.from_json(Path(path).read_text())
    except OSError as e:
        raise SnugfitError(f"cannot read plan {path}: {e.strerror}; pass an existing plan JSON") from None
    except (ValueError, TypeError) as e:
        raise SnugfitError(f"{what} is not a valid plan: {e}") from None


def check_plan_file(cfg: RunConfig, world_size: int) -> None:
    """A plan file given to a launch, checked before any rank starts against what the launcher knows without
    building the model: that it is a plan, of this model's blocks (the first thing a plan of another model gets
    wrong), for these ranks. The ranks check the rest (batch, sequence, optimizer: train.loop)."""
    path = Path(cfg.parallel.plan)
    plan = read_plan_file(path, f"plan {path}")
    n_blocks = block_count(resolve_model(cfg.model.name) if cfg.model.name else cfg.model)
    if len(plan.blocks) != n_blocks:
        raise SnugfitError(f"plan {path} has {len(plan.blocks)} block decisions but the model has {n_blocks} "
                           "blocks: it is another model's; re-plan (snugfit plan --json) for this one")
    try:
        plan.validate(n_blocks=n_blocks, world_size=world_size)
    except PlanError as e:
        raise SnugfitError(f"plan {path}: {e}") from None


def search_plan(cfg: RunConfig, env: DistEnv) -> Plan:
    """The fastest plan that fits, found on rank 0 and sent to every rank (the profile cache is written once), for
    ranks started without snugfit's launcher (`torchrun ... -m snugfit train`). A search that fails is rank 0's one
    line; the others exit quietly (errors.PeerFailed)."""
    fixed = fixed_constraints(cfg, env.world_size)  # on every rank: a bad one fails them all alike

    def decide() -> str | SnugfitError:
        try:
            return _search(cfg, lambda: local_cluster(env), env.world_size, env.device, fixed).to_json()
        except SnugfitError as e:
            return e

    found = decided_on_main(decide, env)
    if isinstance(found, SnugfitError):
        raise found if env.is_main else PeerFailed(f"rank 0: {found}")
    return Plan.from_json(found)


def decided_on_main(decide, env: DistEnv):
    """decide() run on rank 0, its (picklable) result sent to every rank. The others wait up to MEASURE_WAIT_S:
    rank 0 may first measure this machine (tens of seconds on CPU), longer than a collective's timeout."""
    result = [None]
    multi = dist.is_initialized() and env.world_size > 1
    patient = dist.new_group(backend="gloo", timeout=timedelta(seconds=MEASURE_WAIT_S)) if multi else None
    if env.is_main:
        result[0] = decide()
    if multi:
        dist.broadcast_object_list(result, src=0, group=patient)
        dist.destroy_process_group(patient)
    return result[0]


def _profile(cfg: RunConfig, micro_batch_size: int, device: torch.device, compile: bool):
    """The run's model profiled for the planner, its blocks eager or as torch.compile runs them."""
    from snugfit.profile.cache import profile_model

    model = cfg.model if not cfg.model.name else resolve_model(cfg.model.name, cfg.model.attention)
    return profile_model(model, micro_batch_size=micro_batch_size, seq_len=cfg.train.seq_len, dtype=cfg.train.dtype,
                         lora_rank=cfg.finetune.lora_rank or None, lora_targets=cfg.finetune.lora_targets,
                         frozen=cfg.finetune.freeze or None,
                         quantize_base=cfg.finetune.quantize_base, kernels="cpu" if device.type == "cpu" else "gpu",
                         compile=compile, pack=cfg.data.packs)


def predicted_timeline(cfg: RunConfig, env: DistEnv, plan: Plan):
    """The time model's simulation of `plan` on the launched ranks, to draw beside a measured step, on what the
    plan was predicted with: this machine's measurement, the plan's own corrections (Prediction.corrections, not
    those this run's calibration may have stored since) and the model profiled at the plan's micro-batch for it; and the one line that says why its step is not the
    plan's, where it is not (report.timeline.differs_why; else None)."""
    from snugfit.plan.corrections import TimeCorrections, on_cluster
    from snugfit.report.timeline import differs_why, timeline_for

    pred = plan.predicted
    cluster = on_cluster(local_cluster(env), TimeCorrections(factors=dict(pred.corrections) if pred else {}))
    micro = pred.profiled_micro_batch if pred and pred.profiled_micro_batch else plan.micro_batch_size
    sim, detail = timeline_for(plan, _profile(cfg, micro, env.device, plan.compile), cluster)
    return sim, detail, differs_why(plan, detail.step_s)


def measure_once(ranks: int, on_cpu: bool = True) -> None:
    """Measure this machine when the planner has no measurement of it yet (cached for later runs).

    Only CPU ranks need it (GPUs come from the catalogue, or from `snugfit profile-hardware`'s measurement of
    the card where one was taken: local_cluster). For more than one rank it
    also measures collectives and FSDP2's costs between local processes, which it
    must start itself: `snugfit train --nproc N` does that before launching. A rank
    of a job already running cannot (its process group would be inherited), so it
    measures the rest and says how to complete it.
    """
    from snugfit.hardware.catalogue import hardware_cache_path, load_local
    from snugfit.calibrate.hardware import profile_hardware

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


def measure_compiled_once() -> None:
    """Where compiled blocks are planned on CPU ranks: what their kernel launches cost here, measured once (it
    compiles a tiny block) and kept with this machine's measurement."""
    from snugfit.calibrate.hardware import measure_compiled
    from snugfit.hardware.catalogue import load_local

    local = load_local()
    if local is not None and not local.compiled:
        log.info("measuring what a compiled block's kernel launches cost here, once (it compiles a tiny block)")
        measure_compiled(local)


def fixed_constraints(cfg: RunConfig, world_size: int):
    """The parts of the plan the run's [parallel] options fix (the micro-batch from train.micro_batch_size)."""
    from snugfit.plan.options import fixed_parts_of

    return fixed_parts_of(cfg.parallel, cfg.train.micro_batch_size, world_size)


def _search(cfg: RunConfig, cluster_of: Callable[[], Cluster], ranks: int, device: torch.device, fixed) -> Plan:
    """The auto plan for the cluster `cluster_of` builds (`ranks` local ranks: calibrate.corrections.planning_inputs), logged."""
    from snugfit.plan.compile_choice import search_compiled_or_eager
    from snugfit.plan.advice import advise
    from snugfit.plan.explain import format_result
    from snugfit.plan.search import NoPlanError

    t = cfg.train
    if t.compile and device.type == "cpu":
        measure_compiled_once()
    cluster, corrected = planning_inputs(cluster_of, _profile(cfg, 1, device, False), ranks, measure_once)
    if corrected:  # what a run measured here, where one did
        log.info(corrected)
    try:
        chosen = search_compiled_or_eager(lambda compiled: _profile(cfg, 1, device, compiled), cluster,
                                          compile=t.compile, steps=t.steps, global_batch=t.batch_size,
                                          constraints=fixed, alternatives=0, optimizer=optimizer_plan(t))
    except NoPlanError as e:
        if not e.result.candidates:
            raise SnugfitError(f"--plan auto: {e}") from None
        advice = advise(_profile(cfg, 1, device, bool(t.compile)), cluster, global_batch=t.batch_size,
                        constraints=fixed, memory_budget=None, optimizer=optimizer_plan(t))  # the
        # binding limit and the smallest change that lifts it, first
        raise SnugfitError(f"--plan auto: {e}; {advice[0]}") from None
    best = chosen.result.best
    try:  # what the ranks will check again: a plan for this model and these ranks
        best.validate(n_blocks=len(chosen.profile.blocks), world_size=cluster.world_size)
    except PlanError as e:
        raise SnugfitError(f"--plan auto: {e}") from None
    log.info("auto plan for %s:\n%s", cluster_name(cluster), format_result(chosen.result, cluster)
             + (f"\n{chosen.note}" if chosen.note else ""))
    return best


def cluster_name(cluster) -> str:
    return f"{cluster.world_size} x {cluster.gpu_of(0).name}"
