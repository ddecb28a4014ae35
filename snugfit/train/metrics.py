"""Metrics as JSON lines, and the loss-curve picture drawn from them at the end."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    """Appends one JSON object per record; only rank 0 writes."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


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
