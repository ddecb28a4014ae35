"""Time model: seconds per piece, per collective, per transfer, and per optimizer step.

Compute: measured piece times (and recomputation overheads) when the profile was
timed on this very device, else a roofline sum: matmul FLOPs at the device's achievable rate plus the bytes
moved by memory-bound ops at its achievable bandwidth. Recompute adds a forward
("selective" only the memory-bound part, "selective_half" that and every second linear layer). Frozen weights
cost no weight-gradient matmuls: the profile's backward FLOPs were recorded with them frozen. Collectives
are what NCCL runs over the slowest link of the group (`collective_time`): rings at the
link's measured bus bandwidth, and for all-reduces across nodes the faster of a ring and
a tree (log2 of the nodes in latency).

As the runtime (FSDP2) communicates: every microbatch gathers each sharded unit in
forward (zero 1-3: FSDP2 reshards after backward; pipeline stages only after the
step's last one, so theirs are gathered once a step: `gather_every`) and zero-3 blocks
again in backward (the root unit stays gathered); gradients (trainable ones only) are
reduced once, in the last microbatch's backward (sync is off before it), or with grad_reduce "microbatch" in
every microbatch's (`reductions`).
What overlaps: gathers with the previous block's compute (prefetch), gradient
reduction with the backward that makes it, activation offload with the
block's compute, the host optimizer with the last backward; the rest is exposed.
A hidden collective is not free on a GPU: NCCL's kernels hold one SM per channel, so
the compute beside it runs on fewer SMs (`overlap_exposed`).

Where the device is this machine's CPU (gloo ranks), nothing overlaps, and what the ranks cost each other is
measured (plan.cpu_ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from snugfit.hardware.catalogue import GPU, Host, Link
from snugfit.hardware.cluster import Node
from snugfit.plan.corrections import IMBALANCE, corrected
from snugfit.plan.cpu_ranks import cpu_fsdp_time, cpu_share, cpu_stage_time, fsdp_units, line_cost, local_ranks
from snugfit.plan.kernels import attention_rates, gemm_seconds
from snugfit.plan.piece_memory import StagePiece, host_saved
from snugfit.plan.optimizer import host_step_slowdown, state_bytes, update_bytes
from snugfit.plan.plan import OptimizerPlan
from snugfit.plan.policies import ACTIVATION_POLICIES, ActivationPolicy
from snugfit.profile.types import DTYPE_BYTES, PieceProfile

# Host work of a split backward (zero-bubble schedules) per backward operator, in operator dispatches: torch's
# input pass walks the stage's autograd graph in Python to find what the weight pass needs, and the weight pass
# runs one autograd call per group of weights. Measured on CPU: a dim-64 decoder block (174 backward operators)
# took 1.45 ms more per microbatch split than whole, 3 of this machine's 2.8 us dispatches per operator.
SPLIT_BACKWARD_DISPATCHES = 3


# NCCL's own tuning model (src/graph/tuning.cc, NCCL 2.1x): a tree all-reduce reaches 90% of the ring's bus bandwidth,
# and at most 110 GB/s over 2 nodes, 80 GB/s over more
TREE_BUS_SHARE = 0.9
TREE_MAX_GBPS = (110.0, 80.0)
# NCCL runs one thread block (on one SM) per channel, and opens about as many channels as its bus bandwidth needs
# at up to ~24 GB/s each (its tuning tables' per-channel maxima for Ampere, src/graph/tuning.h), 2 at least and 32
# at most: 2 on PCIe, 16 on H100's NVLink (NVIDIA/nccl#1161's log shows 24 on two NVLink-bridged H100s)
CHANNEL_GBPS = 24.0
CHANNELS = (2, 32)


def bus_gbps(link: Link) -> float:
    """What a ring collective reaches over the link: NCCL's bus bandwidth, or the link's rate where NCCL does
    not run (gloo, measured links)."""
    return link.bus_gbps or link.gbps


def ring_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """all_gather / reduce_scatter / all_reduce of a tensor of `nbytes` (unsharded) over an n-rank ring: a step's
    latency per hop, and each rank's share of the bytes at the bus bandwidth (nccl-tests' definition of busbw)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    steps = n - 1
    frac = (n - 1) / n
    if kind == "all_reduce":
        steps, frac = 2 * steps, 2 * frac
    return steps * link.latency_s + frac * nbytes / (bus_gbps(link) * 1e9)


