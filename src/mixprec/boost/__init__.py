"""Boost levels: speedups of the training step on top of a precision level.

``boost_level="O1"`` switches on accuracy-neutral speedups where they measure faster;
``"O2"`` adds gradient freezing and, under DDP, AdaSum. :class:`GroupLossScaleManager`
keeps one dynamic loss scale per group of layers. See :mod:`mixprec.boost.plan`.
"""

from mixprec.boost.adasum import adasum_hook
from mixprec.boost.config import BoostConfig, BoostLevel, parse_boost_config
from mixprec.boost.group_scale import GroupLossScaleManager
from mixprec.boost.plan import BoostPlan, Decision, plan_boost

__all__ = [
    "BoostConfig",
    "BoostLevel",
    "BoostPlan",
    "Decision",
    "GroupLossScaleManager",
    "adasum_hook",
    "parse_boost_config",
    "plan_boost",
]
