"""The multi-rank tests' process runner (it lives in snugfit.runtime.spawn, which bench/ uses too)."""

from snugfit.runtime.spawn import run_ranks

__all__ = ["run_ranks"]
