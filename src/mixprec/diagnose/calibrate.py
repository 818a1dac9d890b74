"""``calibrate``: the float32 islands a model needs to meet a tolerance.

The metric is the relative error of the converted network's output against the float32
network on the calibration batches, ``||low - fp32|| / ||fp32||`` over all its floating
outputs, worst batch (a ``metric(output, reference) -> float`` may replace it). The
search, on O2/O3's module-level conversion:

1. a module's *own part* is its own code and parameters, without its submodules; the own
   parts of the called modules partition the network's computation. Each one's
   sensitivity is the error with only it in low precision and everything else in
   float32;
2. own parts are pinned to float32 in order of sensitivity until the tolerance is met
   (a pin on a container keeps its own code in float32 and its submodules low);
3. every pin whose removal keeps the tolerance met is dropped, least sensitive first:
   the result is a locally minimal set of pins (the smallest set is a subset search,
   which this does not promise);
4. the result is checked on ``holdout`` batches when given.

Calibration runs in eval mode, without gradients, with the RNGs forked and buffers
restored; the network's train/eval flags are put back afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mixprec._warn import warn
from mixprec.convert.api import auto_mixed_precision, check_network
from mixprec.convert.declared import with_declared_pins
from mixprec.convert.module_level import convert_module_level
from mixprec.convert.structure import structural_copy
from mixprec.diagnose.probes import preserved, tensor_leaves
from mixprec.policy.dtypes import device_of, dtype_name
from mixprec.policy.levels import Level, PathPin, Precision, Recipe, make_recipe, resolve

__all__ = ["CalibrationReport", "ModuleSensitivity", "calibrate", "relative_error"]

Metric = Callable[[Any, Any], float]
Batch = tuple[tuple[Any, ...], dict[str, Any]]


def relative_error(output: Any, reference: Any) -> float:
    """``||output - reference|| / ||reference||`` over all floating tensors (float64);
    infinite when the output is not finite.

    Example:
        >>> relative_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5]))  # doctest: +ELLIPSIS
        0.18...
    """
    out = [t.detach().double().flatten() for t in tensor_leaves(output)]
    ref = [t.detach().double().flatten() for t in tensor_leaves(reference)]
    if len(out) != len(ref) or not out:
        raise ValueError(
            f"the output has {len(out)} floating tensors and the reference {len(ref)}: "
            "they must match (and be at least one)"
        )
    o, r = torch.cat(out), torch.cat(ref)
    if not bool(torch.isfinite(o).all()):
        return math.inf
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


@dataclasses.dataclass(frozen=True)
class ModuleSensitivity:
    """One module's own part: its error alone in low precision, its rank, its pin."""

    path: str
    module_type: str
    sensitivity: float
    rank: int
    pinned: bool


@dataclasses.dataclass(frozen=True)
class CalibrationReport:
    """What :func:`calibrate` found.

    Attributes:
        level, dtype, tolerance: what it calibrated for.
        pins: modules kept in float32 (``fp32_modules``): a pinned module's own part,
            and its submodules unless they are in ``low_pins``.
        low_pins: their submodules kept low (``low_modules``).
        error_before: the error with no pins.
        error_after: the error of the returned network.
        met: whether ``error_after <= tolerance``.
        holdout_error: the returned network's error on the holdout batches (or None).
        modules: every own part, most sensitive first.
        evaluations: converted networks evaluated.
    """

    level: str
    dtype: str
    tolerance: float
    pins: tuple[str, ...]
    low_pins: tuple[str, ...]
    error_before: float
    error_after: float
    met: bool
    holdout_error: float | None
    modules: tuple[ModuleSensitivity, ...]
    evaluations: int

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        data = dataclasses.asdict(self)
        data["pins"], data["low_pins"] = list(self.pins), list(self.low_pins)
        data["modules"] = [dataclasses.asdict(m) for m in self.modules]
        return data

    def __str__(self) -> str:
        verdict = "met" if self.met else "NOT met"
        lines = [
            f"calibrate: level {self.level}, {self.dtype}, tolerance {self.tolerance:.3g} ({verdict})",
            f"  error before {self.error_before:.4g}, after {self.error_after:.4g}"
            + ("" if self.holdout_error is None else f", holdout {self.holdout_error:.4g}"),
            f"  float32 pins: {', '.join(self.pins) or '(none)'}"
            + (f"; kept low inside them: {', '.join(self.low_pins)}" if self.low_pins else ""),
            f"  {self.evaluations} networks evaluated; most sensitive own parts:",
        ]
        for m in self.modules[:8]:
            mark = "  pinned" if m.pinned else ""
            lines.append(f"    {m.rank:>3}. {m.path} ({m.module_type}) {m.sensitivity:.4g}{mark}")
        return "\n".join(lines)