def tree_time(nbytes: float, n: int, link: Link) -> float:
    """An all-reduce over NCCL's double binary tree across link.nodes nodes: reduced up and broadcast down, a
    chain inside each node and log2(nodes) network hops each way, at NCCL's tree bandwidth."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    hops = 2 * (max(1, n // link.nodes) - 1 + math.ceil(math.log2(link.nodes)))
    bus = min(TREE_BUS_SHARE * bus_gbps(link), TREE_MAX_GBPS[link.nodes > 2])
    return hops * link.latency_s + 2 * nbytes / (bus * 1e9)


def collective_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """A collective as NCCL runs it: a ring, or for an all-reduce across nodes the tree where that is faster
    (small messages over many nodes, where the ring's 2(n-1) latencies dominate). Links NCCL does not run on
    (gloo) keep the ring."""
    ring = ring_time(kind, nbytes, n, link)
    if kind == "all_reduce" and link.nodes > 1 and link.bus_gbps:
        return min(ring, tree_time(nbytes, n, link))
    return ring


def overlap_exposed(comm: float, compute: float, sm_share: float) -> float:
    """Seconds a collective of `comm` seconds adds beside `compute` seconds of kernels: what outlasts the
    compute, and the hidden part's toll on it: the compute runs on the SMs NCCL leaves (1 - sm_share), so it
    takes 1 / (1 - sm_share) as long while they overlap."""
    hidden = min(comm, compute)
    return comm - hidden + hidden * sm_share / (1.0 - sm_share)


def nccl_sm_share(gpu: GPU, link: Link) -> float:
    """The share of the GPU's SMs NCCL's channels over `link` hold while a collective runs (0 on CPUs, unknown
    GPUs and links NCCL does not run on)."""
    if gpu.name == "cpu" or not gpu.sms or not link.bus_gbps:
        return 0.0
    channels = min(max(math.ceil(link.bus_gbps / CHANNEL_GBPS), CHANNELS[0]), CHANNELS[1])
    return min(0.5, channels / gpu.sms)


def transfer_time(nbytes: float, link: Link) -> float:
    return 0.0 if nbytes <= 0 else link.latency_s + nbytes / (link.gbps * 1e9)


def piece_compute(p: PieceProfile, gpu: GPU, dtype: str, measured_on: str | None,
                  host_extra: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
    """(forward, backward) seconds of one microbatch through one piece.

    Unmeasured: the roofline, with a floor of one dispatch per operator; on a GPU the linear layers' GEMMs by their
    shapes (plan.kernels: tiles, waves, a ceiling per dtype), other FLOPs (attention) at flash attention's rate where
    it is known, else at the flat rate. On a GPU the host dispatches ahead of the kernels, so the slower of the two
    counts; on the CPU the same thread dispatches and computes, so they add up, and the large tensors it allocates
    are paged in (GPU.page_in_bytes_per_s). A compiled block (p.compiled) launches kernels rather than dispatching
    operators: its ops are its launches, each at GPU.compiled_launch_s. host_extra: more host seconds (forward,
    backward): FSDP2's share, selective checkpointing's policy."""
    if measured_on == gpu.name and p.fwd_time_s is not None and p.bwd_time_s is not None:
        return p.fwd_time_s, p.bwd_time_s
    rate, bw = gpu.flops_per_s(dtype), gpu.mem_bytes_per_s()
    combine = (lambda a, b: a + b) if gpu.name == "cpu" else max
    fwd, bwd = p.fwd_flops / rate, p.bwd_flops / rate
    if gpu.name != "cpu" and gpu.sms and p.gemms:  # linear layers by tile and wave, attention as flash attention
        gf, gb, gf_flops, gb_flops = gemm_seconds(p.gemms, gpu, dtype, p.num_trainable / max(p.num_params, 1))
        af, ab = attention_rates(gpu, dtype, p.head_dim)
        fwd, bwd = gf + max(0.0, p.fwd_flops - gf_flops) / af, gb + max(0.0, p.bwd_flops - gb_flops) / ab
    elif gpu.name == "cpu" and gpu.attention_tflops and p.head_dim and dtype == "float32":  # SDPA's measured rate
        gf_flops = sum(2.0 * m * n * k for m, n, k in p.gemms)
        gb_flops = gf_flops * (1 + p.num_trainable / max(p.num_params, 1))
        af, ab = (t * 1e12 for t in gpu.attention_tflops)
        fwd = gf_flops / rate + max(0.0, p.fwd_flops - gf_flops) / af
        bwd = gb_flops / rate + max(0.0, p.bwd_flops - gb_flops) / ab
    per_op = gpu.compiled_launch_s if p.compiled else gpu.op_overhead_s  # a compiled block's ops are its launches
    paging = 1.0 / gpu.page_in_bytes_per_s if gpu.page_in_bytes_per_s else 0.0  # seconds a fresh byte
    return (combine(fwd + p.fwd_mem_bytes / bw + p.fwd_fresh_bytes * paging, p.fwd_ops * per_op + host_extra[0]),
            combine(bwd + p.bwd_mem_bytes / bw + p.bwd_fresh_bytes * paging, p.bwd_ops * per_op + host_extra[1]))


def recompute_time(p: PieceProfile, policy: ActivationPolicy, fwd: float, gpu: GPU, dtype: str,
                   measured_on: str | None) -> float:
    """Extra seconds in backward for recomputing what the policy did not keep."""
    if measured_on == gpu.name and policy.recomputes and policy.timed_as in p.recompute_time_s:
        return p.recompute_time_s[policy.timed_as]
    if policy.recomputes_forward:
        return fwd
    if policy.selective:
        # the memory-bound ops of the forward run again at bandwidth, and the linear layers whose outputs the policy
        # dropped (selective_half: the 2nd, 4th, ... of the forward's GEMMs; model.recompute.keeps_output); the
        # replay dispatches every forward operator, each through the policy
        dropped = [g for i, g in enumerate(p.gemms) if i % policy.gemm_stride]
        gemms = (gemm_seconds(dropped, gpu, dtype, 0.0)[0] if gpu.name != "cpu" and gpu.sms
                 else sum(2.0 * m * n * k for m, n, k in dropped) / gpu.flops_per_s(dtype))
        kernels = p.fwd_mem_bytes / gpu.mem_bytes_per_s() + gemms
        # compiled, the policy ran once, as the graph was traced: the replay is the forward's launches again
        replay = p.fwd_ops * (gpu.compiled_launch_s if p.compiled else gpu.op_overhead_s + gpu.sac_overhead_s)
        return kernels + replay if gpu.name == "cpu" else max(kernels, replay)
    return 0.0


def expert_gemm_time(p: PieceProfile, gpu: GPU, dtype: str) -> tuple[float, float]:
    """(forward, backward) seconds of p's experts' grouped GEMMs at balanced routing, of piece_compute's: on a GPU
    by tile and wave at their tokens per expert (plan.kernels), else at the flat rate. A measured piece's time holds
    them too; this is their share as the roofline sees it."""
    gemms = [p.gemms[i] for i in p.expert_gemms]
    if not gemms:
        return 0.0, 0.0
    trainable = p.num_trainable / max(p.num_params, 1)
    if gpu.name != "cpu" and gpu.sms:
        f, b, _, _ = gemm_seconds(gemms, gpu, dtype, trainable)
        return f, b
    flops = sum(2.0 * m * n * k for m, n, k in gemms)
    return flops / gpu.flops_per_s(dtype), flops * (1 + trainable) / gpu.flops_per_s(dtype)


def imbalance_cost_s(balanced_s: float, factor: float) -> float:
    """Seconds a routing IMBALANCE `factor` (plan.corrections.routing_imbalance) adds to `balanced_s` of the
    experts' grouped GEMMs and all-to-alls under expert parallelism: the ranks wait for the busiest one."""
    return (factor - 1.0) * balanced_s


def weight_share(p: PieceProfile) -> float:
    """Of the piece's backward, the part that computes weight gradients (the W of a split backward): its linear
    layers' weight GEMMs, as many FLOPs as their forward for trainable weights, none for frozen ones."""
    if not p.bwd_flops:
        return 0.0
    weights = sum(2.0 * m * n * k for m, n, k in p.gemms) * p.num_trainable / max(p.num_params, 1)
    return min(1.0, weights / p.bwd_flops)


@dataclass(frozen=True)
class TensorParallel:
    """A stage's tensor-parallel group, as runtime.tensor_parallel talks over it (Megatron with sequence
    parallelism): per block, the attention and MLP inputs are all-gathered and their outputs reduce-scattered,
    in forward and again (as reduce-scatter and all-gather) in backward; recomputation gathers again. The
    embedding all-reduces its output, the head gathers its input; the loss (loss_parallel) all-reduces three fp32
    figures per token (the logits' maximum, the sum of exponentials, the target's logit), never the logits.
    torch's eager DTensor runs each collective when its op needs it: none overlaps compute."""

    size: int
    link: Link
    tokens: int  # one microbatch's
    fixed_s: float = 0.0  # per piece and microbatch: what DTensor adds on CPU ranks (measured, `cpu_tp_time`)

    def times(self, p: PieceProfile, policy: ActivationPolicy) -> tuple[float, float]:
        """(forward, backward) seconds of p's collectives (and DTensor's own work) per microbatch; p as one tp
        rank holds it."""
        f, b = self._collectives(p, policy)
        return f + self.fixed_s / 2, b + self.fixed_s / 2

    def _collectives(self, p: PieceProfile, policy: ActivationPolicy) -> tuple[float, float]:
        n, link = self.size, self.link
        if p.name.startswith("block"):
            whole = p.input_bytes * n
            gather = collective_time("all_gather", whole, n, link)
            scatter = collective_time("reduce_scatter", whole, n, link)
            again = 2 * (gather + scatter) if policy.recomputes_forward else 2 * gather * policy.selective
            return 2 * (gather + scatter), 2 * (gather + scatter) + again
        if p.name == "embed":
            whole = p.output_bytes * n
            return collective_time("all_reduce", whole, n, link), collective_time("all_gather", whole, n, link)
        whole = p.input_bytes * n
        loss = 3 * collective_time("all_reduce", 4 * self.tokens, n, link)
        return collective_time("all_gather", whole, n, link) + loss, collective_time("all_reduce", whole, n, link)


@dataclass
class StageTime:
    """One stage on one rank, per microbatch, and what it adds once per step."""

    fwd: float = 0.0
    bwd: float = 0.0
    recompute: float = 0.0
    wgrad: float = 0.0  # of bwd, the weight gradients' seconds (`weight_share`): a split backward's W
    split_host: float = 0.0  # host seconds a split backward adds (SPLIT_BACKWARD_DISPATCHES), exposed on CPU ranks
    comm_exposed: float = 0.0  # ZeRO-3 gathers not hidden behind compute
    offload_exposed: float = 0.0  # activation / parameter transfers not hidden
    reduce_bytes: list[float] | None = None  # per piece: gradient bytes reduced at the end of the step
    update: float = 0.0  # per step: the optimizer step's FSDP2 (DTensor) work on CPU ranks
    pipe: float = 0.0  # the pipeline runtime's own work for this stage on CPU ranks (transfers, bookkeeping)
    tp_fwd: float = 0.0  # tensor-parallel collectives in forward (all exposed)
    tp_bwd: float = 0.0  # and in backward, recomputation's included
    cp_fwd: float = 0.0  # context parallelism's all-to-alls in forward (plan.context_parallel, all exposed)
    cp_bwd: float = 0.0  # and in backward, recomputation's included
    ep_fwd: float = 0.0  # expert parallelism's all-to-alls in forward (plan.expert_parallel, all exposed)
    ep_bwd: float = 0.0  # and in backward, recomputation's included
    # of fwd, bwd and recompute: the experts' grouped GEMMs (`expert_gemm_time`; recomputed at their share of the
    # forward), at the routing's imbalance under ep
    expert_fwd: float = 0.0
    expert_bwd: float = 0.0
    expert_rc: float = 0.0
    sm_share: float = 0.0  # of the GPU's SMs, what NCCL holds while a dp collective overlaps compute
    # per reduction (timing.reductions): FSDP2's reduce-scatter copy-in, each sharded unit's gradients read and written
    # into the reduce buffer in the reduce dtype (foreach_reduce_scatter_copy_in, torch 2.13's
    # _fully_shard/_fsdp_collectives.py), on the compute stream before the collective: never hidden
    reduce_copy: float = 0.0

    @property
    def f_total(self) -> float:
        return self.fwd + self.tp_fwd + self.cp_fwd + self.ep_fwd + (self.comm_exposed + self.offload_exposed + self.pipe) / 2

    @property
    def b_total(self) -> float:
        return self.bwd + self.recompute + self.tp_bwd + self.cp_bwd + self.ep_bwd + (self.comm_exposed + self.offload_exposed + self.pipe) / 2


def gather_every(pp: int, m: int) -> int:
    """Microbatches one all-gather of a ZeRO-1/2 unit serves in a step. Pipeline stages keep FSDP2 units unsharded
    from the first forward to the last backward (torch's PipelineStage and BPipe turn reshard_after_backward off
    until the last microbatch): one gather per step (4 ranks as pp 2 x dp 2, 4 microbatches: 3 gathers on a stage
    of 3 units). The engine lets FSDP2 reshard after every backward, so each microbatch gathers again."""
    return m if pp > 1 else 1


def stage_time(
    pieces: list[StagePiece], *, node: Node, dtype: str, reduce_dtype: str, dp: int, dp_link: Link,
    measured_on: str | None, wrapped: bool = True, pipelined: bool = False, busy: float = 1.0,
    tensor: TensorParallel | None = None, computed: dict[tuple, tuple[float, float]] | None = None,
    gathers: int = 1, context=None, experts=None,
) -> StageTime:
    """wrapped: the pieces run under FSDP2 (every plan but Plan.runs_unwrapped); pipelined: they are a stage
    of a pipeline (pp > 1); busy: the share of the node's ranks working at once (`local_ranks`); tensor: the
    pieces are one tensor-parallel rank's (ModelProfile.split) and talk over this group; computed: piece_compute's
    results by piece name and host share, kept across calls on the same pieces and node (the search costs every
    option); gathers: the microbatches one gather of a ZeRO-1/2 unit serves (`gather_every`); context: the pieces
    are one context-parallel rank's and exchange over this group (plan.context_parallel.ContextParallel); experts:
    their MoE blocks dispatch over this expert-parallel group (plan.expert_parallel.ExpertParallel)."""
    gpu, pcie = node.gpu, node.pcie
    c, g = DTYPE_BYTES[dtype], DTYPE_BYTES[reduce_dtype]
    on_cpu, share = gpu.name == "cpu", cpu_share(node, busy)
    st = StageTime(reduce_bytes=[], sm_share=nccl_sm_share(gpu, dp_link))
    first_gather = True
    roots = sum(not sp.is_block for sp in pieces)
    for sp in pieces:
        p, d = sp.piece, sp.decision
        policy = d.policy if sp.is_block else ACTIVATION_POLICIES["keep"]
        # host time beyond dispatch: FSDP2's per unit, half each way (each block is a unit, the stage's root pieces
        # share one; a zero-0 block frozen whole is none: runtime.sharding.needs_unit); selective checkpointing's
        # policy on every forward operator, unless compiled (it ran once, when the graph was traced)
        unit_of = not sp.is_block or d.zero > 0 or sp.n_trainable > 0
        unit = gpu.unit_overhead_s / 2 / (1 if sp.is_block else roots) if wrapped and unit_of and not on_cpu else 0.0
        sac = policy.selective and not p.compiled
        extra = (unit + (p.fwd_ops * gpu.sac_overhead_s if sac else 0.0), unit)
        if computed is None or (p.name, extra) not in computed:
            f, b = piece_compute(p, gpu, dtype, measured_on, extra)
            if computed is not None:
                computed[p.name, extra] = f, b
        else:
            f, b = computed[p.name, extra]
        rc = recompute_time(p, policy, f, gpu, dtype, measured_on)
        xf, xb = expert_gemm_time(p, gpu, dtype) if p.expert_gemms else (0.0, 0.0)
        st.expert_fwd, st.expert_bwd = st.expert_fwd + xf * share, st.expert_bwd + xb * share
        st.expert_rc += (xf * rc / f if f else 0.0) * share
        st.fwd, st.bwd, st.recompute = st.fwd + f * share, st.bwd + b * share, st.recompute + rc * share
        st.wgrad += b * share * weight_share(p)
        if on_cpu:  # on a GPU the host runs ahead of the kernels, so this hides behind them
            st.split_host += SPLIT_BACKWARD_DISPATCHES * p.bwd_ops * gpu.op_overhead_s * share
        if tensor is not None:
            tf, tb = tensor.times(p, policy)
            st.tp_fwd, st.tp_bwd = st.tp_fwd + tf, st.tp_bwd + tb
        if context is not None:
            cf, cb = context.times(p, policy)
            st.cp_fwd, st.cp_bwd = st.cp_fwd + cf, st.cp_bwd + cb
        if experts is not None:
            ef, eb = experts.times(p, policy)
            st.ep_fwd, st.ep_bwd = st.ep_fwd + ef, st.ep_bwd + eb
        if d.zero >= 1 and dp > 1 and not on_cpu:  # CPU ranks: FSDP2's measured costs below
            gather = collective_time("all_gather", sp.n_params * c, dp, dp_link)
            if d.placement.params_on_host:
                gather += transfer_time(sp.n_params * c / dp, pcie)
            if d.zero < 3:
                gather /= gathers
            comm_b = gather if d.zero == 3 and p.name.startswith("block") else 0.0
            # FSDP2's copy-out of each gather, on the compute stream: the gathered buffer read and split into the
            # unit's parameters (torch.ops.fsdp.split_with_sizes_copy in foreach_all_gather_copy_out, torch 2.13's
            # _fully_shard/_fsdp_collectives.py), at HBM bandwidth; docs/gpu.md saw it among the kernels of an H200's
            # step. Its copy-in (a shard, on a side stream) is not charged
            copy = 2 * sp.n_params * c / gpu.mem_bytes_per_s() / (gathers if d.zero < 3 else 1)
            copy_b = copy if comm_b else 0.0
            st.fwd, st.bwd = st.fwd + copy * share, st.bwd + copy_b * share
            st.reduce_copy += sp.n_trainable * (c + g) / gpu.mem_bytes_per_s()
            if first_gather:  # nothing to hide the first gather behind
                st.comm_exposed += gather
                first_gather = False
            st.comm_exposed += (overlap_exposed(gather, f, st.sm_share)
                                + overlap_exposed(comm_b, b + rc, st.sm_share))
        if host_saved(sp):
            move = transfer_time(host_saved(sp), pcie)
            st.offload_exposed += 2 * move if on_cpu else max(0.0, move - f) + max(0.0, move - b)
        st.reduce_bytes.append(sp.n_trainable * g if dp > 1 else 0.0)
    if wrapped and on_cpu:
        st.comm_exposed += cpu_fsdp_time(pieces, node, dtype, dp, busy=busy, gathers=gathers)
        st.update = cpu_fsdp_time(pieces, node, dtype, dp, "update")
    if pipelined and on_cpu:
        st.pipe = cpu_stage_time(node)
    return _corrected_stage(st, node) if node.corrections else st


def _corrected_stage(st: StageTime, node: Node) -> StageTime:
    """The stage's times with the run-measured factors of `node` (plan.corrections) applied, term by term. Under
    expert parallelism (its all-to-alls timed) the routing's IMBALANCE scales the experts' grouped GEMMs and the
    all-to-alls: every ep rank waits for the one whose experts got the most tokens."""
    fix = lambda term, s: corrected(term, s, node)  # noqa: E731
    if st.ep_fwd or st.ep_bwd:
        skew = fix(IMBALANCE, 1.0)
        more = [imbalance_cost_s(x, skew) for x in (st.expert_fwd, st.expert_bwd, st.expert_rc, st.ep_fwd, st.ep_bwd)]
        st.fwd, st.bwd, st.recompute = st.fwd + more[0], st.bwd + more[1], st.recompute + more[2]
        st.expert_fwd, st.expert_bwd, st.expert_rc = st.expert_fwd + more[0], st.expert_bwd + more[1], st.expert_rc + more[2]
        st.ep_fwd, st.ep_bwd = st.ep_fwd + more[3], st.ep_bwd + more[4]
    st.fwd, st.bwd, st.wgrad = fix("compute", st.fwd), fix("compute", st.bwd), fix("compute", st.wgrad)
    st.expert_fwd, st.expert_bwd = fix("compute", st.expert_fwd), fix("compute", st.expert_bwd)
    st.expert_rc = fix("recompute", st.expert_rc)
    st.recompute = fix("recompute", st.recompute)
    st.comm_exposed = fix("dp_comm_exposed", st.comm_exposed)
    st.offload_exposed = fix("offload_exposed", st.offload_exposed)
    st.tp_fwd, st.tp_bwd = fix("tp_comm", st.tp_fwd), fix("tp_comm", st.tp_bwd)
    st.split_host = fix("pipeline_runtime", st.split_host)  # st.pipe: cpu_stage_time corrects it
    st.update = fix("optimizer", st.update)
    return st


def reductions(grad_reduce: str, m: int) -> int:
    """How many times a step reduces each unit's gradients: once, or after each of its m microbatches."""
    return m if grad_reduce == "microbatch" else 1


def reduce_time(sp: StagePiece, nbytes: float, dp: int, link: Link) -> float:
    """One piece's end-of-step gradient reduction: all-reduce when replicated, else reduce-scatter (FSDP2)."""
    return collective_time("all_reduce" if sp.decision.zero == 0 else "reduce_scatter", nbytes, dp, link)


def grad_reduce_exposed(stages: list[tuple[StageTime, list[StagePiece]]], dp: int, link: Link, bwd_last: float,
                        cpu: Node | None = None) -> float:
    """One gradient reduction of every unit, hidden behind the backward that makes it except the tail
    (`reductions` says how many a step runs), and FSDP2's copy-in before it (StageTime.reduce_copy), never hidden.

    cpu: the node of CPU ranks, whose measured FSDP2 reduce cost applies instead, all of it exposed.
    """
    if dp <= 1:
        return 0.0
    costs, share = local_ranks(cpu, group=dp) if cpu is not None else ({}, 1.0)
    if costs:
        return sum(line_cost(costs["reduce" if zero else "allreduce"], nbytes) for st, pieces in stages
                   for nbytes, zero, _ in fsdp_units(pieces, st.reduce_bytes)) * share / costs["contention"][0]
    times = [reduce_time(sp, nbytes, dp, link) for st, pieces in stages for nbytes, sp in zip(st.reduce_bytes, pieces)]
    if cpu is not None:  # CPU ranks not measured: the link's cost, nothing overlaps
        return sum(times)
    tail = times[0] if times else 0.0  # the first piece's gradients are ready last
    copy = sum(st.reduce_copy for st, _ in stages)
    return overlap_exposed(sum(times), bwd_last, stages[0][0].sm_share if stages else 0.0) + tail + copy


def optimizer_time(
    pieces: list[StagePiece], *, gpu: GPU, host: Host, dp: int, dtype: str, reduce_dtype: str, pcie: Link,
    ranks_on_host: int, bwd_last: float, grad_copies: int = 1, optimizer: OptimizerPlan | None = None,
) -> tuple[float, float]:
    """(device optimizer seconds, exposed host-optimizer and state-streaming seconds) for one rank; grad_copies: how
    often offloaded units' gradient shards go to host in a step (`reductions`: each reduction sends its shard, added
    up there).

    The update's cost follows the optimizer setup (plan.optimizer): on a GPU the bytes it moves, on a CPU the fused
    AdamW rate profile-hardware measured, slowed for torchao's updates. Streamed states (Placement.STREAMED) cross PCIe
    both ways; they hide behind the backward when each unit steps in it, else behind the device's other updates."""
    opt = optimizer or OptimizerPlan()
    c, g = DTYPE_BYTES[dtype], DTYPE_BYTES[reduce_dtype]
    dev_params = host_params = streamed = streamed_root = 0.0
    for sp in pieces:
        n = sp.n_trainable / (dp if sp.decision.zero >= 1 else 1)
        if sp.decision.placement.steps_on_host:
            host_params += n
        else:
            dev_params += n
        if sp.decision.placement.streams_states:
            nbytes = state_bytes(opt, sp.piece.matrices, sp.n_trainable, dp if sp.decision.zero >= 1 else 1)
            if sp.is_block:
                streamed += nbytes
            else:  # the root steps last: no backward left to hide its copies
                streamed_root += nbytes
    host_rate = host.adam_params_per_s / ranks_on_host / host_step_slowdown(opt)
    if gpu.name == "cpu":  # the measured AdamW rate is this device's optimizer
        dev_time = dev_params / host_rate
    else:
        dev_time = dev_params * update_bytes(opt) / gpu.mem_bytes_per_s()
    cpu = host_params / host_rate
    moves = grad_copies * transfer_time(host_params * g, pcie) + transfer_time(host_params * c, pcie)
    hidden = 0.0 if gpu.name == "cpu" else bwd_last  # a CPU device has no other work for the host step to hide behind
    exposed = max(0.0, cpu + moves - hidden) if host_params else 0.0
    if streamed or streamed_root:
        behind = (bwd_last if opt.in_backward else dev_time) if gpu.name != "cpu" else 0.0
        exposed += max(0.0, 2 * transfer_time(streamed, pcie) - behind) + 2 * transfer_time(streamed_root, pcie)
    return dev_time, exposed
