"""estimate(plan, profile, cluster) -> Prediction: will the step fit, and how long will it take."""

from __future__ import annotations

from dataclasses import dataclass

from snugfit.hardware.cluster import Cluster
from snugfit.plan.corrections import corrected
from snugfit.plan.facts import ModelFacts
from snugfit.plan.cpu_ranks import cpu_tp_time
from snugfit.plan.footprint import largest_tensor_bytes
from snugfit.plan.memory import RankMemory, device_bytes, host_bytes, rank_memory
from snugfit.plan.optimizer import master_bytes
from snugfit.plan.piece_memory import StagePiece, host_saved, rank_stages
from snugfit.plan.plan import Plan, PlanError, Prediction
from snugfit.plan.schedules import partner
from snugfit.plan.simulate import SimResult, simulate, split_backward
from snugfit.plan.step_terms import step_terms
from snugfit.plan.timing import (
    StageTime, TensorParallel, gather_every, grad_reduce_exposed, optimizer_time, reductions, stage_time,
    transfer_time,
)
from snugfit.plan.context_parallel import ContextParallel, context_split
from snugfit.profile.types import ModelProfile

HOST_USABLE = 0.9  # leave the OS and the data loader some host memory


def _check(plan: Plan, prof: ModelProfile, cluster: Cluster) -> None:
    plan.validate(n_blocks=len(prof.blocks), facts=ModelFacts.of_profile(prof))
    if plan.world_size != cluster.world_size:
        raise PlanError(
            f"plan uses {plan.world_size} ranks (dp {plan.dp} x tp {plan.tp} x pp {plan.pp}) but the cluster has "
            f"{cluster.world_size} GPUs; choose dp x tp x pp = {cluster.world_size}"
        )
    if plan.seq_len != prof.seq_len:
        raise PlanError(f"profile is for seq_len {prof.seq_len}, plan for {plan.seq_len}; re-profile")
    if plan.compute_dtype != prof.dtype:
        raise PlanError(f"profile is in {prof.dtype}, plan computes in {plan.compute_dtype}; re-profile")


def _dp_group(plan: Plan, pp_rank: int) -> list[int]:
    """The data-parallel x context-parallel group of pipeline rank pp_rank's first rank, which FSDP2 shards over
    (its peers talk alike)."""
    return plan.layout.shard_group(plan.layout.rank(pp_rank))


def _tensor_parallel(plan: Plan, prof: ModelProfile, cluster: Cluster, rank: int) -> TensorParallel | None:
    if plan.tp == 1:
        return None
    node = cluster.nodes[cluster.node_of(rank)]
    return TensorParallel(plan.tp, cluster.link_for(plan.layout.tp_group(rank)), prof.micro_batch_size * prof.seq_len,
                          cpu_tp_time(node))


def _context_parallel(plan: Plan, prof: ModelProfile, cluster: Cluster, rank: int) -> ContextParallel | None:
    if plan.cp == 1:
        return None
    return ContextParallel.of(prof, plan.cp, cluster.link_for(plan.layout.cp_group(rank)), plan.tp)


def _rank_kinds(plan: Plan, cluster: Cluster) -> dict[int, int]:
    """rank -> the first rank alike to it (same pipeline rank, same kind of node, same data-parallel link).

    Alike ranks have the same times and memory, so estimate() computes each kind once: a
    1024-GPU plan then costs what its pipeline ranks cost, not 1024 walks of the schedule.
    """
    first: dict[tuple, int] = {}
    out = {}
    layout, nodes = plan.layout, [repr(n) for n in cluster.nodes]
    dp_links = [repr(cluster.link_for(_dp_group(plan, s))) for s in range(plan.pp)]
    tp_links: dict[tuple[int, int], str] = {}  # by tensor-parallel group: its members share it
    for rank in range(plan.world_size):
        pp_rank, dp_rank, _ = layout.coords(rank)
        if (pp_rank, dp_rank) not in tp_links:
            tp_links[pp_rank, dp_rank] = repr(cluster.link_for(plan.layout.tp_group(rank)))
        key = (pp_rank, nodes[cluster.node_of(rank)], dp_links[pp_rank], tp_links[pp_rank, dp_rank])
        out[rank] = first.setdefault(key, rank)
    return out


