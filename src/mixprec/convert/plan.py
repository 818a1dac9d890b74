"""The cast plan: what a converted model computes in, and every cast it makes.

A :class:`CastPlan` is computed when a model is converted, from the converted graph (or
module tree), without running the model. It prints as an aligned table and converts to
a dict. Where a count depends on the inputs, the plan assumes what a model is normally
fed: one float32 tensor per floating input.

Given example inputs, :func:`explain` is exact instead: it runs the converted model's
own forward on fake tensors (``torch._subclasses.FakeTensorMode``: shapes and dtypes,
no data, no kernels), every Parameter and buffer turned into a fake as it is read, and
counts the casts with :class:`mixprec.inspect.CastCounter`, attributing each to the
module running when it was made. Run-time parts and shared modules (counted per call)
are measured like everything else, and nothing real is written: no Parameter, buffer,
argument or random-number state changes.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from torch import nn

from mixprec._check import require_module
from mixprec.convert.structure import conversion_of
from mixprec.policy.dtypes import dtype_name, is_castable
from mixprec.policy.levels import Recipe

__all__ = ["Cast", "CastPlan", "Conversion", "PlanRow", "RowKind", "explain"]


class RowKind(str, enum.Enum):
    """What a plan row describes."""

    OP = "op"  # one op of a graph
    MODULE = "module"  # a call of a one-op module (BatchNorm) decided by its op
    UNIT = "unit"  # a module computing whole in low precision
    RUNTIME = "runtime"  # a module whose own ops follow the lists at run time
    INPUTS = "inputs"  # module level: the floating inputs
    OUTPUTS = "outputs"  # the floating outputs
    ISLAND = "island"  # module level: a module kept in another dtype
    WEIGHTS = "weights"  # module level: the weights a module casts at use
    MEASURED = "measured"  # the casts a forward on fake tensors made inside a module


class Cast(NamedTuple):
    """One cast: ``value`` (a name in the model) to ``dtype``."""

    value: str
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{self.value} -> {dtype_name(self.dtype)}"


def _as_cast(cast: Cast | tuple[str, torch.dtype]) -> Cast:
    return Cast(*cast)


def _joined(casts: tuple[Cast, ...]) -> str:
    """Casts as table text, repeats counted (``float32 -> bfloat16 (x3)``)."""
    counts: dict[str, int] = {}
    for cast in casts:
        counts[str(cast)] = counts.get(str(cast), 0) + 1
    return ", ".join(text if n == 1 else f"{text} (x{n})" for text, n in counts.items()) or "-"


@dataclass(frozen=True)
class PlanRow:
    """One op or module of a converted model.

    Attributes:
        path: qualified name of the module the op belongs to (``""`` is the model itself).
        op: the op (``"linear"``, ``"softmax"``) or module class (``"LSTM"``).
        dtype: what it computes in: a dtype name, ``"follows inputs"``, ``"widest input"``
            or ``"at run time"``.
        casts_before: the values cast before it, as :class:`Cast` ``(value, dtype)`` pairs.
        casts_after: the values cast after it.
        note: anything else worth knowing (why a part runs at run time, ...).
        kind: what the row describes (:class:`RowKind`).
    """

    path: str
    op: str
    dtype: str
    casts_before: tuple[Cast, ...] = ()
    casts_after: tuple[Cast, ...] = ()
    note: str = ""
    kind: RowKind = RowKind.OP

    @classmethod
    def make(
        cls,
        path: str,
        op: str,
        dtype: torch.dtype | str | None,
        casts_before: Iterable[Cast | tuple[str, torch.dtype]] = (),
        casts_after: Iterable[Cast | tuple[str, torch.dtype]] = (),
        *,
        kind: RowKind = RowKind.OP,
        note: str = "",
    ) -> PlanRow:
        """A row from typed parts (a dtype, (value, dtype) casts)."""
        shown = dtype if isinstance(dtype, str) else dtype_name(dtype)
        return cls(
            path,
            op,
            shown,
            tuple(map(_as_cast, casts_before)),
            tuple(map(_as_cast, casts_after)),
            note,
            kind,
        )

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
        runtime_parts: modules whose own code is not a graph: the lists are applied to
            their own ops at run time (or, for built-in fast paths, the code runs as
            written), and those ops' casts are not counted here.
        runtime_reasons: for each of ``runtime_parts``, why, in plain words.
        assumption: what the counts assume about the inputs.
    """

    level: str
    dtype: str
    rows: tuple[PlanRow, ...]
    runtime_parts: tuple[str, ...] = ()
    runtime_reasons: tuple[str, ...] = ()
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

    def runtime(self) -> dict[str, str]:
        """``{path: reason}`` for each part decided at run time."""
        return dict(zip(self.runtime_parts, self.runtime_reasons, strict=False))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: level, dtype, totals and rows."""
        return {
            "level": self.level,
            "dtype": self.dtype,
            "assumption": self.assumption,
            "totals": {
                "casts_per_forward": self.num_casts,
                "ops_low": self.ops_low,
                "ops": len(self.rows),
                "runtime_parts": len(self.runtime_parts),
            },
            "runtime_parts": list(self.runtime_parts),
            "runtime_reasons": list(self.runtime_reasons),
            "rows": [
                {
                    "path": row.path,
                    "op": row.op,
                    "dtype": row.dtype,
                    "casts_before": [str(c) for c in row.casts_before],
                    "casts_after": [str(c) for c in row.casts_after],
                    "note": row.note,
                    "kind": row.kind.value if row.kind else None,
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
                _joined(row.casts_before),
                _joined(row.casts_after),
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
            f"totals: {self.num_casts} casts per forward, "
            f"{self.ops_low} of {len(self.rows)} ops in {self.dtype}, "
            f"{len(self.runtime_parts)} parts decided at run time"
            + (
                f" ({', '.join(p or '(model)' for p in self.runtime_parts)})"
                if self.runtime_parts
                else ""
            )
        )
        lines += [  # why each part is left to run time, in plain words (uncounted casts)
            f"  {row.path or '(model)'} runs at run time: {row.note}"
            for row in self.rows
            if row.kind is RowKind.RUNTIME and row.note
        ]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


@dataclass(frozen=True)
class Conversion:
    """What a converted module carries: its recipe and its static plan."""

    recipe: Recipe
    plan: CastPlan


def explain(network: nn.Module, *example_inputs: Any, **example_kwargs: Any) -> CastPlan:
    """The cast plan of a network converted by mixprec.

    Without example inputs: the static plan made at conversion, read without running
    anything (counts assume each floating input is one float32 tensor). With them: the
    casts a forward with those inputs makes, exactly (what
    :class:`mixprec.inspect.CastCounter` counts in a real call), measured by running the
    forward on fake tensors: no real data is read or written. One row per module that
    cast, each cast shown as ``source dtype -> target dtype``. A forward that fake
    tensors cannot run (it reads a tensor's value, ``.item()``) falls back to the static
    plan with the inputs' own casts counted for their dtypes.

    Example:
        >>> net = mixprec.auto_mixed_precision(torch.nn.Linear(4, 4), "O1")
        >>> print(mixprec.explain(net))  # doctest: +SKIP
        >>> mixprec.explain(net).num_casts
        4

    Raises:
        TypeError: if ``network`` is not a module, or the examples do not fit its forward.
        ValueError: if it was not converted by mixprec.
    """
    require_module(network)
    conversion = conversion_of(network)
    if not isinstance(conversion, Conversion):
        raise ValueError(
            f"network {type(network).__name__} was not converted by mixprec: convert it first with "
            "mixprec.auto_mixed_precision(network, level) or mixprec.custom_mixed_precision(...)"
        )
    plan = _with_fp8(conversion.plan, network)
    if not example_inputs and not example_kwargs:
        return plan
    try:
        inspect.signature(network.forward).bind(*example_inputs, **example_kwargs)
    except TypeError as error:
        raise TypeError(
            f"the example inputs do not fit {type(network).__name__}.forward: {error}"
        ) from None
    try:
        return _measured(plan, network, example_inputs, example_kwargs)
    except _FAKE_LIMITS:
        return _for_inputs(plan, network, example_inputs, example_kwargs)


_IMMUTABLE = (int, float, complex, bool, str, bytes, torch.dtype, torch.device, type(None))


def _private(leaf: Any, memo: dict[int, Any]) -> Any:
    """``leaf`` (an argument that is no tensor and no container) as a copy of its own for
    :func:`explain`'s fake call, where a forward may write into it; as it is where it
    cannot change or does not copy."""
    if isinstance(leaf, (torch.Tensor, *_IMMUTABLE)) or callable(leaf):
        return leaf
    try:
        return copy.deepcopy(leaf, memo)
    except Exception:  # an object that does not copy: lent as it is
        return leaf


def _fake_limits() -> tuple[type[BaseException], ...]:
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedFakeTensorException,
    )

    return (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedFakeTensorException,
    )


_FAKE_LIMITS = _fake_limits()


class _Where:
    """The qualified name of the module running now (a stack kept by global module
    hooks, installed only while a measurement runs)."""

    def __init__(self, network: nn.Module) -> None:
        self.names: dict[int, str] = {}
        for name, module in network.named_modules(remove_duplicate=False):
            self.names.setdefault(id(module), name)
        self.stack: list[str] = []

    def push(self, module: nn.Module, args: Any) -> None:
        self.stack.append(self.names.get(id(module), self.stack[-1] if self.stack else ""))

    def pop(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack:
            self.stack.pop()

    @property
    def now(self) -> str:
        return self.stack[-1] if self.stack else ""


def _measured(
    plan: CastPlan, network: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> CastPlan:
    """``plan``'s header with rows of the casts a forward on fake tensors makes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.modules import module as module_hooks

    from mixprec.inspect import CastCounter

    where = _Where(network)
    found: dict[str, list[Cast]] = {}

    class _Counter(CastCounter):
        def record(self, source: torch.dtype, target: torch.dtype) -> None:
            super().record(source, target)
            found.setdefault(where.now, []).append(Cast(dtype_name(source), target))

    rng = torch.random.get_rng_state()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, Any] = {}  # a real tensor's id -> its fake (for deepcopy, below)

    def as_fake(tensor: torch.Tensor) -> torch.Tensor:
        memo[id(tensor)] = made = fake.from_tensor(tensor)
        return made

    state: dict[str, torch.Tensor] = {  # every Parameter and buffer as a fake, for the call
        name: as_fake(tensor)
        for name, tensor in (*network.named_parameters(), *network.named_buffers())
    }
    fakes = pytree.tree_map_only(torch.Tensor, as_fake, (args, kwargs))
    # an object argument (a transformers KV cache) is the forward's to write: it gets a
    # copy, whose tensors already seen are their fakes
    fakes = pytree.tree_map(lambda leaf: _private(leaf, memo), fakes)
    pre = module_hooks.register_module_forward_pre_hook(where.push)
    post = module_hooks.register_module_forward_hook(where.pop, always_call=True)
    try:
        with fake, _Counter():
            torch.func.functional_call(network, state, fakes[0], fakes[1], strict=False)
    finally:
        pre.remove()
        post.remove()
        torch.random.set_rng_state(rng)
    types = {name: type(module).__name__ for name, module in network.named_modules()}
    rows = tuple(
        PlanRow.make(path, types.get(path, "module"), _target(casts), casts, kind=RowKind.MEASURED)
        for path, casts in found.items()
    )
    return dataclasses.replace(
        plan, rows=rows, assumption="the given example inputs, measured on fake tensors"
    )


