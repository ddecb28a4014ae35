"""The routing report of `snugfit diagnose`: tokens per expert per MoE layer, their imbalance, and its time.

Under expert parallelism every ep rank waits for the one whose experts got the most tokens: the plan's time model
scales the experts' grouped GEMMs and the all-to-alls by the routing's imbalance (plan.corrections.
routing_imbalance, plan.timing.imbalance_cost_s); this report prices the run's with the same two functions. At
ep 1 one rank runs every expert, and the imbalance (the largest group's last tile wave) is not priced."""

from dataclasses import dataclass

from snugfit.plan.corrections import routing_imbalance
from snugfit.plan.timing import imbalance_cost_s


@dataclass(frozen=True)
class LayerRouting:
    tokens_per_expert: list[int]

    @property
    def max_over_mean(self) -> float:
        mean = sum(self.tokens_per_expert) / len(self.tokens_per_expert)
        return max(self.tokens_per_expert) / mean if mean else 1.0


def summarise(steps: list[list[list[int]]]) -> list[LayerRouting]:
    """steps: per step, per layer, tokens per expert -> per layer, summed over the steps."""
    layers = [[sum(col) for col in zip(*per_step)] for per_step in zip(*steps)]
    return [LayerRouting(counts) for counts in layers]


def routing_lines(layers: list[LayerRouting]) -> list[str]:
    return [f"layer {i}: tokens per expert {layer.tokens_per_expert}, max/mean {layer.max_over_mean:.2f}"
            for i, layer in enumerate(layers)]


def cost_line(steps: list[list[list[int]]], ep: int, predicted: dict[str, float]) -> str:
    """What the imbalance cost a step: the plan's experts' grouped GEMMs and all-to-alls (`predicted`, its
    time_by_phase, priced balanced) at the run's imbalance over its ep ranks."""
    if ep == 1:
        return "routing imbalance not priced at ep 1 (one rank runs every expert)"
    factor = routing_imbalance(steps, ep)
    balanced = predicted.get("expert_gemm", 0.0) + predicted.get("ep_comm", 0.0)
    cost = f", about {imbalance_cost_s(balanced, factor):.4g} s a step more than the {balanced:.4g} s predicted " \
        "balanced for the experts' grouped GEMMs and all-to-alls" if balanced else ""
    return f"routing imbalance over the {ep} ep ranks: max/mean x{factor:.2f}{cost}"


def routing_table(steps: list[list[list[int]]], ep: int = 1, predicted: dict[str, float] | None = None) -> list[str]:
    """diagnose's routing lines from the recorded steps' counts (metrics.jsonl's `tokens_per_expert`); none without."""
    if not steps:
        return []
    return ["routing over the recorded steps:", *routing_lines(summarise(steps)), cost_line(steps, ep, predicted or {})]
