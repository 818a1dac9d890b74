"""``fp8_report``: which layers fp8 hurts, from one emulated forward and backward."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mixprec.fp8.linear import Fp8Linear
from mixprec.fp8.recipes import Fp8Recipe
from mixprec.fp8.stats import Fp8Stats, Fp8StatsRow, fp8_stats
from mixprec.fp8.swap import Fp8Filter, apply_fp8

__all__ = ["Fp8Report", "fp8_report"]


@dataclass(frozen=True)
class Fp8Report:
    """What :func:`fp8_report` found.

    Attributes:
        recipe: the recipe checked.
        stats: every layer's statistics.
        hurt: the layers whose casts damage more than the threshold, worst first, each
            with its worst row.
        threshold: the fraction of saturated plus flushed values that counts as harm.
    """

    recipe: Fp8Recipe
    stats: Fp8Stats
    hurt: tuple[Fp8StatsRow, ...]
    threshold: float

    def suggestion(self) -> str:
        """What to do: the filter that keeps the hurt layers out of fp8 (in bf16)."""
        if not self.hurt:
            return f"fp8 ({self.recipe.value}) hurts no layer beyond {self.threshold:.1%}"
        names = ", ".join(repr(row.layer) for row in self.hurt)
        hint = ""
        if self.recipe is Fp8Recipe.TENSORWISE:
            hint = " (or try the 'rowwise' recipe, whose per-row scales isolate outliers)"
        return (
            f"keep {names} in bf16: fp8_filter=lambda module, name: name not in {{{names}}}{hint}"
        )

    def __str__(self) -> str:
        lines = [f"fp8 report ({self.recipe.value}): {len(self.hurt)} layer(s) hurt"]
        for row in self.hurt:
            lines.append(
                f"  {row.layer}: {row.gemm.value} {row.operand} flushes {row.flushed:.1%} "
                f"to zero, saturates {row.saturated:.1%} (amax {row.amax:.3g})"
            )
        lines.append(self.suggestion())
        return "\n".join(lines)


def fp8_report(
    model: nn.Module,
    *inputs: object,
    recipe: Fp8Recipe | str = "tensorwise",
    loss_fn: Callable[[object], torch.Tensor] | None = None,
    filter: Fp8Filter | None = None,
    threshold: float = 0.01,
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
    if not isinstance(threshold, float | int) or not 0 < threshold < 1:
        raise ValueError(f"threshold must be a fraction in (0, 1); got {threshold!r}")
    has_fp8 = any(isinstance(m, Fp8Linear) for m in model.modules())
    net = model if has_fp8 else apply_fp8(model, parsed, filter=filter, emulate=True)
    params = [p for p in net.parameters() if p.requires_grad]
    with fp8_stats(net) as stats:
        output = net(*inputs)
        loss = _sum_floating(output) if loss_fn is None else loss_fn(output)
        if params and loss.requires_grad:
            torch.autograd.grad(loss, params, allow_unused=True)
    worst: dict[str, Fp8StatsRow] = {}
    for row in stats.rows():
        if row.harm > threshold and (row.layer not in worst or row.harm > worst[row.layer].harm):
            worst[row.layer] = row
    hurt = tuple(sorted(worst.values(), key=lambda row: -row.harm))
    return Fp8Report(parsed, stats, hurt, float(threshold))


def _sum_floating(output: object) -> torch.Tensor:
    leaves = torch.utils._pytree.tree_leaves(output)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise ValueError("the model's output holds no floating tensor: pass loss_fn=")
    return sum((t.float().sum() for t in tensors), torch.zeros(()))
