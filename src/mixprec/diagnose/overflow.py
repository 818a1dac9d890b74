"""``find_overflow``: the first module whose numbers stop being finite, and the fix.

One forward and one backward run with probes on every module (:mod:`.probes`); the
probes are removed afterwards, also on error, and the run leaves the model as it was
(RNG forked, buffers restored, ``.grad`` untouched). The report names:

- forward: the first module, in execution order, whose output is not finite. A value
  that is already non-finite when it *enters* a module was made by the code of the
  module around it (between its submodule calls), which is named instead;
- backward: the first gradient, in backward order, that is not finite: the gradient of
  a module's input (its backward made it), of a parameter, or the gradient arriving at
  a module's output (made after it in the forward: by the code around it or the loss);
- the smallest fix that a re-run confirms, tried in this order: a lower loss scale
  (backward only), the model is non-finite in float32 too (not a precision problem),
  keep the culprit in float32 (or its nearest enclosing module that makes it finite),
  bfloat16 instead of float16.

With ``fp8=`` (or a network already holding emulated fp8 layers) the chosen linear layers
run in emulated fp8 and the report adds which of them the fp8 casts hurt, from their
statistics over the same run (:mod:`mixprec.fp8.report`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch import nn

from mixprec._check import require_module
from mixprec.convert.api import auto_mixed_precision
from mixprec.convert.declared import with_declared_pins
from mixprec.convert.plan import Conversion
from mixprec.convert.structure import conversion_of
from mixprec.diagnose.probes import Event, Phase, Recorder, preserved, tensor_leaves
from mixprec.diagnose.report import Culprit, Fix, FixKind, OverflowReport
from mixprec.fp8.linear import Fp8Linear
from mixprec.fp8.recipes import Fp8Recipe
from mixprec.fp8.report import DEFAULT_THRESHOLD, Fp8Report
from mixprec.fp8.stats import fp8_stats
from mixprec.fp8.swap import Fp8Filter, apply_fp8
from mixprec.policy.dtypes import device_of, dtype_name, resolve_dtype
from mixprec.policy.levels import Level, Precision, Recipe, make_recipe, recommend
from mixprec.policy.ops import cast_tree

__all__ = ["find_overflow", "probe"]

#: The largest loss scale: the loss is scaled in float32 (as in the training step).
_MAX_LOSS_SCALE = float(torch.finfo(torch.float32).max)

LossFn = Callable[..., torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one probed run saw."""

    events: list[Event]
    loss: float | None
    nonfinite_params: tuple[str, ...]
    finite_scale: float | None  # searched only when the gradients were not finite

    @property
    def finite(self) -> bool:
        return (
            all(e.finite for e in self.events)
            and not self.nonfinite_params
            and (self.loss is None or math.isfinite(self.loss))
        )


def loss_of(output: Any, loss_fn: LossFn | None, target: Any) -> torch.Tensor:
    """The scalar to differentiate: ``loss_fn(output, target)`` in float32; else the
    network's own loss (a scalar tensor, ``["loss"]`` or ``.loss``); else the sum of its
    floating outputs."""
    if loss_fn is not None:
        out32 = cast_tree(output, torch.float32)
        loss = (
            loss_fn(out32) if target is None else loss_fn(out32, cast_tree(target, torch.float32))
        )
        return loss.float().sum()
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output.float()
    own = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(own, torch.Tensor) and own.dim() == 0:
        return own.float()
    leaves = tensor_leaves(output)
    if not leaves:
        raise TypeError(
            f"the network returned no floating tensor ({type(output).__name__}); "
            "pass loss_fn to say what to differentiate"
        )
    return torch.stack([t.float().sum() for t in leaves]).sum()


def probe(
    network: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    loss_fn: LossFn | None,
    target: Any,
    loss_scale: float,
    *,
    backward: bool = True,
) -> Outcome:
    """One forward (and backward) of ``network`` under probes, leaving no trace."""
    params = [(n, p) for n, p in network.named_parameters() if p.requires_grad]
    with preserved(network), torch.enable_grad(), Recorder(network, backward=backward) as rec:
        loss = loss_of(network(*args, **kwargs), loss_fn, target)
        grads: tuple[torch.Tensor | None, ...] = ()
        differentiable = backward and params and loss.requires_grad
        if differentiable:
            grads = torch.autograd.grad(
                loss * loss_scale, [p for _, p in params], allow_unused=True, retain_graph=True
            )
        events = rec.events()
        rec.remove()
        bad = _nonfinite([n for n, _ in params], grads)
        finite_scale = None
        if bad and loss_scale > 1:
            finite_scale = _largest_finite_scale(loss, [p for _, p in params], loss_scale)
    value = float(loss.detach())
    return Outcome(events, value, bad, finite_scale)


