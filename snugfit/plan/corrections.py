"""Per-term corrections of the time model, learnt from a traced step of a run.

The time model predicts a step as a sum of terms (Prediction.time_by_phase). A traced step measures what the
trace can tell apart: forward and backward work, FSDP2's own ranges (its gathers, reduce-scatters and their
waits), the optimizer, and time outside any traced action (pipeline bubbles and host gaps). `attribute` maps
those measurements onto the terms; `derive` turns measured over predicted into a factor per term; the time model
reads the factors through `corrected`, the one place they act (called where each term is computed), so a
corrected search, estimate() and the knapsack all see the same model.

Pure: no files, no torch. Factors travel on the hardware (Node.corrections, plain data), set by `on_cluster`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from snugfit.hardware.cluster import Cluster, Node
from snugfit.profile.types import ModelProfile

# The time model's terms (Prediction.time_by_phase's keys) a factor can scale. The bubble is not scaled: it is
# what the simulated schedule leaves idle, and follows from the corrected stage times.
TERMS = ("compute", "recompute", "dp_comm_exposed", "tp_comm", "offload_exposed", "pipeline_runtime", "optimizer")
# Terms timed inside forward and backward spans: the trace cannot tell them apart, so they share one factor
INSIDE_WORK = ("compute", "expert_gemm", "recompute", "tp_comm", "ep_comm", "offload_exposed", "pipeline_runtime")
# A named factor beside the terms: under expert parallelism the step waits on the ep rank whose experts got the
# most tokens, so the experts' grouped GEMMs and the all-to-alls take (max/mean of the ep ranks' tokens) x their
# balanced time (plan.timing applies it). Measured from the run's routing (`routing_imbalance`), not the trace.
IMBALANCE = "routing_imbalance"
# Terms one device's speed sets, whatever the ranks: they carry over to another number of ranks of the same cards
PER_DEVICE = ("compute", "recompute", "optimizer")
EVIDENCE = 0.02  # a term predicted below this share of the step gets no factor (too small to measure apart)
MIN_EVIDENCE_S = 1e-4
FACTOR_RANGE = (0.01, 100.0)  # factors are clamped to it: beyond, a trace gone wrong more likely than the model


@dataclass
class MeasuredStep:
    """One rank's traced step, in the parts a trace measures apart (seconds)."""

    step: float  # the rank's whole traced step
    work: float  # forward and backward spans, FSDP2's ranges inside them taken out
    dp_comm: float  # FSDP2's ranges (gathers, reduce-scatters, their waits) and the step's other collectives
    optimizer: float  # optimizer spans (device and host)
    idle: float  # inside the step, outside any span: pipeline bubbles and host gaps


@dataclass(frozen=True)
class TimeCorrections:
    """Measured over predicted, per term (TERMS); a term without a factor keeps the model's figure."""

    factors: dict[str, float] = field(default_factory=dict)
    machine: str = ""  # `machine_key`
    shape: str = ""  # `shape_key`
    step: int = 0  # the run's step they were measured at
    measured: dict[str, float] = field(default_factory=dict)  # seconds per term (and "host", "bubble")
    predicted: dict[str, float] = field(default_factory=dict)
    measured_at: float = 0.0  # unix time
    other_load: float | None = None  # the share of the cores other work used as they were measured

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in _STORED}

    @classmethod
    def from_dict(cls, d: dict) -> "TimeCorrections":
        return cls(**{k: d[k] for k in _STORED if k in d})

    def per_device(self) -> "TimeCorrections":
        """Only the factors that hold on another number of the same cards (PER_DEVICE)."""
        return replace(self, factors={t: f for t, f in self.factors.items() if t in PER_DEVICE})

    def describe(self) -> str:
        """'compute x1.32, dp_comm_exposed x0.21'."""
        return ", ".join(f"{t} x{f:.2f}" for t, f in sorted(self.factors.items())) or "none"


_STORED = ("factors", "machine", "shape", "step", "measured", "predicted", "measured_at", "other_load")


def machine_key(cluster: Cluster) -> str:
    """The ranks a correction was measured on: '2xcpu', '1x4xRTX 4090' (card names and counts, node by node)."""
    return "+".join(f"{n.count}x{n.gpu.name}" for n in cluster.nodes)


