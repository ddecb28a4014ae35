"""Profile data: plain dataclasses (no torch) so that plan/ can read them."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

# 2: trainable counts; HF models profiled as HFCausalLM; 3: operator counts; 4: paired timing; 5: recompute intercepts
# 9: forward GEMM shapes (plan.kernels); 8: GPU kernels' saved tensors (profile.kernels); 7: 1-D parameter counts
# 10: attention's head dim; the GPU kernels' attention backward counted once (2.5 forwards), not with a recompute more
# 11: no memory traffic for ops that make no tensor (fake tensors' metadata queries) or are views (_unsafe_view);
# the GPU kernels' RMSNorm one pass each way
# 12: operators counted only where they make a tensor (eager runs dispatch no metadata queries)
# 14: "selective_half"'s saved bytes and measured recompute time; 15-16: trainable matrices' sizes (quantized states),
# the peaks' fixed part; 17: compiled blocks (profile.compiled); 18: eager NF4 traffic as torchao moves it
# 20: a block's MLP share (mlp_share), what a tiled MLP divides; 21: trainable parameters by kind (expert adapters)
PROFILE_VERSION = 22
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


NF4_BLOCK = 64  # weights per absmax scale (QLoRA's)
NF4_SCALER_BLOCK = 256  # scales per block of their own 8-bit quantization (QLoRA's double quantization)


# Operators one NF4 linear dispatches beyond a plain one (forward, backward), counted through torchao 0.18's
# linear_nf4 at any shape (tests/test_qlora.py recounts them): its dequantization unpacks the 4-bit codes, looks
# them up, rescales by the double-quantized scales and reshapes, once in forward and again for the input's
# gradient. Each is a kernel launch and a host dispatch; a GPU plan whose blocks are dispatch-bound pays them.
NF4_LINEAR_OPS = (25, 24)
# Bytes those operators read and write per NF4 weight, in each pass, counted as the profile counts eager traffic
# (tests/test_qlora.py recounts it, at bf16): the codes unpacked to int64 indices, looked up, rescaled, and stacked
# into the bf16 weight: 35 bytes where the fused kernel a compiled block runs moves the 4-bit codes in and the
# bf16 weight out (2.5 bytes). Eager QLoRA's cost beside LoRA is mostly this traffic.
NF4_LINEAR_BYTES = 35.11


def nf4_bytes(n: int) -> int:
    """Bytes NF4 stores for n weights: 4 bits each, an 8-bit scale per block, an fp32 factor per scaler block."""
    return n // 2 + n // NF4_BLOCK + 4 * (n // (NF4_BLOCK * NF4_SCALER_BLOCK) + 1) if n else 0


# the parts of PieceProfile.mlp_share no micro-batch size changes
MLP_FIXED = frozenset({"ops", "bwd_ops", "grads", "input_kept"})


@dataclass
class PieceProfile:
    """One piece (embedding, a block, or the last piece: final norm + head + loss) for one microbatch."""

    name: str
    params: dict[str, int] = field(default_factory=dict)  # dtype -> element count
    input_bytes: int = 0  # hidden state entering the piece
    output_bytes: int = 0  # hidden state leaving it (sent to the next stage)
    saved_bytes: dict[str, int] = field(default_factory=dict)  # activation policy (plan.ACTIVATION_POLICIES) -> bytes
    fwd_peak_bytes: int = 0  # peak live bytes during forward, above what was live at its start
    bwd_peak_bytes: int = 0  # same for backward (includes this piece's fresh gradients)
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_mem_bytes: float = 0.0  # bytes moved by memory-bound (non-matmul) ops
    bwd_mem_bytes: float = 0.0
    # of the tensors it allocates, the bytes a CPU rank's allocator maps afresh and pages in at first touch
    # (profile.record.OpCost.fresh_bytes; plan.timing charges them at GPU.page_in_bytes_per_s)
    fwd_fresh_bytes: float = 0.0
    bwd_fresh_bytes: float = 0.0
    fwd_ops: int = 0  # operators dispatched (the same at any micro-batch size)
    bwd_ops: int = 0
    fwd_time_s: float | None = None  # measured on ModelProfile.device, if measured
    bwd_time_s: float | None = None
    fwd_fixed_s: float = 0.0  # of which the part no batch size changes (dispatch, launches): measured intercept
    bwd_fixed_s: float = 0.0
    recompute_time_s: dict[str, float] = field(default_factory=dict)  # measured: policy -> extra seconds
    recompute_fixed_s: dict[str, float] = field(default_factory=dict)  # of which the part no batch size changes
    trainable: int | None = None  # trainable elements (LoRA, frozen pieces); None: all of them
    quantized: int = 0  # of the frozen ones, those stored in 4-bit NF4 (QLoRA base weights)
    vectors: int = 0  # elements of 1-D parameters (norm weights, biases): what tensor parallelism does not split
    # the forward's 2-D matmuls (the linear layers) as [M, N, K], M the microbatch's tokens: what plan.kernels
    # times by tile and wave on a GPU (their backward is two GEMMs of the same sizes, transposed)
    gemms: list[list[int]] = field(default_factory=list)
    # of gemms, the indices of the experts' grouped GEMMs (each group one entry): what the routing's imbalance
    # slows (plan.timing.expert_gemm_time)
    expert_gemms: list[int] = field(default_factory=list)
    head_dim: int = 0  # of its attention (the FLOPs beyond the GEMMs): what flash attention's rate depends on; 0: none
    # run as a compiled graph (Plan.compile, profile.compiled): saved bytes, memory traffic and operators (then
    # kernel launches) are the compiled graphs'
    compiled: bool = False
    # elements of each trainable parameter of 2 dimensions or more: whether torchao quantizes a tensor's optimizer
    # states depends on its size (plan.optimizer); the rest of the trainable elements are 1-D
    matrices: list[int] = field(default_factory=list)
    # of fwd_peak_bytes and bwd_peak_bytes, the part no micro-batch size changes (fresh gradients; the chunked
    # loss's logits, one chunk of tokens at any batch): the intercept of a second recording at twice the
    # micro-batch (profile.profile_module); -1: not recorded
    fwd_peak_fixed_bytes: int = -1
    bwd_peak_fixed_bytes: int = -1
    # a block's MLP within its peaks (profile.record's PhaseStats.mlp), what a tiled MLP divides (`tiled`), in bytes
    # above the block's start in each phase: fwd_/bwd_ "before" and "after" it (the peaks outside it), "at" its
    # start, "inner" (its own intermediates: the peak inside less its output, forward, or its input's and its
    # parameters' gradients, backward: "in_grad", "grads"); "out" its output, "saved" what it saves of its own
    # making, "input_kept" 1 where its input is saved anyway; its forward's "flops", "mem_bytes", "ops" and its
    # backward's "bwd_ops". Empty: no MLP found (nothing to tile)
    mlp_share: dict[str, float] = field(default_factory=dict)

    @property
    def num_trainable(self) -> int:
        return self.num_params if self.trainable is None else self.trainable

    @property
    def num_params(self) -> int:
        return sum(self.params.values())

    def param_bytes(self, itemsize: int) -> int:
        return self.num_params * itemsize

    def tiled(self, tiles: int) -> "PieceProfile":
        """This block as it runs with its MLP in `tiles` tiles of the sequence (model.tiled_mlp): the MLP keeps
        only its input for backward, its intermediates exist a tile at a time in forward and in backward, and its
        backward recomputes its forward first (one more MLP forward: FLOPs, traffic, operators per tile).

        Peaks, above the block's start: forward max(before, at + out + inner / tiles, after - saved), the bytes
        it no longer saves gone after it; backward, whose start holds them no more either, max(before, at +
        in_grad + 2 grads + (inner + saved) / tiles, after + saved): a tile's recomputed intermediates and their
        gradients, and after the MLP the same bytes live as untiled."""
        m = self.mlp_share
        if tiles == 1 or not m:
            return self
        saved = m["saved"]
        keep = self.saved_bytes["keep"] - saved + (0 if m["input_kept"] else self.input_bytes)
        fwd = max(m["fwd_before"], m["fwd_at"] + m["out"] + m["fwd_inner"] / tiles, m["fwd_after"] - saved)
        # a tile's parameter gradients beside their running sum: twice the MLP's
        bwd = max(m["bwd_before"], m["bwd_at"] + m["in_grad"] + 2 * m["grads"] + (m["bwd_inner"] + saved) / tiles,
                  m["bwd_after"] + saved)
        share = m["flops"] / self.fwd_flops if self.fwd_flops else 0.0
        return replace(
            self, saved_bytes={**self.saved_bytes, "keep": keep}, fwd_peak_bytes=int(fwd),
            bwd_peak_bytes=int(bwd), fwd_peak_fixed_bytes=-1, bwd_peak_fixed_bytes=-1,
            bwd_flops=self.bwd_flops + m["flops"], bwd_mem_bytes=self.bwd_mem_bytes + m["mem_bytes"],
            fwd_ops=self.fwd_ops + int(m["ops"]) * (tiles - 1),
            bwd_ops=self.bwd_ops + int(m["ops"]) * tiles + int(m["bwd_ops"]) * (tiles - 1),
            bwd_time_s=None if self.bwd_time_s is None else self.bwd_time_s + share * (self.fwd_time_s or 0.0),
            gemms=self.gemms, mlp_share={})


def kinds_text(counts: dict[str, int]) -> str:
    """'attention 1,024, MLP 0, experts 8,192, router 0, other 0': trainable parameters by kind, as `snugfit plan`
    prints them and `snugfit train` logs them."""
    return ", ".join(f"{kind} {n:,}" for kind, n in counts.items())


@dataclass
class ModelProfile:
    model: str  # a name for messages
    config: dict  # ModelConfig dict or HF config dict
    micro_batch_size: int
    seq_len: int
    dtype: str
    embed: PieceProfile
    blocks: list[PieceProfile]
    head: PieceProfile
    tied_params: int = 0  # parameters shared by embedding and head (counted in embed)
    device: str | None = None  # where fwd/bwd times were measured
    # trainable parameters by kind (attention, MLP, experts, router, other), model.lora.trainable_by_kind's: what
    # `snugfit plan` prints, as `snugfit train` logs it of the model it trains
    trainable_by_kind: dict[str, int] = field(default_factory=dict)
    version: int = PROFILE_VERSION
    # packed examples (data.packing): the attention mask of one microbatch's documents, which a stage makes in its
    # first block's forward and every block shares until that block's backward (model.decoder.Documents), as the
    # target device runs it: dense seq x seq on CPU, a FlexAttention block mask on GPUs. Per row of the whole
    # sequence: a context-parallel rank holds all of it. 0: not packed
    mask_bytes: int = 0

    @property
    def compiled(self) -> bool:
        """Its blocks run compiled (Plan.compile)."""
        return any(b.compiled for b in self.blocks)

    @property
    def pieces(self) -> list[PieceProfile]:
        return [self.embed, *self.blocks, self.head]

    def num_params(self) -> int:
        return sum(p.num_params for p in self.pieces)

    def summary(self) -> dict:
        """What was planned, for the plan's `model` field: exact parameter counts (tied weights once)."""
        c = self.config
        return {"name": self.model, "parameters": self.num_params(),
                "trainable": sum(p.num_trainable for p in self.pieces),
                "quantized_nf4": sum(p.quantized for p in self.pieces), "blocks": len(self.blocks),
                "hidden": c.get("dim") or c.get("hidden_size") or c.get("n_embd") or c.get("d_model"),
                "vocabulary": c.get("vocab_size"), **self._active(),
                **({"trainable_by_kind": self.trainable_by_kind} if self.trainable_by_kind else {})}

    def _active(self) -> dict:
        """{"active": the parameters a token runs through} of a Mixture-of-Experts model (its top-k experts of all,
        3 * hidden * width each: SwiGLU), nothing for a dense one."""
        c = self.config
        experts = c.get("n_experts") or c.get("num_experts") or c.get("num_local_experts") or 0
        width = c.get("moe_ffn_dim") or c.get("moe_intermediate_size") or c.get("intermediate_size") or 0
        hidden = c.get("dim") or c.get("hidden_size") or 0
        if not experts:
            return {}
        idle = (experts - (c.get("top_k") or c.get("num_experts_per_tok") or 0)) * 3 * hidden * width
        return {"active": self.num_params() - len(self.blocks) * idle}

    def train_flops(self) -> float:
        """FLOPs of one microbatch forward + backward (no recomputation)."""
        return sum(p.fwd_flops + p.bwd_flops for p in self.pieces)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelProfile":
        d = dict(d)
        d["embed"] = PieceProfile(**d["embed"])
        d["head"] = PieceProfile(**d["head"])
        d["blocks"] = [PieceProfile(**b) for b in d["blocks"]]
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | Path) -> "ModelProfile":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def scaled(self, micro_batch_size: int) -> "ModelProfile":
        """This profile at another micro-batch size: activations, FLOPs and times are linear in it,
        except the fixed part of measured times (fwd/bwd_fixed_s), which stays."""
        if micro_batch_size == self.micro_batch_size:
            return self
        r = micro_batch_size / self.micro_batch_size
        itemsize = DTYPE_BYTES[self.dtype]

        def time(t: float | None, fixed: float) -> float | None:
            return None if t is None else fixed + (t - fixed) * r

        def peak(total: int, fixed: int, guess: int) -> int:
            fixed = guess if fixed < 0 else fixed  # not recorded: the guess (nothing, or the fresh gradients)
            return fixed + int((total - fixed) * r)

        def piece(p: PieceProfile) -> PieceProfile:
            grads = min(p.bwd_peak_bytes, p.param_bytes(itemsize))  # fresh gradients do not scale
            return replace(
                p, input_bytes=int(p.input_bytes * r), output_bytes=int(p.output_bytes * r),
                saved_bytes={k: int(v * r) for k, v in p.saved_bytes.items()},
                fwd_peak_bytes=peak(p.fwd_peak_bytes, p.fwd_peak_fixed_bytes, 0),
                bwd_peak_bytes=peak(p.bwd_peak_bytes, p.bwd_peak_fixed_bytes, grads),
                fwd_flops=p.fwd_flops * r, bwd_flops=p.bwd_flops * r, fwd_mem_bytes=p.fwd_mem_bytes * r,
                bwd_mem_bytes=p.bwd_mem_bytes * r, fwd_fresh_bytes=p.fwd_fresh_bytes * r,
                bwd_fresh_bytes=p.bwd_fresh_bytes * r, gemms=[[round(m * r), n, k] for m, n, k in p.gemms],
                fwd_time_s=time(p.fwd_time_s, p.fwd_fixed_s), bwd_time_s=time(p.bwd_time_s, p.bwd_fixed_s),
                recompute_time_s={k: time(v, p.recompute_fixed_s.get(k, 0.0)) for k, v in p.recompute_time_s.items()},
                mlp_share={k: v if k in MLP_FIXED else v * r for k, v in p.mlp_share.items()},
            )

        return replace(self, micro_batch_size=micro_batch_size, embed=piece(self.embed),
                       blocks=[piece(b) for b in self.blocks], head=piece(self.head),
                       mask_bytes=int(self.mask_bytes * r))

    def split(self, tp: int) -> "ModelProfile":
        """This profile as one of `tp` tensor-parallel ranks holds and runs it (runtime.tensor_parallel).

        Matrices are split (column- or row-wise, the embedding and head by vocabulary), 1-D parameters (norms,
        biases) replicated; FLOPs, memory traffic and measured times divide, but for the fixed part of times.
        Sequence parallelism slices the residual stream, so what blocks send and keep divides too, except the
        two whole-sequence inputs of the attention and MLP projections (all-gathered, saved by autograd on every
        rank). Recomputation gathers them again rather than keeping them. The head runs its norm on the whole
        sequence (its input and output, the linear's input: two whole hidden states on every rank); what it
        keeps and holds beyond them is the loss's, logits-sized and split by vocabulary (loss_parallel).
        """
        if tp == 1:
            return self

        def share(n: int, kept: int) -> int:
            return (n - kept) // tp + kept

        def time(t: float | None, fixed: float) -> float | None:
            return None if t is None else fixed + (t - fixed) / tp

        def piece(p: PieceProfile, block: bool) -> PieceProfile:
            whole = p.input_bytes  # one whole-sequence hidden state (the profile's is unsplit)
            big = max(p.params, key=p.params.get) if p.params else None  # the dtype holding the matrices
            params = {k: (share(v, min(p.vectors, v)) if k == big else v) for k, v in p.params.items()}
            trainable = None if p.trainable is None else share(p.trainable, min(p.vectors, p.trainable))
            out = replace(
                p, params=params, trainable=trainable, quantized=p.quantized // tp, mlp_share={},  # tiles need tp 1
                matrices=[n // tp for n in p.matrices], fwd_peak_fixed_bytes=-1, bwd_peak_fixed_bytes=-1,
                fwd_flops=p.fwd_flops / tp, bwd_flops=p.bwd_flops / tp, fwd_mem_bytes=p.fwd_mem_bytes / tp,
                bwd_mem_bytes=p.bwd_mem_bytes / tp, fwd_fresh_bytes=p.fwd_fresh_bytes / tp,
                bwd_fresh_bytes=p.bwd_fresh_bytes / tp, fwd_time_s=time(p.fwd_time_s, p.fwd_fixed_s),
                gemms=[[m, max(1, n // tp), k] for m, n, k in p.gemms],  # a column-wise split; row-wise: the same work
                bwd_time_s=time(p.bwd_time_s, p.bwd_fixed_s),
                recompute_time_s={k: time(v, p.recompute_fixed_s.get(k, 0.0)) for k, v in p.recompute_time_s.items()},
            )
            if p.name == "head":
                def vocab(n: int) -> int:
                    return share(n, min(n, 2 * whole))

                return replace(out, input_bytes=p.input_bytes // tp, fwd_peak_bytes=vocab(p.fwd_peak_bytes),
                               bwd_peak_bytes=vocab(p.bwd_peak_bytes),
                               saved_bytes={k: vocab(v) for k, v in p.saved_bytes.items()})
            out.output_bytes = p.output_bytes // tp
            if block:
                keep = p.saved_bytes["keep"]
                out.input_bytes = p.input_bytes // tp
                out.saved_bytes = {k: v // tp for k, v in p.saved_bytes.items()}
                out.saved_bytes["keep"] = share(keep, min(keep, 2 * whole))
                out.fwd_peak_bytes = p.fwd_peak_bytes // tp + whole
                out.bwd_peak_bytes = p.bwd_peak_bytes // tp + whole
            return out

        return replace(self, embed=piece(self.embed, False), blocks=[piece(b, True) for b in self.blocks],
                       head=piece(self.head, False))
