"""Memory model, per piece: what one piece (embedding, block, head) holds on a rank under its BlockPlan.

It describes what the runtime (FSDP2 per block, runtime/offload.py) holds. Per
parameter element (c = compute-dtype bytes, g = reduce-dtype bytes, dp = data-parallel
degree; t = trainable elements: frozen ones have no gradient, master or optimizer state):
  parameters  the local shard at rest: trainable elements in the master dtype (plan.optimizer: fp32 4 each, bf16 2;
              FSDP2 casts when it gathers); frozen ones in the compute dtype, c each (no master
              to keep; their own category, frozen_parameters); /dp for zero >= 1 (FSDP2 shards at rest for
              zero 1-2 too: zero 1 runs as zero 2). offload_optimizer units keep trainable shards in c.
  comm_buffers the unsharded compute copies FSDP2 all-gathers (c per element): the root
              unit from forward through backward, zero 0-2 blocks until their backward (FSDP2
              reshards after it; zero 0 too: FSDP2 copies even on a one-rank shard group,
              though not frozen elements, which a zero-0 unit leaves out of FSDP2); a zero-3
              block while it runs, plus, in backward, the unit FSDP2 prefetches of the next (`prefetched_part`).
  reduce_buffers in the backward that syncs, FSDP2's reduce-scatter inputs (g per element,
              unsharded) and the head's unsharded gradient (plan.reduce_memory).
  gradients   accumulating (gradient sync off, microbatches after the first): unsharded,
              g per trainable element, whatever the ZeRO stage; after the reduction: the
              shard in the master dtype (/dp for zero >= 1), on host for offloaded units. With grad_reduce
              "microbatch" every backward reduces, so only the shard accumulates. With the step in backward
              (plan.optimizer.in_backward) a unit's shard is freed once it has stepped: no step-wide buffer, but
              the stepping unit's.
  optimizer_states  AdamW's two states (plan.optimizer: fp32, bf16, or torchao's 8- and 4-bit ones with their
              scales), /dp for zero >= 1.
  offload_optimizer: master shard, its gradient and the states on host (and the
              master cast to the compute dtype, staged for the copy back).
  offload_params (zero 3): shard, gradient shard and states on host.
  stream_states: the states on host; the update runs on the device, which holds two units' states around each
              unit's step (the one stepping, the next copied in): `stream_windows`.

Expert parallelism (plan.ep > 1): a block's experts are their own FSDP2 unit (runtime.sharding), each rank holding
E/ep of them sharded over the dp x cp / ep ranks that hold the same ones; the rest of the block as above
(`ep_parts`). Under ZeRO >= 1 the shards at rest come out as without ep; what ep saves is what is held whole: the
gathered copies, the accumulating gradients, zero 0's replicas.

A piece's saved activations (device_saved, host_saved) are the bytes it saves under its policy
(profile.saved_bytes). footprint.py adds the pieces up at each moment of a rank's step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from snugfit.plan.optimizer import master_bytes, state_bytes
from snugfit.plan.plan import BlockPlan, Plan
from snugfit.plan.policies import KEEP
from snugfit.profile.types import DTYPE_BYTES, ModelProfile, PieceProfile, nf4_bytes


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class StagePiece:
    piece: PieceProfile
    decision: BlockPlan
    n_params: int  # parameters this rank holds for the piece (tied weights included on the last stage)
    n_trainable: int = -1  # of which trainable; -1: the piece's trainable count
    experts: tuple[int, ...] = ()  # sizes of its 3-D expert weights (all E experts; in n_params), which ep splits
    expert_adapters: tuple[int, ...] = ()  # sizes of their LoRA adapters (in n_params, n_trainable), split alike
    ranks: int = 0  # the ranks FSDP2 shards it over (`shard_ranks`); 0: the plan's dp x cp
    mask_bytes: int = 0  # a stage's first block: packed documents' mask, which it makes and holds for them all

    def __post_init__(self) -> None:
        if self.n_trainable < 0:
            self.n_trainable = self.piece.num_trainable

    @property
    def is_block(self) -> bool:
        return self.piece.name.startswith("block")


def _expert_dims(prof: ModelProfile) -> tuple[int, int, int]:
    """(experts, hidden, expert width) of the profiled model's MoE blocks; zeros for a dense one."""
    c = prof.config
    experts = c.get("n_experts") or c.get("num_experts") or c.get("num_local_experts") or 0
    width = c.get("moe_ffn_dim") or c.get("moe_intermediate_size") or c.get("intermediate_size") or 0
    return experts, c.get("dim") or c.get("hidden_size") or 0, width


