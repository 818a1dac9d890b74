"""Per-layer fp8 statistics: what each cast of each GEMM does to its operand.

For every emulated fp8 layer, each of its three GEMMs (``output``, ``grad_input``,
``grad_weight``) and each of the GEMM's two operands, :func:`fp8_stats` collects, over the
steps run inside it:

- ``amax``: the largest ``|x|`` seen;
- ``scale``: the smallest scale used (one scale per tensor or per row);
- ``saturated``: the fraction of values clipped to the fp8 maximum;
- ``flushed``: the fraction of non-zero values that became zero.

A large ``flushed`` is the classic fp8 failure: one outlier sets a tensorwise amax, and the
rest of the tensor falls below fp8's smallest value. Everything is kept in tensors on the
model's device, so collecting never waits for it; reading the rows does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from mixprec.fp8.linear import Fp8Linear
from mixprec.fp8.recipes import Gemm
from mixprec.fp8.scaling import CastStats

__all__ = ["Fp8Stats", "Fp8StatsRow", "fp8_stats"]


@dataclass(frozen=True)
class Fp8StatsRow:
    """The statistics of one operand of one GEMM of one layer (floats; fractions in [0, 1])."""

    layer: str
    gemm: Gemm
    operand: str
    amax: float
    scale: float
    saturated: float
    flushed: float

    @property
    def harm(self) -> float:
        """The fraction of values the cast damaged (saturated or flushed)."""
        return self.saturated + self.flushed


@dataclass
class _Sum:
    amax: torch.Tensor
    scale: torch.Tensor
    saturated: torch.Tensor
    flushed: torch.Tensor
    numel: int


@dataclass
class Fp8Stats:
    """The statistics :func:`fp8_stats` collects (see the module docstring)."""

    sums: dict[tuple[str, Gemm, str], _Sum] = field(default_factory=dict)

    def record(self, layer: str, gemm: Gemm, operand: str, stats: CastStats | None) -> None:
        """Add the statistics of one cast (None, a high-precision operand, adds nothing)."""
        if stats is None:
            return
        key = (layer, gemm, operand)
        old = self.sums.get(key)
        if old is None:
            self.sums[key] = _Sum(
                stats.amax, stats.scale, stats.saturated, stats.flushed, stats.numel
            )
            return
        old.amax = torch.maximum(old.amax, stats.amax)
        old.scale = torch.minimum(old.scale, stats.scale)
        old.saturated = old.saturated + stats.saturated
        old.flushed = old.flushed + stats.flushed
        old.numel += stats.numel

    def rows(self) -> list[Fp8StatsRow]:
        """One row per layer, GEMM and operand, in the order the casts ran."""
        return [
            Fp8StatsRow(
                layer,
                gemm,
                operand,
                float(s.amax),
                float(s.scale),
                float(s.saturated) / s.numel,
                float(s.flushed) / s.numel,
            )
            for (layer, gemm, operand), s in self.sums.items()
        ]

    def worst(self, n: int = 5) -> list[Fp8StatsRow]:
        """The ``n`` rows with the most damaged values, worst first."""
        return sorted(self.rows(), key=lambda row: -row.harm)[:n]

    def metrics(self) -> dict[str, float]:
        """Flat ``{"fp8/<layer>/<gemm>/<operand>/<stat>": value}``, for a metrics logger."""
        out: dict[str, float] = {}
        for row in self.rows():
            prefix = f"fp8/{row.layer}/{row.gemm.value}/{row.operand}"
            for stat in ("amax", "scale", "saturated", "flushed"):
                out[f"{prefix}/{stat}"] = getattr(row, stat)
        return out

    def table(self, rows: list[Fp8StatsRow] | None = None) -> str:
        """An aligned text table of ``rows`` (default: all)."""
        rows = self.rows() if rows is None else rows
        header = ("layer", "gemm", "operand", "amax", "scale", "saturated", "flushed")
        body = [
            (
                r.layer,
                r.gemm.value,
                r.operand,
                f"{r.amax:.3g}",
                f"{r.scale:.3g}",
                f"{r.saturated:.2%}",
                f"{r.flushed:.2%}",
            )
            for r in rows
        ]
        widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
        return "\n".join(
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
            for line in [header, *body]
        )

    def __str__(self) -> str:
        return self.table()


@contextmanager
def fp8_stats(model: nn.Module) -> Iterator[Fp8Stats]:
    """Collect the fp8 statistics of ``model``'s emulated fp8 layers while inside.

    Args:
        model: a model (or a training step) holding :class:`~mixprec.fp8.linear.Fp8Linear`
            layers (``fp8=`` with emulation, or :func:`mixprec.fp8.apply_fp8`).

    Raises:
        ValueError: ``model`` has no emulated fp8 layer.

    Example:
        >>> with fp8_stats(net) as stats:
        ...     net(x).sum().backward()
        >>> print(stats.table(stats.worst(3)))
    """
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    if not layers:
        raise ValueError(
            "fp8_stats needs a model with emulated fp8 layers (converted with fp8= and "
            "emulation, or by mixprec.fp8.apply_fp8); model has none"
        )
    stats = Fp8Stats()
    before = [layer._fp8_recorder for layer in layers]
    for layer in layers:
        layer._fp8_recorder = stats
    try:
        yield stats
    finally:
        for layer, old in zip(layers, before, strict=True):
            layer._fp8_recorder = old
