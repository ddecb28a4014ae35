"""What the rules (plan.rules) need to know of a model: a plain record, built from its profile here and from the
module in runtime/ (runtime.tensor_parallel.model_facts), so the planner and the runtime refuse a plan the model
cannot run by the same rule, with the same line. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from snugfit.profile.types import ModelProfile

# Hugging Face model types whose MLP a tile-wise forward would change (model.tiled_mlp.UNTILEABLE says why)
UNTILEABLE_TYPES = {"gpt2": "GPT-2's MLP (dropout inside)", "opt": "OPT's fc1/fc2 (no MLP module of their own)"}

MOE_UNTILEABLE = "a Mixture-of-Experts MLP (its router's auxiliary-loss statistics would need summing across tiles)"


def untileable_config(c: dict) -> str | None:
    """Why a profiled model's MLPs cannot be tiled, read off its config; None where they can."""
    if c.get("model_type") in UNTILEABLE_TYPES:
        return UNTILEABLE_TYPES[c["model_type"]]
    experts = c.get("n_experts") or c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts")
    return MOE_UNTILEABLE if experts else None


# Hugging Face model types whose experts expert parallelism runs (transformers 5's fused SwiGLU experts, gate first:
# runtime.expert_parallel.DispatchedExperts); gpt-oss (biases, a clamped SwiGLU) and DeepSeek-V3 are not among them
EXPERT_PARALLEL_HF = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe")


@dataclass(frozen=True)
class ModelFacts:
    """The model's sizes tensor parallelism splits, its length limit and what no split handles yet; None where it is
    not known (its rules then pass)."""

    heads: int | None = None
    kv_heads: int | None = None  # key/value heads
    mlp_hidden: int | None = None  # the MLP's hidden width
    vocabulary: int | None = None
    max_seq_len: int | None = None  # the built-in decoder's (a Hugging Face model's is its position embedding's)
    tied_embeddings: bool = False  # the head's weight is the embedding's
    adapters: bool = False  # LoRA adapters beside frozen weights
    # a block type tensor parallelism has no layout for (runtime.tensor_parallel.LAYOUTS); None where it has one
    unsplittable_block: str | None = None
    n_experts: int = 0  # a Mixture-of-Experts block's experts (0: dense)
    top_k: int = 0  # experts each token runs through
    # why its blocks' MLPs cannot be tiled (model.tiled_mlp.untileable); None where they can
    untileable_mlp: str | None = None
    # whose attention layers these are (the built-in decoder's: "built-in", else the HF class), and whether
    # context parallelism can split their sequences (runtime.context_parallel's all-to-alls around attention)
    attention: str | None = None
    sequence_splits: bool = True
    # whether expert parallelism can split its experts (runtime.expert_parallel dispatches the built-in decoder's)
    expert_splits: bool = True
    # QLoRA's NF4 base asked of a Mixture-of-Experts model: NF4 (torchao's NF4Tensor, 2-D only) does not hold its
    # 3-D expert weights, which would stay in the compute dtype unannounced
    nf4_experts: bool = False

    @classmethod
    def of_profile(cls, prof: ModelProfile) -> "ModelFacts":
        """What the profile knows: its config's sizes (built-in or Hugging Face names), whether it ties, adapters."""
        c = prof.config
        heads = c.get("n_heads") or c.get("num_attention_heads")
        experts = c.get("n_experts") or c.get("num_local_experts") or c.get("num_experts") or c.get(
            "n_routed_experts") or 0
        top_k = c.get("top_k") or c.get("num_experts_per_tok") or 0 if experts else 0
        builtin = "n_heads" in c
        return cls(n_experts=experts, top_k=top_k,
                   unsplittable_block="Mixture-of-Experts blocks" if experts else None,
                   attention="built-in" if builtin else c.get("model_type"),
                   sequence_splits=builtin or c.get("model_type") != "gpt_oss",  # runtime.context_parallel: no sinks
                   expert_splits=builtin or not experts or c.get("model_type") in EXPERT_PARALLEL_HF,
                   heads=heads, kv_heads=c.get("n_kv_heads") or c.get("num_key_value_heads") or heads,
                   mlp_hidden=c.get("ffn_dim") or c.get("intermediate_size"), vocabulary=c.get("vocab_size"),
                   max_seq_len=c.get("max_seq_len"), tied_embeddings=bool(prof.tied_params),
                   adapters=any(p.trainable is not None and 0 < p.trainable < p.num_params for p in prof.pieces),
                   untileable_mlp=untileable_config(c),
                   nf4_experts=bool(experts) and any(p.quantized for p in prof.pieces))

    def split_sizes(self) -> dict[str, int | None]:
        """The sizes a tensor-parallel degree must divide, by what they are called in messages."""
        return {"heads": self.heads, "key/value heads": self.kv_heads, "MLP hidden size": self.mlp_hidden,
                "vocabulary": self.vocabulary}
