"""The compute dtype of a run: what the user asked for, or for "auto" what the hardware does best."""

from __future__ import annotations

from snugfit.errors import SnugfitError
from snugfit.hardware.cluster import Cluster

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
# What users write for them (the README and most tools say bf16): read as the names above wherever a dtype is taken
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def canonical_dtype(name: str) -> str:
    """'bf16' -> 'bfloat16'; any other name as given (the caller's choices check it)."""
    return DTYPE_ALIASES.get(name.lower(), name) if isinstance(name, str) else name


def choose_dtype(requested: str, devices: str, has_bf16: bool, on_cpu: bool) -> tuple[str, str]:
    """(dtype, why it was chosen). `devices` names the hardware in the message ("RTX4090", "Tesla V100")."""
    if on_cpu:
        if requested == "auto":
            return "float32", "CPU ranks compute in float32 (most CPUs have no bf16 matmul units)"
        return requested, "as asked"
    if requested == "bfloat16" and not has_bf16:
        raise SnugfitError(f"{devices} has no bfloat16; use --dtype float16 (with loss scaling) or --dtype auto")
    if requested != "auto":
        return requested, "as asked"
    if has_bf16:
        return "bfloat16", f"{devices} computes in bf16"  # what weights and states are held in: the optimizer line
    return "float16", f"{devices} has no bf16: float16 with dynamic loss scaling"


def dtype_for_cluster(requested: str, cluster: Cluster) -> tuple[str, str]:
    """choose_dtype for a planned cluster: bf16 only where every GPU has it (the catalogue's figures say)."""
    gpus = {cluster.gpu_of(r).name: cluster.gpu_of(r) for r in range(cluster.world_size)}
    on_cpu = all(name == "cpu" for name in gpus)
    has_bf16 = all(g.tflops.get("bfloat16") for g in gpus.values())
    return choose_dtype(requested, " and ".join(gpus), has_bf16, on_cpu)