def expert_tensors(prof: ModelProfile) -> tuple[int, ...]:
    """The sizes of one MoE block's 3-D expert weights (E x 2 width x hidden, E x hidden x width: SwiGLU); none for
    a dense model."""
    experts, dim, width = _expert_dims(prof)
    one = experts * dim * width
    return (2 * one, one) if one else ()


def expert_adapters(prof: ModelProfile) -> tuple[int, ...]:
    """The sizes of one MoE block's expert adapters (model.lora.LoRAExpertWeight: A E x rank x in, B E x out x rank
    of gate_up_proj, down_proj or both), from the block's trainable expert parameters (the profile's
    trainable_by_kind); none where the experts are trained whole, frozen, or the count fits no rank."""
    experts, dim, width = _expert_dims(prof)
    per_block = prof.trainable_by_kind.get("experts", 0) // max(len(prof.blocks), 1)
    if not experts or not per_block or per_block == sum(expert_tensors(prof)):
        return ()
    shapes = {"gate_up_proj": (2 * width, dim), "down_proj": (dim, width)}  # out, in
    for adapted in (("gate_up_proj", "down_proj"), ("gate_up_proj",), ("down_proj",)):
        per_rank = experts * sum(sum(shapes[w]) for w in adapted)
        if per_block % per_rank == 0:
            rank = per_block // per_rank
            return tuple(experts * rank * n for w in adapted for n in reversed(shapes[w]))  # A (in), B (out)
    return ()


def shard_ranks(plan: Plan, sp: StagePiece) -> int:
    """The ranks FSDP2 shards `sp` over: dp x cp, or for a piece's experts under ep those holding the same ones."""
    return sp.ranks or plan.shard_ranks


