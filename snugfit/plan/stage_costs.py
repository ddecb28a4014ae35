"""The search's per-block option costs: what one block (or a stage's root pieces) costs under one option on one
kind of rank, in bytes (static + accumulating gradients + resident microbatches x saved activations) and seconds
(microbatches x per-microbatch time + per-step time), each taken from the memory model (piece_memory.py) and
timing.py applied to that block alone, so the search and the full estimate() share one model. knapsack.py weighs
them. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from snugfit.hardware.catalogue import GPU
from snugfit.hardware.cluster import Cluster
from snugfit.plan.corrections import corrected
from snugfit.plan.footprint import StageBuffers
from snugfit.plan.memory import FRAGMENTATION
from snugfit.plan.optimizer import master_bytes
from snugfit.plan.piece_memory import (
    StagePiece, accumulating_grad_bytes, device_saved, expert_adapters, expert_tensors, gathered_bytes, host_saved,
    param_state,
)
from snugfit.plan.plan import BlockPlan, OptimizerPlan, Plan
from snugfit.plan.shape import Shape
from snugfit.plan.step_terms import step_terms
from snugfit.plan.timing import (
    StageTime, TensorParallel, grad_reduce_exposed, optimizer_time, reduce_time, stage_time,
)
from snugfit.profile.types import DTYPE_BYTES, ModelProfile, PieceProfile


@dataclass
class Cost:
    """One piece under one option."""

    static: int  # device bytes held all step (parameters, states, gathered copies of a zero 0-2 piece)
    # device gradient bytes at the peak: unsharded (accumulating, or fresh in the first backward); the reduced
    # shard where every microbatch reduces (grad_reduce "microbatch")
    grads: int
    grads_reduced: int  # the same with one microbatch: only the reduced shard (sync is on as it is made); none
    # where each unit steps in backward (the stepping unit's is a once-per-stage buffer, StageCosts.stepping)
    act: int  # device bytes per resident microbatch
    t_mb: float  # seconds per microbatch (forward, backward, recompute, exposed transfers)
    t_step: float  # seconds once per step (optimizer, gradient reduction)
    host: int = 0  # host bytes held all step (offloaded parameters, gradients, optimizer states)
    host_act: int = 0  # host bytes per resident microbatch (offloaded activations)
    # the root's: what its reduce and step, the backward's last moment, hold beyond `static` (its streamed states, less
    # its gathered copy, freed before the reduce)
    at_root: int = 0

    def mem(self, resident: float, m: int) -> float:
        return self.static + (self.grads if m > 1 else self.grads_reduced) + resident * self.act

    def time(self, m: int) -> float:
        return m * self.t_mb + self.t_step

    def host_mem(self, resident: float) -> float:
        return self.host + resident * self.host_act


def usable(gpu: GPU, budget: int) -> float:
    """Bytes the model may account for once the reserve (context + fragmentation) is taken off."""
    return float(budget) if gpu.name == "cpu" else (budget - gpu.context_bytes) / (1 + FRAGMENTATION)


def with_reserve(gpu: GPU, nbytes: float) -> int:
    return int(nbytes if gpu.name == "cpu" else nbytes * (1 + FRAGMENTATION) + gpu.context_bytes)


def working(p: PieceProfile) -> int:
    """The piece's own forward/backward peak above what is held (walks.stage_walk, policy 'keep')."""
    keep = p.saved_bytes["keep"]
    return max(p.input_bytes + p.fwd_peak_bytes, keep + p.output_bytes + p.bwd_peak_bytes)


@dataclass
class _Parts:
    """What a piece's Cost is made of before when gradients are reduced and whether the backward is split (the
    two things StageCosts differ in that share a `SharedCosts`) are applied."""

    static: int
    grads: int  # unsharded, accumulating
    reduced: int  # the reduced shard
    act: int
    host: int
    host_act: int
    at_root: int
    time: StageTime  # per microbatch
    passes: float  # its forward and backward: a block's on a GPU what one more such unit adds
    opt_dev: float
    opt_host: float
    reduce: float  # one reduction's exposed seconds


