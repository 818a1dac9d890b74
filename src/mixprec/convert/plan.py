"""The cast plan: what a converted model computes in, and every cast it makes.

A :class:`CastPlan` is computed when a model is converted, from the converted graph (or
module tree), without running the model. It prints as an aligned table and converts to
a dict. Where a count depends on the inputs, the plan assumes what a model is normally
fed: one float32 tensor per floating input.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.utils._pytree as pytree
from torch import nn

from mixprec.convert.structure import conversion_of
from mixprec.policy.dtypes import dtype_name, is_castable
from mixprec.policy.levels import Recipe

__all__ = ["CastPlan", "Conversion", "PlanRow", "explain"]


@dataclass(frozen=True)
class PlanRow:
    """One op or module of a converted model.

    Attributes:
        path: qualified name of the module the op belongs to (``""`` is the model itself).
        op: the op (``"linear"``, ``"softmax"``) or module class (``"LSTM"``).
        dtype: what it computes in: a dtype name, ``"follows inputs"``, ``"widest input"``
            or ``"at run time"``.
        casts_before: the values cast before it, as ``"name -> dtype"``.
        casts_after: the values cast after it.
        note: anything else worth knowing (why a part runs at run time, ...).
    """

    path: str
    op: str
    dtype: str
    casts_before: tuple[str, ...] = ()
    casts_after: tuple[str, ...] = ()
    note: str = ""

    @property
    def num_casts(self) -> int:
        return len(self.casts_before) + len(self.casts_after)


@dataclass(frozen=True)
class CastPlan:
    """The cast plan of a converted network (see :func:`explain`).

    Attributes:
        level: the level the network was converted to.
        dtype: the low-precision dtype.
        rows: one per op or module, in execution order.
        casts_removed: redundant casts removed after insertion (fp32 round trips between
            low-precision ops, duplicate casts of one value).
        runtime_parts: modules whose own code could not be traced; the lists are applied to
            their ops at run time, and their casts are not counted here.
        assumption: what the counts assume about the inputs.
    """

    level: str
    dtype: str
    rows: tuple[PlanRow, ...]
    casts_removed: int = 0
    runtime_parts: tuple[str, ...] = ()
    assumption: str = "each floating input is one float32 tensor"
    _totals: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_casts(self) -> int:
        """Casts per forward (excluding parts handled at run time)."""
        return sum(row.num_casts for row in self.rows)

    @property
    def casts_inserted(self) -> int:
        return self.num_casts

    @property
    def ops_low(self) -> int:
        """Ops and modules computing in the low dtype."""
        return sum(1 for row in self.rows if row.dtype == self.dtype)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: level, dtype, totals and rows."""
        return {
            "level": self.level,
            "dtype": self.dtype,
            "assumption": self.assumption,
            "totals": {
                "casts_per_forward": self.num_casts,
                "casts_removed": self.casts_removed,
                "ops_low": self.ops_low,
                "ops": len(self.rows),
                "runtime_parts": len(self.runtime_parts),
            },
            "runtime_parts": list(self.runtime_parts),
            "rows": [
                {
                    **asdict(row),
                    "casts_before": list(row.casts_before),
                    "casts_after": list(row.casts_after),
                }
                for row in self.rows
            ],
        }

    def table(self) -> str:
        """The plan as an aligned text table with totals."""
        header = ("path", "op", "computes in", "casts before", "casts after")
        body = [
            (
                row.path or "(model)",
                row.op,
                row.dtype,
                ", ".join(row.casts_before) or "-",
                ", ".join(row.casts_after) or "-",
            )
            for row in self.rows
        ]
        widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
        lines = [
            f"cast plan: level {self.level}, {self.dtype} (assuming {self.assumption})",
            "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip(),
            "  ".join("-" * w for w in widths),
        ]
        lines += [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in body
        ]
        lines.append(
            f"totals: {self.num_casts} casts per forward, {self.casts_removed} redundant casts removed, "
            f"{self.ops_low} of {len(self.rows)} ops in {self.dtype}, "
            f"{len(self.runtime_parts)} parts decided at run time"
            + (
                f" ({', '.join(p or '(model)' for p in self.runtime_parts)})"
                if self.runtime_parts
                else ""
            )
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


@dataclass(frozen=True)
class Conversion:
    """What a converted module carries: its recipe and its plan."""

    recipe: Recipe
    plan: CastPlan


def explain(network: nn.Module, *example_inputs: Any, **example_kwargs: Any) -> CastPlan:
    """The cast plan of a network converted by mixprec, read without running it.

    Without example inputs the counts assume each floating input is one float32 tensor.
    With them (only their dtypes are looked at; nothing runs), the casts of the inputs
    themselves are counted for those inputs: an integer token tensor is not cast, a
    bfloat16 input needs no cast down.

    Example:
        >>> net = mixprec.auto_mixed_precision(torch.nn.Linear(4, 4), "O1")
        >>> print(mixprec.explain(net))  # doctest: +SKIP
        >>> mixprec.explain(net).num_casts
        4

    Raises:
        TypeError: if ``network`` is not a module, or the examples do not fit its forward.
        ValueError: if it was not converted by mixprec.
    """
    if not isinstance(network, nn.Module):
        raise TypeError(
            f"network must be a torch.nn.Module; got {type(network).__name__}: {network!r}"
        )
    conversion = conversion_of(network)
    if not isinstance(conversion, Conversion):
        raise ValueError(
            f"network {type(network).__name__} was not converted by mixprec: convert it first with "
            "mixprec.auto_mixed_precision(network, level) or mixprec.custom_mixed_precision(...)"
        )
    if not example_inputs and not example_kwargs:
        return conversion.plan
    return _for_inputs(conversion.plan, network, example_inputs, example_kwargs)


def _needs_cast(value: Any, target: str) -> bool:
    return is_castable(value) and dtype_name(value.dtype) != target


def _for_inputs(
    plan: CastPlan, network: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> CastPlan:
    """``plan`` with the casts of the model's own inputs counted for these inputs."""
    try:
        bound = inspect.signature(network.forward).bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(
            f"the example inputs do not fit {type(network).__name__}.forward: {error}"
        ) from None
    rows = []
    for row in plan.rows:
        if row.op == "inputs" and row.path == "":  # module level: every floating input
            leaves = [v for v in pytree.tree_leaves((args, kwargs)) if _needs_cast(v, plan.dtype)]
            casts = tuple(f"input {i} -> {plan.dtype}" for i in range(len(leaves)))
            rows.append(dataclasses.replace(row, casts_before=casts))
            continue
        kept = []
        for cast in row.casts_before:
            name, _, target = cast.partition(" -> ")
            if name in bound.arguments and not _needs_cast(bound.arguments[name], target):
                continue
            kept.append(cast)
        rows.append(dataclasses.replace(row, casts_before=tuple(kept)))
    return dataclasses.replace(plan, rows=tuple(rows), assumption="the given example inputs")
