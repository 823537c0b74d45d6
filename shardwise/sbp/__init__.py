"""SBP global tensors: placements, specs, the boxing search (router) and executor."""

from .boxing import BoxingPlan, BoxingRoute, BoxingStep, plan_boxing, route_boxing
from .global_tensor import GlobalTensor, distribute, to_global
from .placement import Broadcast, Partial, Replicate, Placement, Split, format_sbp, parse_sbp
from .spec import TensorSpec

__all__ = ["Split", "Replicate", "Broadcast", "Partial", "Placement", "parse_sbp", "format_sbp", "TensorSpec",
           "GlobalTensor", "distribute", "to_global", "route_boxing", "BoxingRoute", "BoxingStep", "plan_boxing",
           "BoxingPlan"]