@dataclass
class SharedCosts:
    """Cost parts and piece_compute's results shared by the StageCosts of one kind of rank that differ only in
    grad_reduce and replays: the search prices every candidate in both reduction modes and with and without a
    split backward, and those change only how the parts add up (`StageCosts._cost`)."""

    parts: dict[tuple, _Parts] = field(default_factory=dict)
    computed: dict[tuple, tuple[float, float]] = field(default_factory=dict)


class StageCosts:
    """Option costs on one kind of rank (its node's GPU, dp, micro-batch), cached per piece and option."""

    def __init__(self, prof: ModelProfile, cluster: Cluster, dp_group: list[int], reduce_dtype: str,
                 busy: float = 1.0, tensor: TensorParallel | None = None, gathers: int = 1,
                 grad_reduce: str = "step", replays: int = 1, optimizer: OptimizerPlan | None = None,
                 shared: SharedCosts | None = None, context=None, experts=None):
        self.node = cluster.nodes[cluster.node_of(dp_group[0])]  # dp_group: the stage's first (RankLayout)
        self.gpu = self.node.gpu
        dp = len(dp_group)
        self.dp, self.dtype, self.rdtype, self.measured_on = dp, prof.dtype, reduce_dtype, prof.device
        self.busy = busy  # the share of the node's ranks working at once (cpu_ranks.local_ranks)
        self.tensor = tensor  # prof is then one tensor-parallel rank's (ModelProfile.split)
        self.context = context  # prof is then one context-parallel rank's (plan.context_parallel.context_split)
        self.experts = experts  # its MoE blocks dispatch over this ep group (plan.expert_parallel.ExpertParallel)
        self.expert_tensors = expert_tensors(prof)  # a block's 3-D expert weights, which ep splits (piece_memory)
        self.expert_adapters = expert_adapters(prof)  # and their LoRA adapters' parameters
        self.gathers = gathers  # microbatches one gather of a ZeRO-1/2 unit serves (timing.gather_every)
        self.grad_reduce = grad_reduce  # plan.GRAD_REDUCE: when gradients are reduced
        self.replays = replays  # times a backward recomputes what the policy dropped (2 where the schedule splits it)
        self.dp_link = cluster.link_for(dp_group)
        self.stub = Plan(shape=Shape(dp=dp, ep=experts.size if experts else 1, grad_reduce=grad_reduce),
                         compute_dtype=prof.dtype,
                         reduce_dtype=reduce_dtype, optimizer=optimizer or OptimizerPlan())
        # one process whose blocks shard and offload nothing runs the model unwrapped (Plan.runs_unwrapped)
        self.unwrapped = cluster.world_size == 1 and self.stub.optimizer.master_weights == "fp32"
        self._cache: dict[tuple, Cost] = {}
        self._walks: dict[tuple, float] = {}  # working_peak's
        self.shared = shared or SharedCosts()  # with the StageCosts alike but for grad_reduce and replays

    def working_peak(self, blk: PieceProfile, roots: list[PieceProfile], opts: list[BlockPlan],
                     ropts: list[BlockPlan], m: int) -> float:
        """The largest piece's working peak above the held bytes the knapsack counts, a block's with FSDP2's
        gradient buffers of the backward that syncs (walks.sync_held), at the leanest options. The held bytes
        include the piece's own saved activations of the microbatch in flight, which working() counts too
        (walks.stage_walk counts them once), so they come off, at the piece's leanest option to stay an upper
        bound. Stepping in backward, the stepping unit's gradient comes on top (`stepping`). Cached: the search
        asks for it per candidate and stage (`opts`/`ropts` are the search's own cached lists, so their identity
        names them)."""
        every = m == 1 or self.grad_reduce == "microbatch"  # every backward syncs (Plan.reduces_every_microbatch)
        key = (blk.name, tuple(p.name for p in roots), every, id(opts), id(ropts))
        if key not in self._walks:
            sync = (min(self._reduce_held(blk, o) for o in opts)
                    + (min(self._head_held(roots, ro) for ro in ropts) if every else 0.0))
            # a block's working peak at the most its options leave (their MLP tiles; roots have none)
            walk = {id(p): max(working(p.tiled(o.mlp_tiles)) for o in opts) if p is blk else working(p)
                    for p in [blk, *roots]}
            self._walks[key] = max(walk[id(p)] - min(self.cost(p, o).act for o in (opts if p is blk else ropts))
                                   + (sync if p is blk else 0) for p in [blk, *roots]) + self.stepping(blk, opts)
        return self._walks[key]

    def _reduce_held(self, blk: PieceProfile, block: BlockPlan) -> float:
        """During a block's backward that syncs: the reduce-scatter input of the block reduced before it, less
        that block's gathered copy, freed after its backward (zero 0-2). None on one rank, which runs
        unwrapped (nearly always)."""
        if self.unwrapped:
            return 0.0
        freed = gathered_bytes(self.stub, self._piece(blk, block)) if block.zero < 3 else 0
        return max(0.0, DTYPE_BYTES[self.rdtype] * blk.num_trainable - freed)

    def _head_held(self, roots: list[PieceProfile], root: BlockPlan) -> float:
        """Where every backward syncs: the head's unsharded gradient where it exceeds the shard the costs count
        for it (the root is reduced last)."""
        if self.unwrapped:
            return 0.0
        stepped = self.stub.optimizer.in_backward  # its shard is freed once it steps
        shard = 0 if root.placement.steps_on_host or stepped else (
            master_bytes(self.stub.optimizer) / (self.dp if root.zero >= 1 else 1))
        return sum(p.num_trainable for p in roots if p.name == "head") * max(0.0, DTYPE_BYTES[self.dtype] - shard)

    def root_reduce(self, roots: list[PieceProfile], m: int) -> float:
        """FSDP2's bytes at the root unit's reduce, the backward's last, beyond the held static bytes: the root's
        unsharded gradients and its reduce-scatter input (footprint.rank_footprint's last reduce moment)."""
        if self.unwrapped:
            return 0.0
        own = DTYPE_BYTES[self.rdtype if m > 1 and self.grad_reduce == "step" else self.dtype]
        return (own + DTYPE_BYTES[self.rdtype]) * sum(p.num_trainable for p in roots)

    def stepping(self, blk: PieceProfile, opts: list[BlockPlan]) -> float:
        """Stepping in backward: the device gradient of the unit stepping (a block's reduced shard, at its
        leanest option), which the costs leave out (Cost.grads_reduced)."""
        if not self.stub.optimizer.in_backward:
            return 0.0
        return min(param_state(self.stub, self._piece(blk, o))[0].get("gradients", 0) for o in opts)

    def buffers(self, blk: PieceProfile) -> StageBuffers:
        """The once-per-stage buffers options may need, on block `blk` (its experts split over this rank's ep)."""
        return StageBuffers.of_block(self.stub, self._piece(blk, BlockPlan(zero=3)))

    def _piece(self, p: PieceProfile, o: BlockPlan) -> StagePiece:
        """p under option o, as piece_memory counts it (a block's experts named, which ep splits)."""
        block = p.name.startswith("block")
        return StagePiece(p, o, p.num_params, experts=self.expert_tensors if block else (),
                          expert_adapters=self.expert_adapters if block else ())

    def cost(self, p: PieceProfile, o: BlockPlan) -> Cost:
        """A block under option o (what one more such block adds to the stage). Called in the search's inner
        loops: the cache lookup is kept to one tuple."""
        key = (p.name, o)
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = self._cost(key, (p,), o)
        return found

    def root(self, pieces: list[PieceProfile], o: BlockPlan) -> Cost:
        """The stage's root pieces (embedding, final norm, head) under option o: one FSDP2 unit."""
        key = ("+".join(p.name for p in pieces), o)
        if key not in self._cache:
            self._cache[key] = self._cost(key, tuple(pieces), o)
        return self._cache[key]

    def _cost(self, key: tuple, pieces: tuple[PieceProfile, ...], o: BlockPlan) -> Cost:
        """The pieces under option o (`key` names both), from their parts (`SharedCosts`)."""
        parts = self.shared.parts.get(key)
        if parts is None:
            parts = self.shared.parts[key] = self._parts(pieces, o)
        grads, reduced = parts.grads, parts.reduced
        every = self.grad_reduce == "microbatch"
        if every:  # each backward reduces what it made: only the shard accumulates
            grads = reduced
        if self.stub.optimizer.in_backward:  # each unit steps once reduced and frees its gradient
            reduced = 0
        # a split backward's W recomputes again (simulate.split_backward), and its host work
        terms = step_terms([(parts.time, self.replays)], reduce=parts.reduce, host_step=parts.opt_host,
                           device_step=parts.opt_dev, every_microbatch=every, split=self.replays > 1,
                           passes=parts.passes)
        return Cost(parts.static, grads, reduced, parts.act, terms.t_microbatch, terms.t_step, parts.host,
                    parts.host_act, parts.at_root)

    def _parts(self, pieces: tuple[PieceProfile, ...], o: BlockPlan) -> _Parts:
        sps = [self._piece(p.tiled(o.mlp_tiles) if p.name.startswith("block") else p, o) for p in pieces]
        block = sps[0].is_block
        static = reduced = grads = host_bytes = act = host_act = at_root = 0
        for sp in sps:
            dev, host = param_state(self.stub, sp)
            reduced += dev.pop("gradients", 0)  # the reduced shard: below the unsharded gradients the peak holds
            static += sum(dev.values())
            if not block and o.zero == 3:  # the root's gathered copy stays from forward through backward
                static += gathered_bytes(self.stub, sp)
            if not block:  # at its reduce FSDP2 has freed its gathered copy; its streamed states come for its step
                at_root += host.get("optimizer_states", 0) * o.placement.streams_states - gathered_bytes(self.stub, sp)
            grads += accumulating_grad_bytes(self.stub, sp)
            host_bytes += sum(host.values())
            act += device_saved(sp)
            host_act += host_saved(sp)
        # a lone process, nothing sharded (the stub's one rank is the cluster's only one where self.unwrapped)
        unwrapped = self.unwrapped and replace(self.stub, root=o, blocks=[o]).runs_unwrapped
        kw = dict(node=self.node, dtype=self.dtype, reduce_dtype=self.rdtype, dp=self.dp, dp_link=self.dp_link,
                  measured_on=self.measured_on, wrapped=not unwrapped, busy=self.busy, tensor=self.tensor, context=self.context,
                  experts=self.experts,
                  computed=self.shared.computed, gathers=self.gathers)
        one = stage_time(sps, **kw)
        # a block: what one more such unit adds (no first gather to expose); on CPU ranks nothing overlaps, so a unit
        # costs the same wherever it is. The root is one unit per stage, the first to gather: counted whole (the
        # difference dropped its FSDP2 overhead, so on one GPU a sharded root cost what a plain one did)
        passes = one.f_total + one.b_total
        if self.gpu.name != "cpu" and block:
            two = stage_time(sps + sps, **kw)
            passes = two.f_total + two.b_total - passes
        # a block's host step hides behind its own backward, as estimate() hides the sum behind the whole one
        opt_dev, opt_host = optimizer_time(sps, gpu=self.gpu, host=self.node.host, dp=self.dp, dtype=self.dtype,
                                           reduce_dtype=self.rdtype, pcie=self.node.pcie,
                                           ranks_on_host=self.node.count, optimizer=self.stub.optimizer,
                                           bwd_last=one.bwd + one.recompute if block else 0.0)
        if self.gpu.name == "cpu":  # CPU ranks: what estimate() charges, the measured FSDP2 cost, all exposed
            reduce = grad_reduce_exposed([(one, sps)], self.dp, self.dp_link, 0.0, cpu=self.node)
        else:  # a block's reduction hides behind the next block's backward (estimate() overlaps the sum)
            reduce = sum(reduce_time(sp, sp.n_trainable * DTYPE_BYTES[self.rdtype], self.dp, self.dp_link)
                         for sp in sps)
            if block:
                reduce = max(0.0, reduce - one.bwd - one.recompute)
            reduce += one.reduce_copy  # FSDP2's copy-in, on the compute stream (timing.grad_reduce_exposed)
        reduce = corrected("dp_comm_exposed", reduce, self.node)
        opt_dev = corrected("optimizer", opt_dev, self.node)
        opt_host = corrected("offload_exposed", opt_host, self.node)
        return _Parts(static, grads, reduced, act, host_bytes, host_act, at_root, one, passes, opt_dev, opt_host,
                      reduce)
