"""Models snugfit trains: the built-in decoder (and, through adapters, Hugging Face causal LMs)."""

from snugfit.model.decoder import Decoder, ModelConfig, cross_entropy

__all__ = ["Decoder", "ModelConfig", "cross_entropy"]
