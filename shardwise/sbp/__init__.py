"""SBP global tensors: placements, specs, boxing planner and executor."""

from .boxing import BoxingPlan, BoxingStep, plan_boxing
from .global_tensor import GlobalTensor, distribute, to_global
from .placement import Broadcast, Partial, Placement, Split, format_sbp, parse_sbp
from .spec import TensorSpec

__all__ = ["Split", "Broadcast", "Partial", "Placement", "parse_sbp", "format_sbp", "TensorSpec", "GlobalTensor",
           "distribute", "to_global", "plan_boxing", "BoxingPlan", "BoxingStep"]
