"""The routing report of `snugfit diagnose`: tokens per expert per MoE layer, their imbalance, and its time.

The grouped GEMM of a layer takes as long as its busiest expert, so an imbalanced step costs about
(max/mean - 1) x the expert GEMM time at balanced routing (estimated, not measured)."""

from dataclasses import dataclass


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


def imbalance_cost_s(layers: list[LayerRouting], expert_gemm_s: float) -> float:
    """Seconds per step the imbalance costs: each layer's share of the balanced expert GEMM time times
    (max/mean - 1)."""
    if not layers:
        return 0.0
    return sum((layer.max_over_mean - 1.0) * expert_gemm_s / len(layers) for layer in layers)


def routing_lines(layers: list[LayerRouting]) -> list[str]:
    return [f"layer {i}: tokens per expert {layer.tokens_per_expert}, max/mean {layer.max_over_mean:.2f}"
            for i, layer in enumerate(layers)]


def routing_table(steps: list[list[list[int]]]) -> list[str]:
    """diagnose's routing lines from the recorded steps' counts (metrics.jsonl's `tokens_per_expert`); none without."""
    if not steps:
        return []
    return ["routing over the recorded steps:", *routing_lines(summarise(steps))]
