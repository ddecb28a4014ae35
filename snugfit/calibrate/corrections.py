"""The time model's corrections a run measured (plan.corrections), kept beside this machine's hardware profile and
keyed by machine and model shape, so the next plan for the same ranks and model starts from them."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from snugfit.hardware.catalogue import hardware_cache_path
from snugfit.hardware.cluster import Cluster
from snugfit.hardware.load import is_busy, other_load_now
from snugfit.plan.corrections import TimeCorrections, cards_of, machine_key, on_cluster, shape_key
from snugfit.profile.types import ModelProfile


def corrections_path() -> Path:
    """corrections.json in the hardware profile's folder ($SNUGFIT_HARDWARE_PROFILE moves both;
    $SNUGFIT_CORRECTIONS names the file apart: the tests keep theirs out of the user's)."""
    return Path(os.environ.get("SNUGFIT_CORRECTIONS") or hardware_cache_path().with_name("corrections.json"))


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or a torn write of an older snugfit: start again
        return {}


def load_corrections(machine: str, shape: str) -> TimeCorrections | None:
    """The corrections last measured for these ranks and this model shape; else, measured on another number of the
    same cards, their per-device terms (communication changes with the ranks); else None."""
    table = _read(corrections_path())
    entry = table.get(f"{machine} | {shape}")
    if entry:
        return TimeCorrections.from_dict(entry)
    for other in table.values():
        if other.get("shape") == shape and cards_of(other.get("machine", "")) == cards_of(machine):
            return TimeCorrections.from_dict(other).per_device()
    return None


def save_corrections(corrections: TimeCorrections) -> Path:
    """Store (replace) the entry for the corrections' machine and shape; written whole, then renamed."""
    path = corrections_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    table = _read(path)
    table[f"{corrections.machine} | {corrections.shape}"] = corrections.to_dict()
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table, indent=1))
    tmp.replace(path)
    return path


def with_stored_corrections(cluster: Cluster, profile: ModelProfile) -> tuple[Cluster, str | None]:
    """The cluster carrying the corrections stored for it and this model shape, and the one line that says so,
    with where they came from and how old they are (None where there are none). Corrections a run measured while
    other jobs loaded the machine are left out once it is quiet: they corrected for those jobs."""
    found = load_corrections(machine_key(cluster), shape_key(profile))
    if found is None or not found.factors:
        return cluster, None
    if is_busy(found.other_load) and not is_busy(other_load_now()):
        return cluster, (f"time model not corrected: the run that measured corrections on {found.machine} shared "
                         f"the machine with other work ({found.other_load:.0%} of its cores), which has stopped")
    age = f", {_age(time.time() - found.measured_at)} ago" if found.measured_at else ""
    line = (f"time model corrected by what a run measured on {found.machine} at step {found.step}{age}: "
            f"{found.describe()}{'' if found.machine == machine_key(cluster) else ' (its per-device terms)'} "
            f"({corrections_path()})")
    return on_cluster(cluster, found), line


def _age(seconds: float) -> str:
    """'40 s', '12 min', '5 h', '3 days'."""
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def planning_inputs(cluster_of: Callable[[], Cluster], profile: ModelProfile, ranks: int,
                    measure: Callable[[int], None]) -> tuple[Cluster, str | None]:
    """The cluster a plan for it is predicted on, wherever it is planned (`snugfit plan`, the auto plan of `snugfit
    train`): CPU ranks as this machine measured them (measured first where it is not yet, `ranks` of them per node:
    `measure`, train.autoplan.measure_once, passed in so that planning for GPUs imports no torch; the cluster built
    again from the measurement), carrying the corrections a run stored for these ranks and this model shape, with
    the line that says so (None where there are none). One function, so that both show one predicted step for one
    plan."""
    cluster = cluster_of()
    if all(n.gpu.name == "cpu" for n in cluster.nodes):
        measure(ranks)
        cluster = cluster_of()
    return with_stored_corrections(cluster, profile)