def stage_times(plan: Plan, prof: ModelProfile, cluster: Cluster) -> tuple[
        dict[int, dict[int, list[StagePiece]]], dict[int, int], dict[int, dict[int, StageTime]]]:
    """(pipeline rank -> stage -> pieces, rank -> its kind's first rank, kind rank -> stage -> times per microbatch).

    prof: already scaled to the plan's micro-batch size.
    """
    stages_of, kind, times = _stage_times(plan, prof, cluster)
    if plan.pp > 1 and any(n.gpu.name == "cpu" and n.count > n.host.cores for n in cluster.nodes):
        # more CPU ranks than cores slow each other only while they work, and pipeline ranks also wait: the
        # share of ranks working beside the schedule's work (transfers left out) sets how crowded the cores are
        fwd, bwd, split = _paces(plan, kind, times)
        sim = simulate(plan.schedule, plan.pp, plan.num_microbatches, fwd, bwd, v=plan.virtual_stages,
                       bound=plan.eviction_bound, split=split)
        _, _, times = _stage_times(plan, prof, cluster, busy=sim.working_share())
    return stages_of, kind, times


def _paces(plan: Plan, kind: dict[int, int], times: dict[int, dict[int, StageTime]]) -> tuple[
        list[float], list[float], list[tuple[float, float]] | None]:
    """(forward, backward, split backward or None) seconds per microbatch of each stage: its slowest data-parallel
    member's; a split backward (zero-bubble schedules) as `split_backward` divides it."""
    stages = range(plan.pp * plan.virtual_stages)
    group = [_dp_group(plan, plan.stage_rank(k)) for k in stages]
    fwd = [max(times[kind[r]][k].f_total for r in group[k]) for k in stages]
    bwd = [max(times[kind[r]][k].b_total for r in group[k]) for k in stages]
    if not plan.schedule_entry.splits_backward:
        return fwd, bwd, None
    slowest = [max((times[kind[r]][k] for r in group[k]), key=lambda t: t.b_total) for k in stages]
    split = split_backward(bwd, [st.wgrad for st in slowest], [st.recompute for st in slowest])
    return fwd, bwd, [(i + st.split_host / 2, w + st.split_host / 2) for (i, w), st in zip(split, slowest)]


def _stage_times(plan: Plan, prof: ModelProfile, cluster: Cluster, busy: float = 1.0) -> tuple[
        dict[int, dict[int, list[StagePiece]]], dict[int, int], dict[int, dict[int, StageTime]]]:
    """stage_times with the share of the ranks working at once given."""
    stages_of = {r: rank_stages(plan, prof, r) for r in range(plan.pp)}
    kind = _rank_kinds(plan, cluster)
    times: dict[int, dict[int, StageTime]] = {}
    for rank in sorted(set(kind.values())):
        pp_rank = plan.layout.coords(rank)[0]
        node = cluster.nodes[cluster.node_of(rank)]
        dp_link = cluster.link_for(_dp_group(plan, pp_rank))
        times[rank] = {
            k: stage_time(sps, node=node, dtype=plan.compute_dtype, reduce_dtype=plan.reduce_dtype, dp=plan.shard_ranks,
                          dp_link=dp_link, measured_on=prof.device, wrapped=not plan.runs_unwrapped,
                          pipelined=plan.pp > 1, busy=busy, tensor=_tensor_parallel(plan, prof, cluster, rank),
                          context=_context_parallel(plan, prof, cluster, rank), gathers=gather_every(plan.pp, plan.num_microbatches))
            for k, sps in stages_of[pp_rank].items()
        }
    return stages_of, kind, times


