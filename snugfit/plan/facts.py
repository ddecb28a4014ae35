"""What the rules (plan.rules) need to know of a model: a plain record, built from its profile here and from the
module in runtime/ (runtime.tensor_parallel.model_facts), so the planner and the runtime refuse a plan the model
cannot run by the same rule, with the same line. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from snugfit.profile.types import ModelProfile


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
    # whose attention layers these are (the built-in decoder's: "built-in", else the HF class), and whether
    # context parallelism can split their sequences (runtime.context_parallel's all-to-alls around attention)
    attention: str | None = None
    sequence_splits: bool = True

    @classmethod
    def of_profile(cls, prof: ModelProfile) -> "ModelFacts":
        """What the profile knows: its config's sizes (built-in or Hugging Face names), whether it ties, adapters."""
        c = prof.config
        heads = c.get("n_heads") or c.get("num_attention_heads")
        builtin = "n_heads" in c
        return cls(heads=heads, attention="built-in" if builtin else c.get("model_type"), sequence_splits=builtin, kv_heads=c.get("n_kv_heads") or c.get("num_key_value_heads") or heads,
                   mlp_hidden=c.get("ffn_dim") or c.get("intermediate_size"), vocabulary=c.get("vocab_size"),
                   max_seq_len=c.get("max_seq_len"), tied_embeddings=bool(prof.tied_params),
                   adapters=any(p.trainable is not None and 0 < p.trainable < p.num_params for p in prof.pieces))

    def split_sizes(self) -> dict[str, int | None]:
        """The sizes a tensor-parallel degree must divide, by what they are called in messages."""
        return {"heads": self.heads, "key/value heads": self.kv_heads, "MLP hidden size": self.mlp_hidden,
                "vocabulary": self.vocabulary}
