"""A rank's step time by term, assembled once: estimate() adds up a rank's stages with it, stage_costs one piece
under one option (what the knapsack weighs).

What each term is worth (the stage's seconds per microbatch, the exposed gradient reduction, the optimizer on the
device and on the host) is timing.py; here they become a step's phases: what every microbatch repeats, and what
the step adds once after the pipeline drains (in order: the exposed reduction, the host optimizer, the device
one). The schedule's bubble is the simulation's, beside them. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from snugfit.plan.timing import StageTime


@dataclass(frozen=True)
class StepTerms:
    """Seconds of a step by phase (timing.py's terms): each microbatch's, and the step's once."""

    per_microbatch: dict[str, float]  # by phase, the gradient reduction apart
    passes: float  # of them, a microbatch's forward and backward as the schedule runs them (StageTime totals)
    replayed: float  # and what a split backward's W adds to them (its recomputation again, its host work)
    reduce: float  # one reduction of every unit's gradients, what the backward does not hide
    host_step: float  # the host optimizer and streamed states' copies, exposed
    device_step: float  # the optimizer on the device
    update: float  # its FSDP2 (DTensor) work on CPU ranks
    every_microbatch: bool  # each microbatch's backward reduces (grad_reduce "microbatch"), else the step's last
    sync: float = 0.0  # collectives the step makes once after backward besides them (a tied weight's copies summed)

    def reduces(self, m: int) -> float:
        """The step's exposed reductions: one, or one per microbatch; and its once-a-step syncs."""
        return (self.reduce * m if self.every_microbatch else self.reduce) + self.sync

    def phases(self, m: int, bubble: float) -> dict[str, float]:
        """The step's seconds by phase over m microbatches, `bubble` the schedule's idle time."""
        out = {k: m * v for k, v in self.per_microbatch.items()}
        out = {"compute": out.pop("compute"), "recompute": out.pop("recompute"), "bubble": bubble, **out}
        out["dp_comm_exposed"] += self.reduces(m)
        out["offload_exposed"] += self.host_step
        out["optimizer"] = self.device_step + self.update
        return out

    def tail(self, m: int) -> dict[str, float]:
        """What the step adds after the pipeline drains, in order."""
        return {"collective": self.reduces(m), "host optimizer": self.host_step,
                "optimizer": self.device_step + self.update}

    @property
    def t_microbatch(self) -> float:
        """Seconds each microbatch adds (its reduction included where each one reduces)."""
        return (self.passes + self.reduce if self.every_microbatch else self.passes) + self.replayed

    @property
    def t_step(self) -> float:
        """Seconds the step adds once."""
        return (self.device_step + self.host_step + (0.0 if self.every_microbatch else self.reduce) + self.update
                + self.sync)


def step_terms(stages: list[tuple[StageTime, int]], *, reduce: float, host_step: float, device_step: float,
               every_microbatch: bool, split: bool, passes: float | None = None, sync: float = 0.0) -> StepTerms:
    """The step of a rank running `stages` (each stage's times per microbatch, and how often its backward runs
    what it recomputes: twice where a split backward's W replays it, simulate.split_backward); `reduce` one
    exposed gradient reduction of them all, `host_step`/`device_step` the optimizer's exposed host and device
    seconds (timing.optimizer_time); split: the backward is split into I and W (its host work:
    StageTime.split_host); passes: the forward and backward seconds where they are not the stages' own (what one
    more alike block adds to a stage, stage_costs); sync: collectives made once a step besides the reductions
    (estimate.tied_sync_time)."""
    per_mb = dict.fromkeys(("compute", "expert_gemm", "recompute", "dp_comm_exposed", "tp_comm", "cp_comm", "ep_comm", "offload_exposed",
                            "pipeline_runtime", "optimizer"), 0.0)
    own = replayed = update = 0.0
    for st, replays in stages:
        # the experts' grouped GEMMs apart from the rest of the work (recomputed ones included)
        per_mb["compute"] += st.fwd + st.bwd - st.expert_fwd - st.expert_bwd
        per_mb["expert_gemm"] += st.expert_fwd + st.expert_bwd + st.expert_rc * replays
        per_mb["recompute"] += (st.recompute - st.expert_rc) * replays
        per_mb["dp_comm_exposed"] += st.comm_exposed
        per_mb["tp_comm"] += st.tp_fwd + st.tp_bwd
        per_mb["cp_comm"] += st.cp_fwd + st.cp_bwd
        per_mb["ep_comm"] += st.ep_fwd + st.ep_bwd
        per_mb["offload_exposed"] += st.offload_exposed
        per_mb["pipeline_runtime"] += st.pipe + (st.split_host if split else 0.0)
        own += st.f_total + st.b_total
        if replays > 1 or split:
            replayed += st.recompute * (replays - 1) + (st.split_host if split else 0.0)
        update += st.update
    return StepTerms(per_mb, own if passes is None else passes, replayed, reduce, host_step, device_step, update,
                     every_microbatch, sync)
