"""``lint``: settings that cannot work at a level and dtype, found before training.

Each finding names the place and the fix. What the level keeps in float32 raises no
alarm: norms on the O2 black list, modules pinned to float32, optimizer state when
master weights keep it in float32. The checks:

- optimizer ``eps`` below the smallest normal number of the optimizer state's dtype
  (Adam's 1e-8 rounds to 0 in float16: where a second moment underflows, the update
  divides by zero);
- large constants (buffers, float attributes such as a ``-1e9`` mask fill) beyond the
  dtype's largest value, in modules that compute in low precision;
- norm layers whose ``eps`` underflows in the dtype they run in: each such layer runs
  once on a zero-variance input in that dtype, so layers whose kernels compute in
  float32 inside (``torch.nn.LayerNorm`` and friends) are not flagged;
- a fixed loss scale beyond the dtype's largest value (a dynamic one backs off);
- with ``fp8=``, the layers whose weights the recipe's casts damage (saturate or flush to
  zero more than 1% of the values: an outlier channel under tensorwise scaling), with the
  filter that keeps them out of fp8. Activations and gradients need a batch:
  :func:`mixprec.find_overflow` with ``fp8=``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from mixprec._check import require_module
from mixprec.convert.declared import with_declared_pins
from mixprec.convert.module_level import convert_module_level
from mixprec.fp8.recipes import Fp8Recipe
from mixprec.fp8.report import Fp8Report, weight_report
from mixprec.fp8.swap import Fp8Filter
from mixprec.policy import lists
from mixprec.policy.dtypes import device_of, dtype_name
from mixprec.policy.levels import Level, Precision, Recipe, make_recipe, resolve
from mixprec.training.scaling import (
    FixedLossScaleManager,
    LossScaleManager,
    LossScaler,
    StaticLossScaler,
)

__all__ = ["Finding", "FindingKind", "LintReport", "lint"]

#: Attribute names norm layers keep their epsilon in (torch, transformers, timm).
EPS_NAMES = ("eps", "variance_epsilon", "epsilon")


class FindingKind(str, enum.Enum):
    OPTIMIZER_EPS = "optimizer eps"
    LARGE_CONSTANT = "large constant"
    NORM_EPS = "norm eps"
    LOSS_SCALE = "loss scale"
    FP8 = "fp8 cast"


@dataclasses.dataclass(frozen=True)
class Finding:
    """One thing that cannot work: what, where, why, and the fix."""

    kind: FindingKind
    place: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"[{self.kind.value}] {self.place}: {self.problem}; fix: {self.fix}"


@dataclasses.dataclass(frozen=True)
class LintReport:
    """The findings of :func:`lint` (empty when nothing was found)."""

    level: str
    dtype: str
    findings: tuple[Finding, ...]

    def __len__(self) -> int:
        return len(self.findings)

    def __iter__(self) -> Iterator[Finding]:
        return iter(self.findings)

    def to_dict(self) -> dict[str, Any]:
        return {
            "level": self.level,
            "dtype": self.dtype,
            "findings": [{**dataclasses.asdict(f), "kind": f.kind.value} for f in self.findings],
        }

    def __str__(self) -> str:
        head = f"lint: level {self.level}, {self.dtype}"
        if not self.findings:
            return f"{head}: no findings"
        count = f"{len(self.findings)} finding{'s' if len(self.findings) > 1 else ''}"
        return "\n".join([f"{head}: {count}", *(f"  {f}" for f in self)])


def _runs_low(recipe: Recipe, network: nn.Module) -> dict[str, bool]:
    """Which modules compute in low precision at this level (by qualified name): at the
    AUTOCAST level the low results of a module flow on through those that follow them."""
    flows = recipe.level is Level.AUTOCAST
    return {
        path: precision is Precision.LOW or (flows and precision is Precision.FOLLOW)
        for path, precision in recipe.module_precisions(network).items()
    }


def _state_dtype(param: torch.Tensor, level: Level, low: torch.dtype, masters: bool) -> torch.dtype:
    if param.dtype in (torch.float16, torch.bfloat16):
        return param.dtype
    if level in (Level.O2, Level.O3) and not masters:
        return low
    return param.dtype


def _optimizer(
    optimizer: torch.optim.Optimizer,
    names: dict[int, str],
    level: Level,
    low: torch.dtype,
    masters: bool,
) -> Iterator[Finding]:
    for index, group in enumerate(optimizer.param_groups):
        eps = group.get("eps")
        if not isinstance(eps, (int, float)) or isinstance(eps, bool):
            continue
        for dtype in sorted(
            {_state_dtype(p, level, low, masters) for p in group["params"]}, key=str
        ):
            tiny = torch.finfo(dtype).tiny
            if eps >= tiny or dtype == torch.float32:
                continue
            rounded = float(torch.tensor(eps, dtype=dtype))
            first = next((names.get(id(p), "?") for p in group["params"]), "?")
            yield Finding(
                FindingKind.OPTIMIZER_EPS,
                f"{type(optimizer).__name__} param group {index} (from {first})",
                f"eps={eps:g} is below {dtype_name(dtype)}'s smallest normal {tiny:.3g} "
                f"(it is {rounded:g} there) and the optimizer state is {dtype_name(dtype)}: "
                "where a second moment underflows the update divides by (almost) zero",
                "keep master weights (optimizer state in float32), or eps >= "
                f"{tiny:.2g} (e.g. eps=1e-4)",
            )


def _constants(
    network: nn.Module, runs_low: dict[str, bool], low: torch.dtype
) -> Iterator[Finding]:
    limit = torch.finfo(low).max
    for path, module in network.named_modules():
        if not runs_low.get(path, False):
            continue
        values: list[tuple[str, float]] = []
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_floating_point() and buffer.numel():
                finite = buffer.detach()[torch.isfinite(buffer.detach())]
                if finite.numel():
                    values.append((f"buffer {name!r}", float(finite.abs().max())))
        for name, value in vars(module).items():
            if isinstance(value, float) and math.isfinite(value):
                values.append((f"attribute {name!r}", abs(value)))
        for what, magnitude in values:
            if magnitude > limit:
                yield Finding(
                    FindingKind.LARGE_CONSTANT,
                    f"{path or '(model)'} ({type(module).__name__}) {what}",
                    f"holds {magnitude:.3g}, beyond {dtype_name(low)}'s largest value "
                    f"{limit:.4g}: it becomes inf (a -1e9 mask fill turns softmax rows into NaN)",
                    f"use torch.finfo(x.dtype).min (or -inf) instead, or keep {path or 'the model'} "
                    f"in float32 (fp32_modules=[{path!r}])",
                )


def _eps_of(module: nn.Module) -> float | None:
    for name in EPS_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, lists.BLACK_MODULES) or (
        _eps_of(module) is not None and "norm" in type(module).__name__.lower()
    )


def _zero_input(module: nn.Module) -> torch.Tensor | None:
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, (tuple, list)) and shape:
        return torch.zeros(2, *shape)
    channels = getattr(module, "num_features", None) or getattr(module, "num_channels", None)
    if isinstance(channels, int):
        return torch.zeros(2, channels, 4)
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 1:
        return torch.zeros(2, 3, weight.numel())
    return None


def _norm_nonfinite(module: nn.Module, recipe: Recipe, eps: float) -> bool:
    """Run the layer alone, in the low dtype, on a zero-variance input (where that input
    cannot be made or run, as for a huge layer, whether ``eps`` is 0 in the dtype)."""
    try:
        x = _zero_input(module)
    except (RuntimeError, MemoryError):  # too large to allocate
        x = None
    if x is not None:
        low = make_recipe(Level.O3, recipe.dtype, device_of(module))
        part = convert_module_level(module, low, output_dtype=None)
        part.eval()
        try:
            with torch.no_grad():
                out = part(x.to(device_of(module)))
            if isinstance(out, torch.Tensor):
                return not bool(torch.isfinite(out).all())
        except Exception:
            pass
    return float(torch.tensor(eps, dtype=recipe.dtype)) == 0.0


def _norms(network: nn.Module, runs_low: dict[str, bool], recipe: Recipe) -> Iterator[Finding]:
    for path, module in network.named_modules():
        if not runs_low.get(path, False) or not _is_norm(module):
            continue
        eps = _eps_of(module)
        if eps is None or not _norm_nonfinite(module, recipe, eps):
            continue
        tiny = torch.finfo(recipe.dtype).tiny
        yield Finding(
            FindingKind.NORM_EPS,
            f"{path or '(model)'} ({type(module).__name__})",
            f"eps={eps:g} underflows in {dtype_name(recipe.dtype)}, the dtype it runs in: "
            "a zero-variance input gives a non-finite output",
            f"keep it in float32 (fp32_modules=[{path!r}], or add {type(module).__name__} to "
            f"the black list), or eps >= {tiny:.2g}",
        )


def _loss_scale(scaler: object, low: torch.dtype) -> Iterator[Finding]:
    limit = torch.finfo(low).max
    if isinstance(scaler, FixedLossScaleManager):
        value, place = float(scaler.get_loss_scale()), "FixedLossScaleManager"
    elif isinstance(scaler, StaticLossScaler):
        value, place = float(scaler.scale_value), "StaticLossScaler"
    else:
        return
    if value > limit:
        yield Finding(
            FindingKind.LOSS_SCALE,
            place,
            f"the fixed loss scale {value:g} is beyond {dtype_name(low)}'s largest value "
            f"{limit:.4g}: any gradient of size 1 at the output overflows, and a fixed scale "
            "never backs off",
            f"a scale <= {limit:.4g} (e.g. 2**15), or DynamicLossScaleManager()",
        )


def _fp8(report: Fp8Report, low: str) -> Iterator[Finding]:
    hint = ""
    if report.recipe is Fp8Recipe.TENSORWISE:
        hint = "; or the 'rowwise' recipe (per-row scales isolate an outlier channel)"
    for row in report.hurt:
        yield Finding(
            FindingKind.FP8,
            f"{row.layer} (Linear) weight",
            f"in fp8 ({report.recipe.value}) the {row.gemm.value} GEMM's cast of the weight "
            f"flushes {row.flushed:.1%} of its values to zero and saturates "
            f"{row.saturated:.1%} (amax {row.amax:.3g})",
            f"keep it out of fp8, in {low}: fp8_filter=lambda module, name: name != "
            f"{row.layer!r} (or in float32: fp32_modules=[{row.layer!r}]){hint}",
        )


def lint(
    network: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    level: str | Level = "O2",
    dtype: torch.dtype | str | None = None,
    master_weights: bool = True,
    loss_scale_manager: LossScaleManager | LossScaler | None = None,
    fp32_modules: Any = None,
    fp8: Fp8Recipe | str | None = None,
    fp8_filter: Fp8Filter | None = None,
) -> LintReport:
    """Find settings that cannot work at ``level`` in ``dtype``, before training.

    Args:
        network: the (unconverted) model.
        optimizer: its optimizer, for the ``eps`` check.
        level: the level it will run at.
        dtype: the low-precision dtype (None: the device's usual one).
        master_weights: whether the optimizer will step float32 master weights (O2/O3
            training keeps them by default); without, its state is in ``dtype``.
        loss_scale_manager: the loss-scale manager (or functional scaler) to check.
        fp32_modules: the module pins the model will be converted with.
        fp8: the fp8 recipe the model will train with (None: no fp8): the weights of the
            layers it puts in fp8 are cast as the recipe casts them.
        fp8_filter: the ``(module, qualified_name) -> bool`` choosing the fp8 layers
            (default: as :func:`mixprec.fp8.apply_fp8`).

    Returns:
        A :class:`LintReport`: prints one line per finding, ``.to_dict()`` for JSON,
        ``len()`` is the number of findings.

    Raises:
        TypeError: ``network`` is not a module, ``optimizer`` not an optimizer,
            ``loss_scale_manager`` neither a manager nor a scaler.
        ValueError: unknown level, dtype or fp8 recipe.

    Example:
        >>> report = mixprec.lint(model, torch.optim.Adam(model.parameters()), dtype="fp16",
        ...                       master_weights=False)
        >>> print(report)  # doctest: +SKIP
    """
    require_module(network)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None; got {optimizer!r}")
    if not isinstance(master_weights, bool):
        raise TypeError(f"master_weights must be a bool; got {master_weights!r}")
    if loss_scale_manager is not None and not isinstance(
        loss_scale_manager, (LossScaleManager, LossScaler)
    ):
        raise TypeError(
            "loss_scale_manager must be a LossScaleManager (FixedLossScaleManager, "
            "DynamicLossScaleManager, ...), a functional loss scaler (StaticLossScaler, "
            f"DynamicLossScaler) or None; got {type(loss_scale_manager).__name__}: "
            f"{loss_scale_manager!r}"
        )
    recipe = resolve(network, level, dtype, fp32_modules=fp32_modules, argument="level")
    recipe = with_declared_pins(network, recipe)  # as conversion adds them
    parsed, low = recipe.level, recipe.dtype
    fp8_findings: list[Finding] = []
    if fp8 is not None:
        if fp8_filter is not None and not callable(fp8_filter):
            raise TypeError(
                f"fp8_filter must be a function (module, qualified_name) -> bool; got {fp8_filter!r}"
            )
        report = weight_report(network, fp8, filter=fp8_filter, fp32_pin=recipe.fp32_pin)
        low_name = "float32" if parsed is Level.O0 else dtype_name(low)
        fp8_findings += _fp8(report, low_name)
    if parsed is Level.O0:
        return LintReport(parsed.value, "float32", tuple(fp8_findings))
    runs_low = _runs_low(recipe, network)
    names = {id(p): n for n, p in network.named_parameters()}
    findings: list[Finding] = []
    if optimizer is not None:
        findings += _optimizer(optimizer, names, parsed, low, master_weights)
    findings += _constants(network, runs_low, low)
    findings += _norms(network, runs_low, recipe)
    findings += _loss_scale(loss_scale_manager, low)
    findings += fp8_findings
    return LintReport(parsed.value, dtype_name(low), tuple(findings))