def _nonfinite(names: list[str], grads: tuple[torch.Tensor | None, ...]) -> tuple[str, ...]:
    present = [(n, g) for n, g in zip(names, grads, strict=False) if g is not None]
    if not present:
        return ()
    flags = torch.stack([torch.isfinite(g).all().cpu() for _, g in present]).tolist()
    return tuple(n for (n, _), ok in zip(present, flags, strict=True) if not ok)


def _largest_finite_scale(
    loss: torch.Tensor, params: list[torch.Tensor], scale: float
) -> float | None:
    """The largest ``scale / 2**k`` (k >= 1, at least 1) whose gradients are finite."""
    steps = max(1, math.ceil(math.log2(scale)))
    candidates = [max(scale / 2**k, 1.0) for k in range(1, steps + 1)]

    def finite(s: float) -> bool:
        grads = torch.autograd.grad(loss * s, params, allow_unused=True, retain_graph=True)
        return not _nonfinite([str(i) for i in range(len(params))], grads)

    low, high, best = 0, len(candidates) - 1, None
    while low <= high:  # candidates are decreasing; finite is monotone in practice
        mid = (low + high) // 2
        if finite(candidates[mid]):
            best, high = candidates[mid], mid - 1
        else:
            low = mid + 1
    return best


# ---------------------------------------------------------------------- attribution
def forward_culprit(events: list[Event]) -> Culprit | None:
    forward = [e for e in events if e.phase in (Phase.INPUT, Phase.OUTPUT)]
    for i, event in enumerate(forward):
        if event.finite:
            continue
        if event.phase is Phase.OUTPUT:
            made_by = "in its forward (its inputs and its submodules' outputs were finite)"
            return Culprit.from_events(event, forward[:i], event.path, event.module_type, made_by)
        if event.path == "":
            return Culprit.from_events(event, [], "(inputs)", "inputs", "(given to the network)")
        outer = event.enclosing or ""
        outer_type = next((e.module_type for e in forward if e.path == outer), "Module")
        made_by = f"in its own code, before it calls {event.path}"
        return Culprit.from_events(event, forward[:i], outer, outer_type, made_by)
    return None


def backward_culprit(events: list[Event]) -> Culprit | None:
    backward = [e for e in events if e.phase not in (Phase.INPUT, Phase.OUTPUT)]
    for i, event in enumerate(backward):
        if event.finite:
            continue
        if event.phase is Phase.INPUT_GRAD:
            module, kind, made_by = event.path, event.module_type, "in its backward"
        elif event.phase is Phase.PARAM_GRAD:
            module = event.path.rpartition(".")[0]
            kind = next((e.module_type for e in events if e.path == module), "Module")
            made_by = f"in its backward (gradient of {event.path})"
        elif event.enclosing is None:
            module, kind, made_by = "(loss)", "loss", "(the gradient of the loss)"
        else:
            module = event.enclosing
            kind = next((e.module_type for e in events if e.path == module), "Module")
            made_by = f"in the backward of its own code, after it calls {event.path or '(model)'}"
        return Culprit.from_events(event, backward[:i], module, kind, made_by)
    return None


def report_of(
    outcome: Outcome,
    level: Level,
    dtype: torch.dtype | None,
    loss_scale: float,
    fix: Fix,
    fp8: Fp8Report | None = None,
) -> OverflowReport:
    forward = forward_culprit(outcome.events)
    if forward is None and outcome.loss is not None and not math.isfinite(outcome.loss):
        largest = max((e.largest for e in outcome.events), default=0.0)
        forward = Culprit(
            "(loss)", "loss", "loss", "computing the loss from finite outputs",
            "inf" if math.isinf(outcome.loss) else "nan", "float32",
            float(torch.finfo(torch.float32).max), largest, "outputs",
        )  # fmt: skip
    return OverflowReport(
        level=level.value,
        dtype="float32" if dtype is None else dtype_name(dtype),
        loss_scale=float(loss_scale),
        forward=forward,
        backward=backward_culprit(outcome.events),
        loss=outcome.loss,
        nonfinite_params=outcome.nonfinite_params,
        fix=fix,
        fp8=fp8,
    )


