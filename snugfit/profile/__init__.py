"""Profiling: per-piece parameters, saved activations, FLOPs (and optionally times) of a model.

The data classes (types.py) are torch-free for plan/; building a profile needs torch,
so profile_model and friends load lazily.
"""

from snugfit.profile.types import ModelProfile, PieceProfile

__all__ = ["ModelParts", "ModelProfile", "PieceProfile", "measure_times", "profile_model"]


def __getattr__(name: str):
    if name in ("profile_model", "measure_times"):
        from snugfit.profile import profile

        return getattr(profile, name)
    if name == "ModelParts":
        from snugfit.profile import record

        return getattr(record, name)
    raise AttributeError(name)
