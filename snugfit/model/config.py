"""The model's shape (ModelConfig): plain data, without torch, so that planning a model does not import torch."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

ARCHS = ("llama", "gpt2")
ATTENTIONS = ("sdpa", "eager")


@dataclass
class ModelConfig:
    arch: str = "llama"
    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # grouped-query attention when < n_heads
    ffn_dim: int | None = None  # default: llama 8/3*dim rounded up to 32, gpt2 4*dim
    max_seq_len: int = 256
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attention: str = "sdpa"  # "eager" materialises the s*s scores (profiling, tests)
    n_experts: int = 0  # Mixture-of-Experts MLPs (model.moe) with this many experts; 0: dense
    top_k: int = 2  # experts each token is routed to
    n_shared_experts: int = 0  # dense experts every token runs through, beside the routed ones
    moe_ffn_dim: int | None = None  # each expert's width; default ffn_dim
    router_aux_coef: float = 0.01  # the load-balancing loss's coefficient (mean over layers)
    name: str = ""  # a Hugging Face model folder, hub id (from the local cache) or config.json to train instead

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.ffn_dim is None:
            if self.arch == "llama":
                self.ffn_dim = 32 * math.ceil(int(8 * self.dim / 3) / 32)
            else:
                self.ffn_dim = 4 * self.dim
        if self.moe_ffn_dim is None:
            self.moe_ffn_dim = self.ffn_dim

    def validate(self) -> None:
        """Raise ValueError naming the bad field and what is allowed."""
        if self.arch not in ARCHS:
            raise ValueError(f"model.arch must be one of {ARCHS}, got {self.arch!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"model.attention must be one of {ATTENTIONS}, got {self.attention!r}")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len", "top_k",
                     "moe_ffn_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be a positive integer, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads ({self.n_kv_heads})")
        if self.arch == "llama" and (self.dim // self.n_heads) % 2:
            raise ValueError("model.dim / model.n_heads must be even for rotary embeddings")
        if self.n_experts:
            self._validate_moe()

    def _validate_moe(self) -> None:
        if self.n_experts < 2:
            raise ValueError(f"model.n_experts must be 0 (dense) or at least 2, got {self.n_experts}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"model.top_k ({self.top_k}) must be between 1 and model.n_experts ({self.n_experts})")
        if self.arch != "llama":
            raise ValueError("model.n_experts needs arch 'llama' (SwiGLU experts); set model.arch = 'llama'")
        if self.n_shared_experts < 0 or self.router_aux_coef < 0:
            raise ValueError("model.n_shared_experts and model.router_aux_coef must not be negative")
        if self.dim % 8 or self.moe_ffn_dim % 8:  # torch's grouped GEMM wants rows of 16-byte multiples
            raise ValueError(f"model.dim ({self.dim}) and model.moe_ffn_dim ({self.moe_ffn_dim}) must be multiples "
                             "of 8 for the experts' grouped GEMM")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    # -- analytic counts, used by the profiler and checked against the instantiated model --
    def block_params(self, active: bool = False) -> int:
        """A block's parameters; active: those a token runs through (an MoE block's top_k experts of all)."""
        d, kv = self.dim, self.n_kv_heads * self.head_dim
        attn = d * d + 2 * d * kv + d * d  # q, k, v, o
        if self.n_experts:
            experts = self.top_k if active else self.n_experts
            mlp = d * self.n_experts + 3 * d * self.moe_ffn_dim * (experts + self.n_shared_experts)
            return attn + mlp + 2 * d
        if self.arch == "llama":
            return attn + 3 * d * self.ffn_dim + 2 * d  # gate/up/down, two RMSNorm weights
        biases = 2 * d + 2 * kv + self.ffn_dim + d
        return attn + 2 * d * self.ffn_dim + biases + 4 * d  # two LayerNorms with bias

    def embed_params(self) -> int:
        pos = self.max_seq_len * self.dim if self.arch == "gpt2" else 0
        return self.vocab_size * self.dim + pos

    def head_params(self) -> int:
        norm = self.dim if self.arch == "llama" else 2 * self.dim
        return norm + (0 if self.tie_embeddings else self.vocab_size * self.dim)

    def num_params(self, active: bool = False) -> int:
        return self.embed_params() + self.n_layers * self.block_params(active) + self.head_params()

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), matmuls and attention."""
        d, kv = self.dim, self.n_kv_heads * self.head_dim
        per_block = 2 * (2 * d * d + 2 * d * kv) + 2 * (2 * seq_len * d) / 2  # projections + causal attention
        if self.n_experts:  # the active experts and the router
            per_block += 2 * 3 * d * self.moe_ffn_dim * (self.top_k + self.n_shared_experts) + 2 * d * self.n_experts
        else:
            per_block += 2 * (3 if self.arch == "llama" else 2) * d * self.ffn_dim
        forward = self.n_layers * per_block + 2 * d * self.vocab_size
        return 3 * forward


def parse_targets(text: str) -> tuple[str, ...] | None:
    """`finetune.lora_targets` ("attn.q, attn.v", "all-linear") as model.lora.apply_lora takes it; None (the
    default) when empty. The one parser, so that `snugfit plan` profiles the adapters `snugfit train` builds; here,
    without torch, since it keys the profile cache (profile.cache)."""
    return tuple(t for t in (t.strip() for t in text.split(",")) if t) or None