@dataclass
class RankStep:
    """One rank's step as estimate() computed it."""

    times: dict[int, StageTime]  # stage -> seconds per microbatch
    phases: dict[str, float]  # step time by phase (the slowest rank's bubble is what its phases leave)
    tail: dict[str, float]  # after the pipeline drains, in order: exposed "collective", "host optimizer", "optimizer"
    memory: RankMemory


@dataclass
class StepEstimate:
    """Everything estimate() computed on its way to the Prediction, per rank and per event; report.timeline
    draws it. Alike ranks share one RankStep (`kind`)."""

    prediction: Prediction
    sim: SimResult  # the schedule's events per pipeline rank
    stages: dict[int, dict[int, list[StagePiece]]]  # pipeline rank -> stage -> pieces
    kind: dict[int, int]  # rank -> the first rank alike to it
    ranks: dict[int, RankStep]  # by kind rank
    pace: list[int]  # per stage: the rank whose times set its pace (the slowest of its data-parallel group)
    p2p: list[float]  # per stage: seconds to send its output to the next stage
    move: list[float]  # per stage: seconds to evict (or load) one microbatch of its activations (BPipe)
    offload_move: list[float]  # per stage: one microbatch's activation offload transfer (overlapped)

    def rank(self, r: int) -> RankStep:
        return self.ranks[self.kind[r]]

    def stage_time(self, k: int) -> StageTime:
        """Stage k's times per microbatch, as the rank that sets its pace has them."""
        return self.rank(self.pace[k]).times[k]


def estimate(plan: Plan, profile: ModelProfile, cluster: Cluster, memory_budget_bytes: int | None = None) -> Prediction:
    """Predict per-rank peak memory by category and step time by phase; fills and returns plan.predicted.

    memory_budget_bytes caps what each GPU may use (default: its memory).
    """
    return estimate_step(plan, profile, cluster, memory_budget_bytes).prediction