def cards_of(machine: str) -> list[str]:
    """The card names of a `machine_key`, without their counts."""
    return [part.split("x", 1)[1] for part in machine.split("+")]


def shape_key(profile: ModelProfile) -> str:
    """The model shape a correction was measured with: 'hidden64-blocks2-parameters108864-trainable108864-seq32-
    float32'."""
    summary = profile.summary()
    keys = ("hidden", "blocks", "parameters", "trainable")
    return "-".join(f"{k}{summary.get(k)}" for k in keys) + f"-seq{profile.seq_len}-{profile.dtype}"


def attribute(measured: MeasuredStep, predicted: dict[str, float], pipelined: bool) -> dict[str, float]:
    """Measured seconds per term: the forward and backward work split over the terms timed inside it in the
    model's proportions; dp communication and the optimizer as measured; the idle time as the bubble of a pipeline,
    else as host dispatch (no term of the model)."""
    inside = {t: predicted.get(t, 0.0) for t in INSIDE_WORK}
    total = sum(inside.values())
    out = {t: measured.work * p / total for t, p in inside.items()} if total > 0 else {"compute": measured.work}
    out["dp_comm_exposed"] = measured.dp_comm
    out["optimizer"] = measured.optimizer
    out["bubble" if pipelined else "host"] = measured.idle
    return out


def routing_imbalance(steps: list[list[list[int]]], ep: int) -> float:
    """The IMBALANCE factor of recorded routing (metrics.jsonl's `tokens_per_expert`: per step, per MoE layer,
    tokens per expert): per layer and step, the most tokens an ep rank's experts got (runtime.expert_parallel
    gives rank r the r-th contiguous E/ep experts) over the ranks' mean, averaged. 1.0 at ep 1 or without counts:
    one rank runs every expert (a grouped GEMM's largest group then sets its last tile wave, not priced)."""
    ratios = []
    for layers in steps:
        for counts in layers:
            local = len(counts) // ep if ep > 1 else 0
            if not local or not sum(counts):
                continue
            ranks = [sum(counts[r * local:(r + 1) * local]) for r in range(ep)]
            ratios.append(max(ranks) * ep / sum(ranks))
    return sum(ratios) / len(ratios) if ratios else 1.0


def derive(measured: list[MeasuredStep], predicted: dict[str, float], pipelined: bool, imbalance: float = 1.0,
           **keys) -> TimeCorrections:
    """Factors from every rank's traced step: the mean over ranks (ranks in lockstep take alike times), but for
    dp communication the least (a rank's collectives also hold its waits for a slower peer; the slowest rank's
    hold none); and the routing's IMBALANCE where it is not balanced (`routing_imbalance`; `predicted` should
    already price it, or its cost lands in the compute factor too). keys: machine, shape, step."""
    mean = MeasuredStep(*(sum(getattr(m, f) for m in measured) / len(measured) for f in vars(measured[0])))
    mean.dp_comm = min(m.dp_comm for m in measured)
    seconds = attribute(mean, predicted, pipelined)
    floor = max(MIN_EVIDENCE_S, EVIDENCE * sum(predicted.values()))
    factors = {}
    for term in TERMS:
        want, got = predicted.get(term, 0.0), seconds.get(term)
        if got is not None and want >= floor:
            factors[term] = min(max(got / want, FACTOR_RANGE[0]), FACTOR_RANGE[1])
    if imbalance != 1.0:
        factors[IMBALANCE] = imbalance
    return TimeCorrections(factors, measured=seconds, predicted=dict(predicted), **keys)


def corrected(term: str, seconds: float, node: Node) -> float:
    """`seconds` of the time model's `term` on `node`, corrected by what a run measured there (the one place the
    factors act)."""
    return seconds * node.corrections.get(term, 1.0) if node.corrections else seconds


def on_cluster(cluster: Cluster, corrections: TimeCorrections | None) -> Cluster:
    """The cluster whose nodes carry the factors (a copy; None: as it is)."""
    if corrections is None or not corrections.factors:
        return cluster
    return replace(cluster, nodes=[replace(n, corrections=dict(corrections.factors)) for n in cluster.nodes])
