"""What :func:`mixprec.find_overflow` returns: :class:`OverflowReport` and its parts."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import torch

from mixprec.diagnose.probes import Event
from mixprec.fp8.report import Fp8Report
from mixprec.policy.dtypes import dtype_name

__all__ = ["Culprit", "Fix", "FixKind", "OverflowReport"]


class FixKind(str, enum.Enum):
    """The kinds of fix :func:`mixprec.find_overflow` can name, smallest first."""

    NONE = "none"  # nothing to fix
    LOWER_LOSS_SCALE = "lower loss scale"
    FP32_MODULE = "keep a module in float32"
    BFLOAT16 = "bfloat16 instead of float16"
    NOT_PRECISION = "not a precision problem"  # non-finite in float32 as well
    UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True)
class Fix:
    """The smallest fix found.

    Attributes:
        kind: what kind of fix.
        text: the fix in words, with the call that applies it.
        verified: whether a run with the fix applied was finite.
        module: the module to keep in float32 (``FP32_MODULE``).
        loss_scale: the largest loss scale (a power-of-two fraction of the one given)
            whose gradients are finite (``LOWER_LOSS_SCALE``).
    """

    kind: FixKind
    text: str
    verified: bool = False
    module: str | None = None
    loss_scale: float | None = None


@dataclasses.dataclass(frozen=True)
class Culprit:
    """Where the first non-finite value appeared.

    Attributes:
        module: qualified name of the module that made it (``""`` the network itself,
            ``"(inputs)"`` the inputs, ``"(loss)"`` the loss function).
        module_type: its class name.
        seen_at: the value that was first non-finite: ``"output of decoder.fc"``, ...
        made_by: how the module made it (its forward, its backward, its own code between
            submodule calls).
        kind: ``"inf"`` or ``"nan"`` (``"inf"`` when both).
        dtype: the dtype of the non-finite value.
        limit: the largest finite value of that dtype.
        largest_before: the largest finite magnitude seen before it in the same pass.
        largest_at: where that magnitude was seen.
    """

    module: str
    module_type: str
    seen_at: str
    made_by: str
    kind: str
    dtype: str
    limit: float
    largest_before: float
    largest_at: str

    @classmethod
    def from_events(
        cls, culprit: Event, earlier: list[Event], module: str, module_type: str, made_by: str
    ) -> Culprit:
        finite = [e for e in earlier if e.finite or e.largest > 0]
        biggest = max(finite, key=lambda e: e.largest, default=None)
        return cls(
            module=module,
            module_type=module_type,
            seen_at=f"{culprit.phase.value} of {culprit.path or '(model)'}",
            made_by=made_by,
            kind="inf" if culprit.has_inf else "nan",
            dtype=dtype_name(culprit.dtype),
            limit=float(torch.finfo(culprit.dtype).max),
            largest_before=0.0 if biggest is None else biggest.largest,
            largest_at="-"
            if biggest is None
            else f"{biggest.phase.value} of {biggest.path or '(model)'}",
        )

    def describe(self) -> str:
        where = self.module or "(model)"
        return (
            f"{self.kind} in the {self.seen_at} ({self.dtype}), made by {where} "
            f"({self.module_type}) {self.made_by}; largest finite magnitude before it "
            f"{self.largest_before:.4g} ({self.largest_at}), {self.dtype} limit {self.limit:.4g}"
        )


@dataclasses.dataclass(frozen=True)
class OverflowReport:
    """Where a network's numbers stop being finite, forward and backward.

    Attributes:
        level: the level the network ran at.
        dtype: its low-precision dtype (``"float32"`` at O0).
        loss_scale: the loss scale the backward ran with.
        forward: the first non-finite module output in execution order, or None.
        backward: the first non-finite gradient in backward order, or None.
        loss: the loss value (None when there was nothing to differentiate).
        nonfinite_params: names of the parameters whose gradient is not finite.
        fix: the smallest fix found.
        fp8: with fp8 layers, which of them the fp8 casts hurt (saturate or flush to zero
            more than 1% of an operand's values), and the filter that keeps them in bf16.
    """

    level: str
    dtype: str
    loss_scale: float
    forward: Culprit | None
    backward: Culprit | None
    loss: float | None
    nonfinite_params: tuple[str, ...]
    fix: Fix
    fp8: Fp8Report | None = None

    @property
    def found(self) -> bool:
        """Whether anything was not finite."""
        return self.forward is not None or self.backward is not None or bool(self.nonfinite_params)

    @property
    def module(self) -> str | None:
        """The module named first (forward before backward), or None."""
        culprit = self.forward or self.backward
        return None if culprit is None else culprit.module

    @property
    def scale_backoff(self) -> bool:
        """The only problem is the loss scale: the forward is finite and the gradients are
        finite at a lower scale (a dynamic loss scale backing off, as expected early on)."""
        return self.forward is None and self.fix.kind is FixKind.LOWER_LOSS_SCALE

    def one_line(self) -> str:
        """A one-line summary, for a warning."""
        if not self.found:
            return (
                f"no non-finite value ({self.level}, {self.dtype}, loss scale {self.loss_scale:g})"
            )
        culprit = self.forward or self.backward
        assert culprit is not None  # found and no culprit means only parameters
        pass_ = "forward" if self.forward is not None else "backward"
        return (
            f"{culprit.kind} first in the {pass_} at {culprit.module or '(model)'} "
            f"({culprit.seen_at}, {culprit.dtype}); fix: {self.fix.text}"
        )

    def to_dict(self) -> dict[str, Any]:
        """A dict of every field for strict JSON: a non-finite number (a NaN or infinite
        loss) is the string ``"nan"``, ``"inf"`` or ``"-inf"``, as JSON has none."""
        fp8 = None if self.fp8 is None else self.fp8.to_dict()
        data = dataclasses.asdict(dataclasses.replace(self, fp8=None))
        data["fp8"] = fp8
        data["fix"]["kind"] = self.fix.kind.value
        data["nonfinite_params"] = list(self.nonfinite_params)
        data["found"] = self.found
        return _json_numbers(data)

    def __str__(self) -> str:
        return "\n".join([self._finite_part(), *self._fp8_lines()])

    def _fp8_lines(self) -> list[str]:
        if self.fp8 is None:
            return []
        fp8 = self.fp8
        head = (
            f"  fp8 ({fp8.recipe.value}): {len(fp8.hurt)} layer(s) hurt beyond {fp8.threshold:.1%}"
        )
        return [head, *(f"    {line}" for line in fp8.lines()), f"  fp8 fix: {fp8.suggestion()}"]

    def _finite_part(self) -> str:
        head = f"find_overflow: level {self.level}, {self.dtype}, loss scale {self.loss_scale:g}"
        if not self.found:
            return f"{head}: every module output, gradient and the loss are finite"
        lines = [head]
        lines.append(
            "  forward:  " + ("finite" if self.forward is None else self.forward.describe())
        )
        lines.append(
            "  backward: " + ("finite" if self.backward is None else self.backward.describe())
        )
        if self.nonfinite_params:
            shown = ", ".join(self.nonfinite_params[:6])
            more = (
                f", ... ({len(self.nonfinite_params)} in all)"
                if len(self.nonfinite_params) > 6
                else ""
            )
            lines.append(f"  non-finite parameter gradients: {shown}{more}")
        if self.loss is not None:
            lines.append(f"  loss: {self.loss:.6g}")
        status = "verified" if self.fix.verified else "not verified"
        lines.append(f"  fix ({status}): {self.fix.text}")
        return "\n".join(lines)


def _json_numbers(data: Any) -> Any:
    """``data`` with each non-finite float as its name (``"nan"``, ``"inf"``, ``"-inf"``)."""
    if isinstance(data, float) and not math.isfinite(data):
        return str(data)
    if isinstance(data, dict):
        return {key: _json_numbers(value) for key, value in data.items()}
    if isinstance(data, list):
        return [_json_numbers(value) for value in data]
    return data
