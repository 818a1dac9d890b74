"""mixprec: automatic mixed precision for PyTorch.

Levels O0-O3 and a per-op ``autocast`` level, with casts placed in the model ahead of
time and a cast plan you can read before running; a training step with loss scaling
that says when and why it skipped.
"""

from mixprec.boost import GroupLossScaleManager
from mixprec.convert.api import (
    auto_mixed_precision,
    custom_mixed_precision,
    get_black_list,
    get_white_list,
)
from mixprec.convert.cast_at_use import float32_parameters, low_precision_parameters
from mixprec.convert.plan import CastPlan, explain
from mixprec.diagnose import (
    CalibrationReport,
    LintReport,
    OverflowReport,
    calibrate,
    find_overflow,
    lint,
)
from mixprec.policy.dtypes import dtype_name
from mixprec.policy.hardware import is_native
from mixprec.policy.levels import Level
from mixprec.training.build import build_train_network
from mixprec.training.grads import all_finite, unscale_
from mixprec.training.scaling import (
    DynamicLossScaleManager,
    DynamicLossScaler,
    FixedLossScaleManager,
    LossScaleManager,
    LossScaler,
    StaticLossScaler,
)
from mixprec.training.step import StepMetrics, TrainStep

__all__ = [
    "CalibrationReport",
    "CastPlan",
    "DynamicLossScaleManager",
    "DynamicLossScaler",
    "FixedLossScaleManager",
    "GroupLossScaleManager",
    "Level",
    "LintReport",
    "LossScaleManager",
    "LossScaler",
    "OverflowReport",
    "StaticLossScaler",
    "StepMetrics",
    "TrainStep",
    "all_finite",
    "auto_mixed_precision",
    "build_train_network",
    "calibrate",
    "custom_mixed_precision",
    "dtype_name",
    "explain",
    "find_overflow",
    "float32_parameters",
    "get_black_list",
    "get_white_list",
    "is_native",
    "lint",
    "low_precision_parameters",
    "unscale_",
]

__version__ = "0.1.0"