def probe_fp8(
    network: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    loss_fn: LossFn | None,
    target: Any,
    loss_scale: float,
) -> tuple[Outcome, Fp8Report | None]:
    """:func:`probe`, with the fp8 report of the network's emulated fp8 layers (if any)."""
    layers = [m for m in network.modules() if isinstance(m, Fp8Linear)]
    if not layers:
        return probe(network, args, kwargs, loss_fn, target, loss_scale), None
    with fp8_stats(network) as stats:
        outcome = probe(network, args, kwargs, loss_fn, target, loss_scale)
    recipe = layers[0].fp8_config.recipe
    return outcome, Fp8Report.from_stats(recipe, stats, DEFAULT_THRESHOLD)


# ---------------------------------------------------------------------- the fix
def pin_call(level: Level, dtype: torch.dtype | None, module: str) -> str:
    low = "" if dtype is None else f", {dtype_name(dtype)!r}"
    return (
        f"keep {module} in float32: "
        f"mixprec.auto_mixed_precision(model, {level.value!r}{low}, fp32_modules=[{module!r}])"
    )


def find_fix(
    outcome: Outcome,
    culprit: Culprit | None,
    rerun: Callable[[Level, torch.dtype | None, list[str]], Outcome] | None,
    level: Level,
    dtype: torch.dtype | None,
    loss_scale: float,
    fp32: Collection[str] = (),
) -> Fix:
    """The smallest fix a re-run confirms (``rerun`` is None when the unconverted model is
    not at hand: then the fix is named without a check). ``fp32`` names the modules that
    compute in float32 at this level already: pinning them is no fix."""
    if outcome.finite:
        return Fix(FixKind.NONE, "nothing to fix")
    forward_ok = forward_culprit(outcome.events) is None
    if forward_ok and outcome.finite_scale is not None:
        return Fix(
            FixKind.LOWER_LOSS_SCALE,
            f"a lower loss scale: the gradients are finite at {outcome.finite_scale:g} "
            f"(not at {loss_scale:g}); a dynamic loss scale gets there by itself",
            verified=True,
            loss_scale=outcome.finite_scale,
        )
    module = None if culprit is None or culprit.module.startswith("(") else culprit.module
    while module and module in fp32:
        module = module.rpartition(".")[0]
    if rerun is None:
        if module:
            return Fix(FixKind.FP32_MODULE, pin_call(level, dtype, module), module=module)
        return Fix(FixKind.UNKNOWN, "none named: the value was not made inside a module")
    if level is not Level.O0 and not rerun(Level.O0, None, []).finite:
        where = (culprit.module or "the network's own code") if culprit else "the model"
        return Fix(
            FixKind.NOT_PRECISION,
            f"none in precision: the model is not finite in float32 either ({where}); "
            "a bug in the model or its inputs",
            verified=True,
        )
    if module:
        path = module
        while path:
            if path not in fp32 and rerun(level, dtype, [path]).finite:
                return Fix(FixKind.FP32_MODULE, pin_call(level, dtype, path), True, path)
            path = path.rpartition(".")[0]
    if dtype == torch.float16 and rerun(level, torch.bfloat16, []).finite:
        return Fix(
            FixKind.BFLOAT16,
            f"bfloat16 instead of float16: mixprec.auto_mixed_precision(model, {level.value!r}, 'bf16')",
            verified=True,
        )
    return Fix(
        FixKind.UNKNOWN, "none found: no single float32 module and no dtype change made it finite"
    )


