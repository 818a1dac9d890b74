"""``debug_overflow=True`` for the training step: probe the batch of a skipped step.

The step calls :meth:`OverflowDebugger.after_skip` from its after-skip seam, with the
batch it just skipped and the loss scale that overflowed. The probe (see
:func:`mixprec.find_overflow`) re-runs that batch without changing the training outcome:
the RNGs are forked, every buffer it writes (BatchNorm statistics, ...) is restored, and
parameter ``.grad`` is left exactly as it was (gradients are taken with
``torch.autograd.grad``). Skips whose gradients are finite at a lower loss scale (a
dynamic scale backing off from its initial value, as expected in the first float16
steps) are counted and summarised in one warning; every other skip gets a one-line
warning naming the module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from mixprec._warn import warn
from mixprec.convert.plan import Conversion
from mixprec.convert.structure import conversion_of
from mixprec.diagnose.overflow import (
    LossFn,
    backward_culprit,
    find_fix,
    forward_culprit,
    probe,
    report_of,
)
from mixprec.diagnose.report import OverflowReport
from mixprec.policy.levels import Level

__all__ = ["OverflowDebugger", "probe_skipped_step"]


def probe_skipped_step(
    network: nn.Module,
    inputs: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    loss_fn: LossFn | None,
    label: Any,
    *,
    loss_scale: float,
) -> OverflowReport:
    """Probe one batch of a training step that was skipped, leaving no trace.

    Args:
        network: the step's network (converted; a ``DistributedDataParallel`` is unwrapped).
        inputs: the positional network inputs of the skipped batch (without the label).
        kwargs: its keyword network inputs.
        loss_fn: the step's loss function, or None when the network returns its loss.
        label: the label passed to ``loss_fn`` (ignored without one).
        loss_scale: the loss scale the skipped step used.

    Returns:
        An :class:`OverflowReport`; its fix is named without a re-run (the unconverted
        model is not at hand), except a lower loss scale, which is checked.

    Example:
        >>> report = probe_skipped_step(step.network, (x,), {}, loss_fn, y, loss_scale=65536.0)
    """
    inner = getattr(network, "module", network) if _is_ddp(network) else network
    conversion = conversion_of(inner)
    if isinstance(conversion, Conversion):
        level, dtype = conversion.recipe.level, conversion.recipe.dtype
    else:
        level, dtype = Level.O0, None
    target = label if loss_fn is not None else None
    outcome = probe(inner, tuple(inputs), kwargs, loss_fn, target, float(loss_scale))
    culprit = forward_culprit(outcome.events) or backward_culprit(outcome.events)
    fix = find_fix(outcome, culprit, None, level, dtype, float(loss_scale))
    return report_of(outcome, level, dtype, float(loss_scale), fix)


def _is_ddp(network: nn.Module) -> bool:
    return isinstance(network, torch.nn.parallel.DistributedDataParallel)


class OverflowDebugger:
    """What a training step built with ``debug_overflow=True`` holds.

    Attributes:
        last_report: the report of the last skipped step (None before the first skip).
        backoffs: skipped steps that were only the loss scale backing off.
        skips: every skipped step probed.
    """

    def __init__(self) -> None:
        self.last_report: OverflowReport | None = None
        self.backoffs = 0
        self.skips = 0
        self._first_scale: float | None = None

    def after_skip(
        self,
        network: nn.Module,
        inputs: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        loss_fn: LossFn | None,
        label: Any,
        *,
        loss_scale: float,
    ) -> OverflowReport:
        """Probe the skipped batch, keep the report, warn (see the module docstring)."""
        report = probe_skipped_step(network, inputs, kwargs, loss_fn, label, loss_scale=loss_scale)
        self.last_report = report
        self.skips += 1
        if report.scale_backoff:
            self.backoffs += 1
            if self._first_scale is None:
                self._first_scale = float(loss_scale)
                warn(
                    f"mixprec debug_overflow: loss scale {loss_scale:g} is too high for this "
                    f"model (gradients finite at {report.fix.loss_scale:g}); skipped steps that "
                    "are only the scale backing off are counted, not reported one by one"
                )
        else:
            warn(f"mixprec debug_overflow: step skipped: {report.one_line()}")
        return report

    def summary(self) -> str:
        """One line: how many skips were probed and how many were back-offs."""
        other = self.skips - self.backoffs
        since = "" if self._first_scale is None else f" (from {self._first_scale:g})"
        return (
            f"{self.skips} skipped steps probed: {self.backoffs} loss-scale back-offs{since}, "
            f"{other} with a named module"
        )
