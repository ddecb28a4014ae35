"""Planning: the Plan contract, memory and time models, search. Pure: no torch.distributed, no devices."""

from snugfit.plan.placement import Placement
from snugfit.plan.plan import BlockPlan, OptimizerPlan, Plan, PlanError, Prediction

__all__ = ["BlockPlan", "OptimizerPlan", "Placement", "Plan", "PlanError", "Prediction"]