# ---------------------------------------------------------------------- the entry point
def find_overflow(
    network: nn.Module,
    *inputs: Any,
    loss_fn: LossFn | None = None,
    target: Any = None,
    level: str | Level = "O2",
    dtype: torch.dtype | str | None = None,
    loss_scale: float = 1.0,
    fp8: Fp8Recipe | str | None = None,
    fp8_filter: Fp8Filter | None = None,
    **kwargs: Any,
) -> OverflowReport:
    """Find the first module whose output or gradient is not finite, and the smallest fix.

    The network runs once forward and once backward at ``level``/``dtype`` (converted
    here; an already converted network runs as it is) in its current train/eval mode,
    with a probe on every module. Nothing is left behind: the probes are removed, the
    RNGs forked, buffers restored, and parameter ``.grad`` is not touched. The fix is
    checked by re-running with it applied (a lower loss scale; keeping a module in
    float32; bfloat16 instead of float16), the smallest first.

    Args:
        network: the model (unconverted, or converted by mixprec).
        *inputs: its positional inputs; keyword arguments not listed here go to it too.
        loss_fn: ``loss_fn(output, target)`` (or ``loss_fn(output)`` without a target),
            computed in float32. Without it the network's own loss is used when it returns
            one (a scalar, ``["loss"]``, ``.loss``), else the sum of its floating outputs.
        target: the label passed to ``loss_fn``.
        level: the level to run at (``"O0"``-``"O3"``, ``"autocast"``, ``"auto"``).
        dtype: the low-precision dtype (None: the device's usual one).
        loss_scale: what the loss is multiplied by before the backward (from 1 to
            float32's largest value).
        fp8: an fp8 recipe (``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``):
            the chosen linear layers run in emulated fp8 (in every re-run too), and the
            report's ``fp8`` names the layers the casts hurt, with the filter that keeps
            them in bf16. Unused for a converted network (its own fp8 layers are read).
        fp8_filter: the ``(module, qualified_name) -> bool`` choosing the fp8 layers
            (default: as :func:`mixprec.fp8.apply_fp8`).

    Returns:
        An :class:`OverflowReport`: prints readably, ``.to_dict()`` for JSON.

    Raises:
        TypeError: ``network`` is not a module; the output has nothing to differentiate.
        ValueError: unknown level, dtype or fp8 recipe; ``loss_scale`` below 1, infinite
            or beyond float32's range.

    Example:
        >>> report = mixprec.find_overflow(model, x, loss_fn=F.cross_entropy, target=y,
        ...                                 level="O2", dtype="fp16")
        >>> print(report)  # doctest: +SKIP
        >>> report.module  # the first module with a non-finite output, or None
    """
    require_module(network)
    if (
        isinstance(loss_scale, bool)
        or not isinstance(loss_scale, (int, float))
        or not 1 <= loss_scale <= _MAX_LOSS_SCALE
    ):
        raise ValueError(
            f"loss_scale must be a finite number from 1 to float32's largest value "
            f"{_MAX_LOSS_SCALE:.4g}; got {loss_scale!r}"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable or None; got {loss_fn!r}")
    conversion = conversion_of(network)
    if isinstance(conversion, Conversion):
        recipe = conversion.recipe
        outcome, fp8_found = probe_fp8(network, inputs, kwargs, loss_fn, target, loss_scale)
        culprit = forward_culprit(outcome.events) or backward_culprit(outcome.events)
        fp32 = _fp32_modules(recipe, network)
        fix = find_fix(outcome, culprit, None, recipe.level, recipe.dtype, loss_scale, fp32)
        return report_of(outcome, recipe.level, recipe.dtype, loss_scale, fix, fp8_found)
    parsed_fp8 = None if fp8 is None else Fp8Recipe.parse(fp8, "fp8")
    if fp8_filter is not None and not callable(fp8_filter):
        raise TypeError(
            f"fp8_filter must be a function (module, qualified_name) -> bool; got {fp8_filter!r}"
        )

    parsed = Level.parse(level, "level")
    low = None if dtype is None else resolve_dtype(dtype)
    if parsed is Level.AUTO:
        parsed, low, _ = recommend(device_of(network), low)
    if parsed is not Level.O0 and low is None:
        low = resolve_dtype(None, device_of(network))

    def convert_at(at: Level, in_dtype: torch.dtype | None, pins: list[str]) -> nn.Module:
        base = network
        if parsed_fp8 is not None:  # emulated fp8 layers, whose statistics can be read
            pinned = set(pins)
            base = apply_fp8(
                network,
                parsed_fp8,
                filter=fp8_filter,
                fp32_pin=lambda module, name: name in pinned,
                emulate=True,
            )
        return auto_mixed_precision(base, at, in_dtype, fp32_modules=pins or None)

    def rerun(at: Level, in_dtype: torch.dtype | None, pins: list[str]) -> Outcome:
        return probe(convert_at(at, in_dtype, pins), inputs, kwargs, loss_fn, target, loss_scale)

    model = convert_at(parsed, low, [])
    outcome, fp8_found = probe_fp8(model, inputs, kwargs, loss_fn, target, loss_scale)
    culprit = forward_culprit(outcome.events) or backward_culprit(outcome.events)
    at_level = None if low is None else make_recipe(parsed, low, device_of(network))
    already = (
        set() if at_level is None else _fp32_modules(with_declared_pins(network, at_level), network)
    )
    fix = find_fix(outcome, culprit, rerun, parsed, low, loss_scale, already)
    return report_of(outcome, parsed, low, loss_scale, fix, fp8_found)


def _fp32_modules(recipe: Recipe, network: nn.Module) -> set[str]:
    """The modules that compute in float32 at the recipe's level (none at O0, where a
    float32 pin changes nothing either; the root aside)."""
    if recipe.level is Level.O0:
        return set()
    precisions = recipe.module_precisions(network)
    return {path for path, p in precisions.items() if path and p is Precision.FP32}