def estimate_step(plan: Plan, profile: ModelProfile, cluster: Cluster,
                  memory_budget_bytes: int | None = None) -> StepEstimate:
    """estimate(), keeping what it computed on the way (fills plan.predicted too)."""
    _check(plan, profile, cluster)
    prof = context_split(profile.scaled(plan.micro_batch_size).split(plan.tp), plan.cp, plan.tp)
    pp, dp, m, v = plan.pp, plan.shard_ranks, plan.num_microbatches, plan.virtual_stages
    n_stages = pp * v
    notes: list[str] = []
    if profile.micro_batch_size != plan.micro_batch_size:
        notes.append(f"profile scaled linearly from micro-batch {profile.micro_batch_size}")

    stages_of, kind, times = stage_times(plan, prof, cluster)
    p2p, move, offload_move = [0.0] * n_stages, [0.0] * n_stages, [0.0] * n_stages
    first = plan.layout.rank  # the first rank of a pipeline rank's dp x tp group: its peers talk alike
    on = plan.stage_rank
    for k in range(n_stages):
        sps = stages_of[on(k)][k]
        if k + 1 < n_stages:
            p2p[k] = transfer_time(sps[-1].piece.output_bytes, cluster.link_for([first(on(k)), first(on(k + 1))]))
        saved = sum(sp.piece.saved_bytes["keep"] for sp in sps)
        move[k] = transfer_time(saved, cluster.link_for([first(on(k)), first(partner(pp, on(k)))]))
        offload_move[k] = transfer_time(sum(host_saved(sp) for sp in sps),
                                        cluster.nodes[cluster.node_of(first(on(k)))].pcie)
    fwd, bwd, split = _paces(plan, kind, times)
    sim = simulate(plan.schedule, pp, m, fwd, bwd, v=v, p2p=p2p, bound=plan.eviction_bound, move=move, split=split)
    split_extra = [2 if split and k else 1 for k in range(n_stages)]  # a split backward's W recomputes again

    # -- per-rank totals --
    ranks, step, phases_of = {}, -1.0, {}
    staging = largest_tensor_bytes(prof)  # one whole weight at start-up
    for rank in sorted(set(kind.values())):
        pp_rank = plan.layout.coords(rank)[0]
        node = cluster.nodes[cluster.node_of(rank)]
        rm = rank_memory(plan, prof, node.gpu, rank, sim, staging)
        notes += rm.notes
        sts = times[rank]
        pieces = [sp for k in sorted(sts) for sp in stages_of[pp_rank][k]]
        bwd_last = sum(st.bwd + st.recompute for st in sts.values())
        reduce = grad_reduce_exposed(
            [(sts[k], stages_of[pp_rank][k]) for k in sorted(sts)], dp, cluster.link_for(_dp_group(plan, pp_rank)),
            bwd_last, cpu=node if node.gpu.name == "cpu" else None)
        opt_dev, opt_host = optimizer_time(pieces, gpu=node.gpu, host=node.host, dp=dp, dtype=plan.compute_dtype,
                                           reduce_dtype=plan.reduce_dtype, pcie=node.pcie,
                                           ranks_on_host=node.count, bwd_last=bwd_last,
                                           grad_copies=reductions(plan.grad_reduce, m), optimizer=plan.optimizer)
        terms = step_terms([(st, split_extra[k]) for k, st in sts.items()],
                           reduce=corrected("dp_comm_exposed", reduce, node),
                           host_step=corrected("offload_exposed", opt_host, node),
                           device_step=corrected("optimizer", opt_dev, node),
                           every_microbatch=plan.grad_reduce == "microbatch", split=bool(split),
                           sync=corrected("dp_comm_exposed", tied_sync_time(plan, prof, cluster, pp_rank), node))
        phases, tail = terms.phases(m, sim.bubble(pp_rank) if pp > 1 else 0.0), terms.tail(m)
        ranks[rank] = RankStep(sts, phases, tail, rm)
        total = sim.makespan + terms.reduces(m) + terms.host_step + phases["optimizer"]  # the tail's, in its order
        if total > step:
            step, phases_of = total, phases
    bubble = step - sum(v_ for k_, v_ in phases_of.items() if k_ != "bubble")
    phases_of["bubble"] = bubble if bubble > 1e-9 * step else 0.0  # not the rounding of the others' sum
    pred = _finish(plan, prof, cluster, [ranks[kind[r]].memory for r in range(plan.world_size)], step,
                   phases_of, sim, notes, memory_budget_bytes)
    pred.tracked_by_rank = [ranks[kind[r]].memory.tracked for r in range(plan.world_size)]
    pred.profiled_micro_batch = profile.micro_batch_size  # before scaling (Prediction.profiled_micro_batch)
    pace = [max(_dp_group(plan, on(k)), key=lambda r, k=k: times[kind[r]][k].b_total) for k in range(n_stages)]
    return StepEstimate(pred, sim, stages_of, kind, ranks, pace, p2p, move, offload_move)


