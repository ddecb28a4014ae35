"""Planning: the Plan contract, memory and time models, search. Pure: no torch.distributed, no devices."""

from snugfit.plan.plan import BlockPlan, Plan, PlanError, Prediction

__all__ = ["BlockPlan", "Plan", "PlanError", "Prediction"]
