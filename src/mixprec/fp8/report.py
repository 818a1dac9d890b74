"""Which layers fp8 hurts: from one emulated forward and backward, or from the weights alone.

:func:`fp8_report` runs a batch; :func:`weight_report` reads only the weights (what
:func:`mixprec.lint` checks before training). :func:`mixprec.find_overflow` adds the same
report to its own when the model runs with fp8. A layer is *hurt* when a cast damages
(saturates or flushes to zero) more than ``threshold`` of an operand's values; the fix is
to keep it out of fp8 (in the level's low dtype, usually bf16) with ``fp8_filter``, or in
float32 with ``fp32_modules``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.fp8.linear import Fp8Linear
from mixprec.fp8.recipes import Fp8Config, Fp8Recipe, Gemm
from mixprec.fp8.scaling import amax_of, cast_stats, scale_of
from mixprec.fp8.stats import Fp8Stats, Fp8StatsRow, fp8_stats
from mixprec.fp8.swap import Fp8Filter, apply_fp8, chosen_layers

__all__ = ["DEFAULT_THRESHOLD", "Fp8Report", "fp8_report", "weight_report"]

#: The fraction of an operand's values a cast may damage before its layer counts as hurt.
DEFAULT_THRESHOLD = 0.01


@dataclass(frozen=True)
class Fp8Report:
    """Which layers fp8 hurts.

    Attributes:
        recipe: the recipe checked.
        stats: every layer's statistics (of the operands that were cast).
        hurt: the layers whose casts damage more than the threshold, worst first, each
            with its worst row.
        threshold: the fraction of saturated plus flushed values that counts as harm.
    """

    recipe: Fp8Recipe
    stats: Fp8Stats
    hurt: tuple[Fp8StatsRow, ...]
    threshold: float

    @classmethod
    def from_stats(cls, recipe: Fp8Recipe, stats: Fp8Stats, threshold: float) -> Fp8Report:
        """The report of collected statistics: each layer's worst row beyond ``threshold``."""
        worst: dict[str, Fp8StatsRow] = {}
        for row in stats.rows():
            if row.harm > threshold and (
                row.layer not in worst or row.harm > worst[row.layer].harm
            ):
                worst[row.layer] = row
        hurt = tuple(sorted(worst.values(), key=lambda row: -row.harm))
        return cls(recipe, stats, hurt, float(threshold))

    @property
    def layers(self) -> tuple[str, ...]:
        """The qualified names of the hurt layers, worst first."""
        return tuple(row.layer for row in self.hurt)

    def suggestion(self) -> str:
        """What to do: the filter that keeps the hurt layers out of fp8 (in bf16)."""
        if not self.hurt:
            return f"fp8 ({self.recipe.value}) hurts no layer beyond {self.threshold:.1%}"
        names = ", ".join(repr(name) for name in self.layers)
        hint = ""
        if self.recipe is Fp8Recipe.TENSORWISE:
            hint = "; or try the 'rowwise' recipe, whose per-row scales isolate outliers"
        return (
            f"keep {names} in bf16: fp8_filter=lambda module, name: name not in {{{names}}} "
            f"(or in float32: fp32_modules=[{names}]){hint}"
        )

    def lines(self) -> list[str]:
        """One line per hurt layer: its worst cast."""
        return [
            f"{row.layer}: {row.gemm.value} {row.operand} flushes {row.flushed:.1%} to zero, "
            f"saturates {row.saturated:.1%} (amax {row.amax:.3g})"
            for row in self.hurt
        ]

    def to_dict(self) -> dict[str, Any]:
        """The recipe, threshold, hurt layers (their worst rows) and suggestion, for JSON."""
        return {
            "recipe": self.recipe.value,
            "threshold": self.threshold,
            "hurt": [
                {
                    "layer": row.layer,
                    "gemm": row.gemm.value,
                    "operand": row.operand,
                    "amax": row.amax,
                    "scale": row.scale,
                    "saturated": row.saturated,
                    "flushed": row.flushed,
                }
                for row in self.hurt
            ],
            "suggestion": self.suggestion(),
        }

    def __str__(self) -> str:
        head = f"fp8 report ({self.recipe.value}): {len(self.hurt)} layer(s) hurt"
        return "\n".join([head, *(f"  {line}" for line in self.lines()), self.suggestion()])