def tied_sync_time(plan: Plan, prof: ModelProfile, cluster: Cluster, pp_rank: int) -> float:
    """Seconds pipeline rank pp_rank spends after backward summing its copy's gradient of a tied weight with the
    other's (runtime.tied_embeddings: an all-reduce of the first and the last stage's ranks, their local shards);
    none where one rank holds both stages, or the weight is frozen."""
    first, last = plan.stage_rank(0), plan.stage_rank(len(plan.stage_ranges()) - 1)
    if not (prof.tied_params and prof.embed.num_trainable) or first == last or pp_rank not in (first, last):
        return 0.0
    shard = -(-prof.tied_params // (plan.dp if plan.root.zero >= 1 else 1))
    link = cluster.link_for([plan.layout.rank(first, 0, 0), plan.layout.rank(last, 0, 0)])
    return transfer_time(shard * master_bytes(plan.optimizer), link)


def node_host_need(plan: Plan, prof: ModelProfile, cluster: Cluster, mem: list[dict[str, int]],
                   node: int) -> tuple[int, int]:
    """Host bytes a node needs while training (its ranks' host memory; on CPU ranks all of their memory) and
    at start-up (that, and each rank's one whole tensor while its shards are filled)."""
    ranks = cluster.ranks_of(node)
    on_cpu = cluster.nodes[node].gpu.name == "cpu"
    need = sum(host_bytes(mem[r]) + (device_bytes(mem[r]) if on_cpu else 0) for r in ranks)
    return need, need + len(ranks) * largest_tensor_bytes(prof)


def _finish(plan: Plan, prof: ModelProfile, cluster: Cluster, memory: list[RankMemory], step: float,
            phases: dict[str, float], sim: SimResult, notes: list[str], budget: int | None) -> Prediction:
    mem = [rm.cats for rm in memory]
    peak = max(device_bytes(c) for c in mem)
    gpu_mem = min(cluster.gpu_of(r).memory_bytes for r in range(plan.world_size))
    budget = min(budget, gpu_mem) if budget else gpu_mem
    # a rank's device bytes before its first step: its parameter shards and one whole tensor in fp32 (the copy
    # into a shard of another dtype stages it on the device)
    start_device = max(rm.footprint.startup.total for rm in memory)
    fits = all(device_bytes(c) <= budget for c in mem) and start_device <= budget
    start_host, host, over = 0, {}, []
    for i, node in enumerate(cluster.nodes):
        need, start = node_host_need(plan, prof, cluster, mem, i)
        start_host = max(start_host, start)
        if not host or start / node.host.ram_bytes > host["startup"] / host["ram"]:
            host = {"node": i, "training": need, "startup": start, "ram": node.host.ram_bytes,
                    "assumed": node.host.ram_assumed}
        if start > HOST_USABLE * node.host.ram_bytes:  # the start-up peak is the larger: each rank fills its
            fits = False                                # shards one whole tensor at a time
            over.append((i, need, start))
    # the node closest to its RAM is the verdict's (explain.verdict_line); others over it are notes
    notes += [f"node {i}: host memory {need / 2**30:.1f} GiB while training, {start / 2**30:.1f} GiB at start-up, "
              f"over {HOST_USABLE:.0%} of its RAM" for i, need, start in over if i != host["node"]]
    if any("reserve" in c for c in mem):
        notes.append("reserve = CUDA context + 5% allocator fragmentation")
    flops = prof.train_flops() * plan.num_microbatches * plan.shard_ranks * plan.tp  # prof: one tp x cp rank's
    peak_rate = sum(cluster.gpu_of(r).tflops.get(plan.compute_dtype, 0.0) * 1e12 for r in range(plan.world_size))
    pred = Prediction(
        peak_memory_bytes=peak, memory_by_rank=mem, step_time_s=step, time_by_phase=phases,
        tokens_per_s=plan.tokens_per_step / step if step else 0.0,
        mfu=flops / (step * peak_rate) if step and peak_rate else 0.0,
        fits=fits, memory_budget_bytes=budget, notes=notes,
        startup_bytes={"device": start_device, "host": start_host}, host_memory=host,
        compile_s=compile_seconds(plan, prof, cluster) if plan.compile else 0.0,
        corrections=dict(cluster.nodes[0].corrections),
    )
    plan.predicted = pred
    return pred


def compile_seconds(plan: Plan, profile: ModelProfile, cluster: Cluster) -> float:
    """Seconds the first step spends compiling: torch.compile builds one graph per distinct block (blocks alike in
    shape and activation policy reuse it), each kernel it generates at GPU.compile_kernel_s."""
    graphs = {(b.fwd_ops, b.bwd_ops, plan.blocks[i].activations) for i, b in enumerate(profile.blocks)}
    return sum(fwd + bwd for fwd, bwd, _ in graphs) * cluster.gpu_of(0).compile_kernel_s