def ep_parts(plan: Plan, sp: StagePiece) -> list[StagePiece]:
    """`sp` as its FSDP2 units hold it: whole, or under expert parallelism its dense part over dp x cp and this
    rank's E/ep experts over the dp x cp / ep ranks holding the same ones (runtime.sharding)."""
    if plan.ep == 1 or not sp.experts:
        return [sp]
    adapters = sp.expert_adapters
    whole = sp.n_trainable == sp.n_params
    trained = sp.experts if whole else adapters  # the experts' trainable tensors: themselves, or their adapters
    n = sum(sp.experts) + sum(adapters)
    dense = list(sp.piece.matrices)
    for m in trained:
        if m in dense:
            dense.remove(m)
    return [replace(sp, piece=replace(sp.piece, matrices=dense), n_params=sp.n_params - n,
                    n_trainable=sp.n_trainable - sum(trained), experts=(), expert_adapters=()),
            replace(sp, piece=replace(sp.piece, matrices=[m // plan.ep for m in trained]), n_params=n // plan.ep,
                    n_trainable=sum(trained) // plan.ep, experts=(), expert_adapters=(),
                    ranks=plan.shard_ranks // plan.ep)]


def prefetched_part(plan: Plan, sp: StagePiece) -> StagePiece:
    """What FSDP2 prefetches of a zero-3 block while the one after it runs its backward: the block's own unit (under
    ep its dense part, `ep_parts`). It prefetches one unit, in reverse post-forward order, where a block's experts
    come before the block (torch's FSDPParamGroup._backward_prefetch): the experts' unit is gathered only once the
    block's own backward reaches it, beside the block's own unit, which stays gathered until the block is done."""
    return ep_parts(plan, sp)[0]


def rank_stages(plan: Plan, prof: ModelProfile, pp_rank: int) -> dict[int, list[StagePiece]]:
    """Global stage index -> its pieces, for the stages pipeline rank pp_rank runs."""
    experts, adapters = expert_tensors(prof), expert_adapters(prof)
    ranges = plan.stage_ranges()
    last = len(ranges) - 1
    out: dict[int, list[StagePiece]] = {}
    for k in plan.stages_of(pp_rank):
        blocks = ranges[k]
        pieces = [StagePiece(prof.embed, plan.root, prof.embed.num_params)] if k == 0 else []
        # a tiled MLP's block holds and runs what PieceProfile.tiled says
        pieces += [StagePiece(prof.blocks[i].tiled(plan.blocks[i].mlp_tiles), plan.blocks[i], prof.blocks[i].num_params,
                              experts=experts, expert_adapters=adapters, mask_bytes=prof.mask_bytes if i == blocks[0] else 0) for i in blocks]
        if k == last:
            # the head's stage holds its own copy of tied weights (runtime.tied_embeddings), on the embedding's rank
            # too where a V folds the last stage back: the two stages are separate FSDP2 roots
            tied = prof.tied_params if last > 0 else 0
            trainable = tied if prof.embed.num_trainable else 0  # a frozen embedding's copy is frozen too
            pieces.append(StagePiece(prof.head, plan.root, prof.head.num_params + tied,
                                     prof.head.num_trainable + trainable))
        out[k] = pieces
    return out


def wrapped_params(sp: StagePiece, dp: int) -> int:
    """Elements of the piece FSDP2 manages (runtime/sharding.py): a zero-0 unit leaves its frozen ones out, and
    a unit of one data-parallel rank its NF4 ones (torchao's all-gather hooks need a real all-gather)."""
    if sp.decision.zero == 0:
        return sp.n_trainable
    return sp.n_params - (sp.piece.quantized if dp == 1 else 0)


def gathered_bytes(plan: Plan, sp: StagePiece) -> int:
    """The unsharded copy FSDP2 all-gathers for the piece: the compute dtype, NF4 weights as they are stored (each
    matmul dequantizes its own, a transient). A model that runs unwrapped holds none in fp32, and below it the
    compute copies of its trainable parameters (runtime.precision), what a zero-0 unit gathers."""
    if plan.runs_unwrapped and plan.compute_dtype == "float32":
        return 0
    return sum(_gathered_bytes(plan, part) for part in ep_parts(plan, sp))


def _gathered_bytes(plan: Plan, sp: StagePiece) -> int:
    ranks = shard_ranks(plan, sp)
    nf4 = sp.piece.quantized if sp.decision.zero > 0 and ranks > 1 else 0
    return (wrapped_params(sp, ranks) - nf4) * DTYPE_BYTES[plan.compute_dtype] + nf4_bytes(nf4)


def stored_params(plan: Plan, sp: StagePiece, trainable_bytes: int = 4) -> dict[str, int]:
    """The piece's parameters as stored, unsharded: trainable ones at `trainable_bytes` each ("parameters"),
    frozen ones in the compute dtype ("frozen_parameters"), or in NF4 where quantized (QLoRA: about 0.52 bytes
    each)."""
    out = {"parameters": sp.n_trainable * trainable_bytes}
    if sp.n_params > sp.n_trainable:
        frozen = DTYPE_BYTES[plan.compute_dtype]
        nf4 = sp.piece.quantized
        out["frozen_parameters"] = (sp.n_params - sp.n_trainable - nf4) * frozen + nf4_bytes(nf4)
    return out


def _sharded(part: dict[str, int], div: int) -> dict[str, int]:
    return {k: _ceil_div(v, div) for k, v in part.items()}


def accumulating_grad_bytes(plan: Plan, sp: StagePiece) -> int:
    """Unsharded gradient held while gradient sync is off (microbatches before the last)."""
    return sum(part.n_trainable for part in ep_parts(plan, sp)) * DTYPE_BYTES[plan.reduce_dtype]


def optimizer_state_bytes(plan: Plan, sp: StagePiece) -> int:
    """This rank's bytes of the piece's optimizer states (plan.optimizer), wherever they live."""
    return sum(state_bytes(plan.optimizer, part.piece.matrices, part.n_trainable,
                           shard_ranks(plan, part) if part.decision.zero >= 1 else 1) for part in ep_parts(plan, sp))


def param_state(plan: Plan, sp: StagePiece) -> tuple[dict[str, int], dict[str, int]]:
    """(device, host) bytes of one piece held through a step (see the module docstring).

    Device gradients are the reduced shard; comm_buffers the compute copy a zero 0-2
    piece keeps from forward through backward (a zero-3 one gathers only while it runs).
    """
    dev: dict[str, int] = {}
    host: dict[str, int] = {}
    for part in ep_parts(plan, sp):
        d, h = _param_state(plan, part)
        for total, more in ((dev, d), (host, h)):
            for k, v in more.items():
                total[k] = total.get(k, 0) + v
    return dev, host


def _param_state(plan: Plan, sp: StagePiece) -> tuple[dict[str, int], dict[str, int]]:
    t, d, dp = sp.n_trainable, sp.decision, shard_ranks(plan, sp)
    div = dp if d.zero >= 1 else 1
    mb, states = master_bytes(plan.optimizer), optimizer_state_bytes(plan, sp)
    if d.placement.params_on_host:  # host shards serve as master weights; the device only gathers
        host = {**_sharded(stored_params(plan, sp, mb), dp), "gradients": _ceil_div(t * mb, dp),
                "optimizer_states": states}
        if dp == 1 and sp.piece.quantized:  # NF4 weights FSDP2 leaves out (wrapped_params) stay on the device
            nf4 = nf4_bytes(sp.piece.quantized)
            host["frozen_parameters"] -= nf4
            return {"frozen_parameters": nf4}, host
        return {}, host
    dev = {"comm_buffers": gathered_bytes(plan, sp) if d.zero < 3 else 0}
    if d.placement.steps_on_host:  # trainable shards stored in the compute dtype; masters, gradients, states on host
        cbytes = DTYPE_BYTES[plan.compute_dtype]
        dev.update(_sharded(stored_params(plan, sp, cbytes), div))
        host = {"master_weights": _ceil_div(t * mb, div), "gradients": _ceil_div(t * mb, div),
                "optimizer_states": states}
        if cbytes != mb:  # the masters cast for the copy back (runtime.offload's staged copies)
            host["staging"] = _ceil_div(t * cbytes, div)
        return dev, host
    dev.update(_sharded(stored_params(plan, sp, mb), div), gradients=_ceil_div(t * mb, div))
    if d.placement.streams_states:
        return dev, {"optimizer_states": states}
    dev["optimizer_states"] = states
    return dev, {}


def unit_pieces(pieces: list[StagePiece]) -> list[list[StagePiece]]:
    """The FSDP2 units (and optimizer units) among a rank's pieces: each block, and the root pieces together."""
    return [[sp] for sp in pieces if sp.is_block] + ([root] if (root := [sp for sp in pieces if not sp.is_block])
                                                      else [])


def stream_windows(plan: Plan, pieces: list[StagePiece]) -> tuple[dict[str, int], dict[str, int]]:
    """Device bytes of streamed optimizer states at each unit's reduce and at its step, by the unit's first
    piece's name (runtime.stream_states): a unit steps with its own states, and the next streamed block's coming
    in; it has them at its reduce already where the unit before it copied them in. Units step in the order
    backward finishes them: the last block first, then the root pieces, whose states (the largest: embedding and
    head) come in only for their own step."""
    units = unit_pieces(pieces)
    order = [u for u in units if u[0].is_block][::-1] + [u for u in units if not u[0].is_block]
    states = [sum(optimizer_state_bytes(plan, sp) for sp in u) if u[0].decision.placement.streams_states else 0
              for u in order]
    at_reduce, at_step = {}, {}
    prefetched = 0
    for k, u in enumerate(order):
        name = u[0].piece.name
        at_reduce[name] = prefetched
        later = next((i for i in range(k + 1, len(order)) if states[i]), None)
        prefetched = states[later] if states[k] and later is not None and order[later][0].is_block else 0
        at_step[name] = states[k] + prefetched if states[k] else at_reduce[name]
    return at_reduce, at_step


def stepping_gradients(plan: Plan, pieces: list[StagePiece]) -> int:
    """With the step in backward, the device gradient of the unit stepping: the largest unit's reduced shard."""
    return max((sum(param_state(plan, sp)[0].get("gradients", 0) for sp in u) for u in unit_pieces(pieces)),
               default=0)


def device_saved(sp: StagePiece) -> int:
    """Bytes of one microbatch's activations this piece keeps on device until its backward; a stage's first block
    also its documents' mask, whatever its policy (the Documents object holds it, not autograd)."""
    policy = sp.decision.policy if sp.is_block else KEEP
    if policy.on_host:
        return sp.mask_bytes
    return sp.mask_bytes + sp.piece.saved_bytes.get(policy.keeps, sp.piece.saved_bytes["keep"])


def host_saved(sp: StagePiece) -> int:
    """Bytes of one microbatch's activations this piece keeps on host until its backward: all it saves
    ("offload") or its recomputation checkpoint, the block input ("recompute_offload")."""
    if not (sp.is_block and sp.decision.policy.on_host):
        return 0
    return sp.piece.saved_bytes[sp.decision.policy.keeps]


def output_grad_bytes(plan: Plan, sp: StagePiece) -> int:
    """What a split backward (zero-bubble schedules) holds of one microbatch between its I and its W beyond the
    saved activations: the gradient of each trainable linear layer's output, which torch keeps for the weight
    GEMM (pipelining's stage_backward_input)."""
    share = sp.n_trainable / max(sp.n_params, 1)
    return int(sum(m * n for m, n, _ in sp.piece.gemms) * share) * DTYPE_BYTES[plan.compute_dtype]