def _target(casts: list[Cast]) -> str:
    """A measured row's "computes in": the one dtype its casts make (else "mixed")."""
    targets = {cast.dtype for cast in casts}
    return dtype_name(targets.pop()) if len(targets) == 1 else "mixed"


def _with_fp8(plan: CastPlan, network: nn.Module) -> CastPlan:
    """The rows of fp8 layers (:mod:`mixprec.fp8`) name their recipe in the op column."""
    fp8 = {
        name: f"{type(module).__name__} [fp8 {module.fp8_config.recipe.value}]"
        for name, module in network.named_modules()
        if hasattr(module, "fp8_config")
    }
    if not fp8:
        return plan
    rows = tuple(
        dataclasses.replace(row, op=fp8[row.path]) if row.path in fp8 else row for row in plan.rows
    )
    return dataclasses.replace(plan, rows=rows)


def _needs_cast(value: Any, target: torch.dtype) -> bool:
    return is_castable(value) and value.dtype != target


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
        if row.kind is RowKind.INPUTS and row.path == "":  # module level: every input
            low = row.casts_before[0].dtype  # the "floating inputs" cast
            leaves = [v for v in pytree.tree_leaves((args, kwargs)) if _needs_cast(v, low)]
            casts = tuple(Cast(f"input {i}", low) for i in range(len(leaves)))
            rows.append(dataclasses.replace(row, casts_before=casts))
            continue
        kept = []
        for cast in row.casts_before:
            name = cast.value
            if name in bound.arguments and not _needs_cast(bound.arguments[name], cast.dtype):
                continue
            kept.append(cast)
        rows.append(dataclasses.replace(row, casts_before=tuple(kept)))
    return dataclasses.replace(plan, rows=tuple(rows), assumption="the given example inputs")
