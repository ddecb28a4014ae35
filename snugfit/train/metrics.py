"""Metrics as JSON lines (and TensorBoard event files), and the loss-curve picture drawn from them at the end."""

from __future__ import annotations

import json
import os
from pathlib import Path

from snugfit.errors import SnugfitError


class MetricsLog:
    """Appends one JSON object per record; only rank 0 writes. With `tensorboard`, every number of a record also
    goes to TensorBoard event files in `path`'s folder/tensorboard, as `kind/field` (`kind/field/rankN` for
    per-rank lists) at the record's step: loss, lr, measured and predicted step time and memory."""

    def __init__(self, path: Path, enabled: bool, tensorboard: bool = False):
        self.path, self.enabled = path, enabled
        self.board = None
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                self.board = _summary_writer(path.parent / "tensorboard")

    def write(self, record: dict) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if self.board is not None:
            for tag, value in _scalars(record):
                self.board.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        if self.board is not None:
            self.board.close()


def _summary_writer(folder: Path):
    from snugfit.quiet import quiet_imports

    try:
        with quiet_imports():
            from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise SnugfitError("train.tensorboard needs the tensorboard package: pip install 'snugfit[tensorboard]', "
                           "or set train.tensorboard = false") from None
    return SummaryWriter(log_dir=str(folder))


def _scalars(record: dict) -> list[tuple[str, float]]:
    kind = record.get("kind", "train")
    out = []
    for key, value in record.items():
        if key in ("kind", "step") or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out.append((f"{kind}/{key}", float(value)))
        elif isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
            out += [(f"{kind}/{key}/rank{i}", float(v)) for i, v in enumerate(value)]
    return out


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_losses(metrics_path: Path, out: Path) -> Path:
    """Train and validation loss against step, from the JSONL log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train"]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("kind") == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("snugfit training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def measured_memory(engine, step_time_s: float | None = None) -> dict:
    """Each rank's tracked peak of the last step (device and host), gathered to every rank, and each rank's step
    time where given (`step_time_by_rank_s`).

    A collective: every rank calls it on the same steps.
    """
    import torch.distributed as dist

    tracker = getattr(engine, "memory", None)
    peak = tracker.peak() if tracker is not None else {}
    stage = engine.stage_stats() if hasattr(engine, "stage_stats") else None  # pipeline ranks
    mine = [peak.get("device.total", 0), peak.get("host.total", 0), stage, allocator_peaks(), step_time_s]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    out = {"peak_memory_bytes": [m[0] for m in everyone], "peak_host_bytes": [m[1] for m in everyone]}
    if step_time_s is not None:
        out["step_time_by_rank_s"] = [m[4] for m in everyone]
    if stage is not None:
        out["stage_peak_activation_bytes"] = [m[2]["peak_activation_bytes"] for m in everyone]
        out["stage_peak_microbatches"] = [m[2]["peak_microbatches"] for m in everyone]
    if everyone[0][3] is not None:  # the device allocator's own view, beside the tracked tensors
        out["allocator_peak_bytes"] = [m[3][0] for m in everyone]
        out["allocator_reserved_bytes"] = [m[3][1] for m in everyone]
    return out


def resident_bytes() -> tuple[int, int]:
    """(now, the largest so far) resident set of this process in bytes: on CPU ranks, all of a rank's memory."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    try:
        with open("/proc/self/statm") as f:
            now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        now = peak
    return now, peak


def resident_record(step: int, at_start: int) -> dict:
    """The run's end record: each rank's resident set before the model was built and its peak over the whole run
    (start-up, steps, evaluations, checkpoints), gathered to every rank (a collective)."""
    import torch.distributed as dist

    mine = (at_start, resident_bytes()[1])
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    return {"kind": "end", "step": step, "start_resident_bytes": [m[0] for m in everyone],
            "peak_resident_bytes": [m[1] for m in everyone]}


def allocator_peaks() -> tuple[int, int] | None:
    """(max allocated, max reserved) bytes of this rank's accelerator since the last call, which resets them;
    None on CPU. The tracker counts snugfit's tensors; this is what the caching allocator really held."""
    import torch

    if not torch.accelerator.is_available():
        return None
    peaks = torch.accelerator.max_memory_allocated(), torch.accelerator.max_memory_reserved()
    torch.accelerator.reset_peak_memory_stats()
    return peaks


def predicted_fields(plan) -> dict:
    """The plan's predictions beside the measurements, when the plan carries them.

    Memory is what the runtime's MemoryTracker is predicted to see (held tensors, the
    measured side's view), not the full peak with its transients.
    """
    from snugfit.plan.memory import device_bytes

    p = plan.predicted
    if p is None:
        return {}
    device = ([t["device.total"] for t in p.tracked_by_rank] or [device_bytes(r) for r in p.memory_by_rank]
              or [p.peak_memory_bytes])
    return {"predicted_step_time_s": p.step_time_s, "predicted_peak_memory_bytes": device}


def compare_line(r: dict) -> str:
    """'step 40: loss 2.310 | step 0.412 s (predicted 0.380) | peak MiB per rank 12.1 12.0 (predicted 12.3)'."""
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    line = f"step {r['step']}: loss {r['loss']:.3f}"
    line += f" (router aux {r['aux_loss']:.4f})" if r.get("aux_loss") is not None else ""
    line += f" | step {r['step_time_s']:.3f} s"
    if "predicted_step_time_s" in r:
        line += f" (predicted {r['predicted_step_time_s']:.3f})"
    if any(r.get("peak_memory_bytes", [])):
        line += " | peak MiB per rank " + " ".join(mib(b) for b in r["peak_memory_bytes"])
        if "predicted_peak_memory_bytes" in r:
            line += " (predicted " + " ".join(mib(b) for b in r["predicted_peak_memory_bytes"]) + ")"
    if "allocator_peak_bytes" in r:
        line += " | allocator MiB " + " ".join(mib(b) for b in r["allocator_peak_bytes"])
        line += " (reserved " + " ".join(mib(b) for b in r["allocator_reserved_bytes"]) + ")"
    return line
