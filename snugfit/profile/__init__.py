"""Profiling: per-piece parameters, saved activations, FLOPs (and optionally times) of a model.

The data classes (types.py) and the profile cache (cache.py) are torch-free for plan/ and a cached plan;
building a profile needs torch, so measure_times and ModelParts load lazily.
"""

from snugfit.profile.cache import profile_model
from snugfit.profile.types import ModelProfile, PieceProfile

__all__ = ["ModelParts", "ModelProfile", "PieceProfile", "measure_times", "profile_model"]


def __getattr__(name: str):
    if name == "measure_times":
        from snugfit.profile import profile

        return profile.measure_times
    if name == "ModelParts":
        from snugfit.profile import record

        return record.ModelParts
    raise AttributeError(name)