def _batch(item: Any) -> Batch:
    if isinstance(item, Mapping):
        return (), dict(item)
    if isinstance(item, (tuple, list)):
        return tuple(item), {}
    return (item,), {}


@contextlib.contextmanager
def _evaluating(network: nn.Module) -> Iterator[None]:
    modes = [(m, m.training) for m in network.modules()]
    network.eval()
    try:
        with preserved(network), torch.no_grad():
            yield
    finally:
        for module, mode in modes:
            module.training = mode


class _Search:
    """Errors of candidate conversions against the float32 references."""

    def __init__(self, network: nn.Module, level: Level, low: torch.dtype, metric: Metric) -> None:
        self.network, self.level, self.low, self.metric = network, level, low, metric
        self.device = device_of(network)
        self.modules = dict(network.named_modules())
        self.called: set[str] = set()
        self.evaluations = 0

    def error(self, model: nn.Module, batches: Sequence[Batch], refs: Sequence[Any]) -> float:
        self.evaluations += 1
        worst = 0.0
        for (args, kwargs), ref in zip(batches, refs, strict=True):
            value = float(self.metric(model(*args, **kwargs), ref))
            if value < 0:
                raise ValueError(
                    f"metric must return an error >= 0 (0: the output equals the float32 "
                    f"reference); {self.metric!r} returned {value!r}"
                )
            worst = max(worst, value if math.isfinite(value) else math.inf)
        return worst

    def recipe(self, fp32: Sequence[str]) -> Recipe:
        """The level's recipe with ``fp32`` pinned, plus what the model declares float32
        (as conversion adds it)."""
        pin = PathPin(frozenset(fp32)) if fp32 else None
        recipe = make_recipe(self.level, self.low, self.device, fp32_pin=pin)
        return with_declared_pins(self.network, recipe)

    def children(self, path: str) -> list[str]:
        """The nearest called modules below ``path`` (a ``ModuleList`` is never called:
        its entries are)."""
        found: list[str] = []
        for name, child in self.modules[path].named_children():
            sub = f"{path}.{name}" if path else name
            if child is None or sub not in self.modules:
                continue
            found.extend([sub] if sub in self.called else self.children(sub))
        return found

    def alone(self, path: str) -> nn.Module:
        """The float32 network with only ``path``'s own part in low precision."""
        recipe = self.recipe(self.children(path))
        low_part = convert_module_level(self.modules[path], recipe, prefix=path)
        root = structural_copy(self.network)
        parent, _, name = path.rpartition(".")
        root.get_submodule(parent)._modules[name] = low_part
        return root

    def low_pins(self, pins: Sequence[str], candidates: set[str]) -> list[str]:
        """Below a pinned own part, the called modules that stay low."""
        return [c for p in pins for c in self.children(p) if c in candidates and c not in pins]

    def fp32_pins(self, pins: Sequence[str]) -> list[str]:
        """The pins to pass: one whose nearest pinned-or-called ancestor is pinned inherits
        float32 from it (it is not kept low), so it need not be named."""
        pinned = set(pins)
        return [p for p in pins if not any(p in self.children(q) for q in pinned)]

    def convert(self, pins: Sequence[str], candidates: set[str]) -> nn.Module:
        return auto_mixed_precision(
            self.network,
            self.level,
            self.low,
            fp32_modules=self.fp32_pins(pins) or None,
            low_modules=self.low_pins(pins, candidates) or None,
        )


