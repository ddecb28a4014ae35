"""Regenerate the pictures in docs/img/: `.venv/bin/python docs/make_figures.py`."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from snugfit.hardware.cluster import parse_cluster
from snugfit.model.catalogue import resolve_model
from snugfit.plan.plan import BlockPlan, Plan
from snugfit.profile.cache import profile_model
from snugfit.report.timeline import draw_timeline, timeline_for

IMG = Path(__file__).parent / "img"


def flow(out: Path) -> None:
    """Boxes and arrows: what each package hands to the next."""
    steps = [("profile/", "meta-device pass:\nparams, saved bytes,\nFLOPs per block"),
             ("hardware/", "GPU, link and host\nfigures (catalogue\nor measured)"),
             ("plan/", "memory model +\ntime model (schedule\nsimulation) -> Plan"),
             ("runtime/", "torch.distributed:\nZeRO, offload,\n1F1B / BPipe"),
             ("train/", "loop + metrics:\nmeasured vs\npredicted")]
    fig = Figure(figsize=(11, 2.2))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 11)
    ax.set_ylim(0, 2.2)
    ax.axis("off")
    for i, (name, text) in enumerate(steps):
        x = 0.2 + i * 2.2
        ax.add_patch(FancyBboxPatch((x, 0.3), 1.7, 1.6, boxstyle="round,pad=0.05", facecolor="#E8EEF7",
                                    edgecolor="#4C72B0"))
        ax.text(x + 0.85, 1.65, name, ha="center", fontsize=11, weight="bold")
        ax.text(x + 0.85, 0.95, text, ha="center", va="center", fontsize=8)
        if i:
            ax.add_patch(FancyArrowPatch((x - 0.45, 1.1), (x - 0.05, 1.1), arrowstyle="-|>", mutation_scale=14))
    fig.savefig(out, dpi=130)


def pipelines() -> None:
    """gpt2-xl, 4 stages on 4x RTX 4090, activations kept: 1F1B stage 0 holds 4 microbatches, BPipe 3."""
    model = resolve_model("gpt2-xl")
    cluster = parse_cluster("4xRTX4090")
    prof = profile_model(model, micro_batch_size=4, seq_len=1024, dtype="bfloat16", name="gpt2-xl")
    for schedule in ("1f1b", "bpipe"):
        plan = Plan.uniform(len(prof.blocks), pp=4, schedule=schedule, block=BlockPlan(), micro_batch_size=4,
                            num_microbatches=8, seq_len=1024, compute_dtype="bfloat16", reduce_dtype="bfloat16")
        sim, detail = timeline_for(plan, prof, cluster)
        draw_timeline(sim, plan, IMG / f"timeline-{schedule}.png", detail=detail)


if __name__ == "__main__":
    IMG.mkdir(exist_ok=True)
    flow(IMG / "flow.png")
    pipelines()