def _threshold(threshold: object) -> float:
    if (
        isinstance(threshold, bool)
        or not isinstance(threshold, float | int)
        or not 0 < threshold < 1
    ):
        raise ValueError(f"threshold must be a fraction in (0, 1); got {threshold!r}")
    return float(threshold)


def fp8_report(
    model: nn.Module,
    *inputs: object,
    recipe: Fp8Recipe | str = "tensorwise",
    loss_fn: Callable[[object], torch.Tensor] | None = None,
    filter: Fp8Filter | None = None,
    threshold: float = DEFAULT_THRESHOLD,
) -> Fp8Report:
    """Name the layers fp8 hurts: run ``model(*inputs)`` and its backward in emulated fp8.

    The model is not modified and its gradients are left as they were. A model that
    already has emulated fp8 layers is run as it is (``recipe`` and ``filter`` unused).

    Args:
        model: the model (float32 or converted).
        *inputs: one batch.
        recipe: the recipe to check.
        loss_fn: ``output -> loss``; default: the sum of the floating output.
        filter: which layers to put in fp8 (default: as :func:`apply_fp8`).
        threshold: the fraction of damaged (saturated or flushed) values that counts.

    Raises:
        ValueError: an unknown recipe; a threshold outside (0, 1).

    Example:
        >>> print(fp8_report(model, x, recipe="tensorwise"))
    """
    parsed = Fp8Recipe.parse(recipe, "recipe")
    limit = _threshold(threshold)
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    if layers:
        parsed = layers[0].fp8_config.recipe
    net = model if layers else apply_fp8(model, parsed, filter=filter, emulate=True)
    params = [p for p in net.parameters() if p.requires_grad]
    with fp8_stats(net) as stats:
        output = net(*inputs)
        loss = _sum_floating(output) if loss_fn is None else loss_fn(output)
        if params and loss.requires_grad:
            torch.autograd.grad(loss, params, allow_unused=True)
    return Fp8Report.from_stats(parsed, stats, limit)


def weight_report(
    model: nn.Module,
    recipe: Fp8Recipe | str,
    *,
    filter: Fp8Filter | None = None,
    fp32_pin: Fp8Filter | None = None,
    threshold: float = DEFAULT_THRESHOLD,
) -> Fp8Report:
    """Name the layers whose *weights* fp8 hurts, without running the model.

    Each layer :func:`apply_fp8` would choose has its weight cast as the recipe casts it
    for the ``output`` and ``grad_input`` GEMMs; activations and gradients need a batch
    (:func:`fp8_report`, or :func:`mixprec.find_overflow` with ``fp8=``).

    Example:
        >>> print(weight_report(model, "tensorwise"))
    """
    parsed = Fp8Recipe.parse(recipe, "fp8")
    limit = _threshold(threshold)
    config = Fp8Config.from_recipe(parsed)
    stats = Fp8Stats()
    with torch.no_grad():
        for name, linear in chosen_layers(model, filter, fp32_pin):
            weight_t = linear.weight.detach().t()
            for gemm, spec, dim in (
                (Gemm.OUTPUT, config.weight, 0),
                (Gemm.GRAD_INPUT, config.weight_for_grad_input, -1),
            ):
                if spec.dtype is None:
                    continue
                amax = amax_of(weight_t, dim if spec.rowwise else None)
                scale = scale_of(amax, spec.dtype, config.pow2_scales)
                stats.record(name, gemm, "weight", cast_stats(weight_t, scale, spec.dtype))
    return Fp8Report.from_stats(parsed, stats, limit)


def _sum_floating(output: object) -> torch.Tensor:
    leaves = torch.utils._pytree.tree_leaves(output)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise ValueError("the model's output holds no floating tensor: pass loss_fn=")
    return sum((t.float().sum() for t in tensors), torch.zeros(()))
