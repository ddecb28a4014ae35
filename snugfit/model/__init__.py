"""Models snugfit trains: the built-in decoder (and, through adapters, Hugging Face causal LMs).

The decoder is imported when first asked for, so that what needs only a model's shape (snugfit/model/config.py:
the planner, `snugfit plan` with its profile cached) does not import torch.
"""

from snugfit.model.config import ModelConfig

__all__ = ["Decoder", "ModelConfig", "cross_entropy"]


def __getattr__(name: str):
    if name in ("Decoder", "cross_entropy"):
        from snugfit.model import decoder
        return getattr(decoder, name)
    raise AttributeError(f"module 'snugfit.model' has no attribute {name!r}")
