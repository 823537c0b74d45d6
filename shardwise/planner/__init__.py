"""The planner: what a layout will cost before it runs. Pure — no processes, no communication.

``Hardware`` (presets and calibrations), ``ModelSpec`` (analytic GPT / Llama, or traced from any module),
``Layout`` (a dp × tp × pp layout as plain data; ``Plan`` is its old name, an alias), ``predict`` (step time,
memory, TF/s, MFU, with a breakdown), ``search`` (the fastest layouts that fit, branch and bound over the whole
space); ``error_band`` (how sure a prediction is: the errors of published and measured rows like it), ``ties``
and ``recommend`` (layouts the model cannot tell apart, and the simplest of the fastest).
"""

from .hardware import PRESETS, Hardware
from .link import Link
from .plan import Layout, Plan
from .predict import Prediction, predict
from .layers import Gemm, Layer
from .spec import ModelSpec
from .enumerate import Space
from .search import NoFeasiblePlan, SearchResult, search
from .error_band import ErrorBand, error_band, recommend, ties

__all__ = ["Hardware", "Link", "PRESETS", "ModelSpec", "Layer", "Gemm", "Layout", "Plan", "Prediction", "predict",
           "search", "SearchResult", "Space", "NoFeasiblePlan", "ErrorBand", "error_band", "ties", "recommend"]