def calibrate(
    network: nn.Module,
    *inputs: Any,
    level: str | Level = "O2",
    dtype: torch.dtype | str | None = None,
    tolerance: float = 1e-2,
    batches: Sequence[Any] | None = None,
    holdout: Sequence[Any] | None = None,
    metric: Metric | None = None,
) -> tuple[nn.Module, CalibrationReport]:
    """Keep in float32 the fewest module parts that bring the output within ``tolerance``.

    Args:
        network: the unconverted model.
        *inputs: one calibration batch (its positional inputs).
        level: ``"O2"`` or ``"O3"`` (``"auto"`` where it picks one of them).
        dtype: the low-precision dtype (None: the device's usual one).
        tolerance: the largest acceptable error (default 1e-2: 1% relative error).
        batches: more calibration batches: each a tensor, a tuple of positional inputs or
            a dict of keyword inputs.
        holdout: batches (same forms) the result is checked on, not calibrated on.
        metric: ``metric(output, reference) -> float`` replacing :func:`relative_error`.

    Returns:
        ``(converted, report)``: an ordinary converted network whose pins show in
        :func:`mixprec.explain`, and a :class:`CalibrationReport`. When no set of pins
        meets the tolerance, a warning says so and the best network found is returned.

    Raises:
        TypeError: not a module; a metric that is not callable.
        ValueError: a level other than O2/O3; a bad dtype or tolerance; no batch; a
            metric that returns a negative error.

    Example:
        >>> fast, report = mixprec.calibrate(model, x, dtype="fp16", tolerance=1e-2)
        >>> print(report)  # doctest: +SKIP
    """
    network = check_network(network)
    policy = resolve(network, level, dtype, argument="level")
    parsed, low = policy.level, policy.dtype
    if parsed not in (Level.O2, Level.O3):
        raise ValueError(f"level must be 'O2' or 'O3' for calibrate; got {level!r}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance > 0:
        raise ValueError(f"tolerance must be a positive number; got {tolerance!r}")
    if metric is not None and not callable(metric):
        raise TypeError(f"metric must be callable (output, reference) -> float; got {metric!r}")
    calib = ([_batch(inputs)] if inputs else []) + [_batch(b) for b in batches or ()]
    if not calib:
        raise ValueError("calibrate needs at least one batch: pass *inputs or batches=[...]")
    checks = [_batch(b) for b in holdout or ()]

    search = _Search(network, parsed, low, metric or relative_error)
    with _evaluating(network):
        called: list[str] = []
        handles = [
            m.register_forward_pre_hook(lambda *_, p=p: called.append(p))
            for p, m in search.modules.items()
        ]
        try:
            refs = [network(*a, **k) for a, k in calib]
        finally:
            for h in handles:
                h.remove()
        search.called = set(called)
        hold_refs = [network(*a, **k) for a, k in checks]
        precisions = search.recipe([]).module_precisions(network)
        candidates = [p for p in dict.fromkeys(called) if p and precisions[p] is not Precision.FP32]
        sensitivity = {p: search.error(search.alone(p), calib, refs) for p in candidates}
        ranked = sorted(candidates, key=lambda p: -sensitivity[p])
        pool = set(candidates)

        before = search.error(search.convert([], pool), calib, refs)
        pins: list[str] = []
        best, best_error = [], before
        error = before
        for path in ranked:
            if error <= tolerance:
                break
            pins.append(path)
            error = search.error(search.convert(pins, pool), calib, refs)
            if error < best_error:
                best, best_error = list(pins), error
        met = error <= tolerance
        if met:
            for path in sorted(pins, key=lambda p: sensitivity[p]):
                trial = [p for p in pins if p != path]
                trial_error = search.error(search.convert(trial, pool), calib, refs)
                if trial_error <= tolerance:
                    pins, error = trial, trial_error
        else:
            pins, error = best, best_error
        result = search.convert(pins, pool)
        held = search.error(result, checks, hold_refs) if checks else None

    report = CalibrationReport(
        level=parsed.value,
        dtype=dtype_name(low),
        tolerance=float(tolerance),
        pins=tuple(search.fp32_pins(pins)),
        low_pins=tuple(search.low_pins(pins, pool)),
        error_before=before,
        error_after=error,
        met=met,
        holdout_error=held,
        modules=tuple(
            ModuleSensitivity(p, type(search.modules[p]).__name__, sensitivity[p], i + 1, p in pins)
            for i, p in enumerate(ranked)
        ),
        evaluations=search.evaluations,
    )
    if not met:
        warn(
            f"calibrate: no set of float32 pins meets tolerance {tolerance:g} at {parsed.value} "
            f"{dtype_name(low)} (error {before:.4g} with none, best {error:.4g} with "
            f"{len(pins)} of {len(ranked)}); returning the best found"
        )
    return result, report
