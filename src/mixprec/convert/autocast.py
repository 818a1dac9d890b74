"""The autocast level as ``torch.autocast`` itself: the user's code, torch's decisions.

The level's decision for every op is the one ``torch.autocast`` makes on CPU and CUDA (its
lists, :mod:`mixprec.policy.lists`, reproduce it op by op), so a converted model runs its
own, unchanged ``forward`` inside ``torch.autocast(device_type, dtype)``: nothing is
traced, nothing is snapshotted, and the host cost per op is torch's own (C++, no Python
per op). Each module's ``forward`` (set on the instance) is one of:

* :class:`AutocastForward`: its own forward, entering the autocast region when called
  from outside it (the root, or a submodule called directly);
* :class:`Fp32Forward` inside a float32 pin: autocast off, floating arguments cast up;
* :class:`~mixprec.convert.runtime.RuntimeForward` forced low for a low pin and for the
  recurrent layers and attention (run whole in low precision: floating arguments and
  weights cast down, under :class:`~mixprec.convert.runtime.RuntimeListMode`).

Children replaced, added or removed after conversion run as on the original (nothing
about them was recorded), tensors in any argument are used as passed, and a forward
reads every attribute at each call.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from mixprec._warn import warn
from mixprec.convert.graph import FAST_PATH_MODULES, unit_weight_rows
from mixprec.convert.module_level import ExtraRepr
from mixprec.convert.plan import CastPlan, Conversion, PlanRow, RowKind
from mixprec.convert.runtime import ForwardBase, RuntimeForward, any_nested, standing_aside
from mixprec.convert.structure import CONVERSION_ATTR, structural_copy
from mixprec.policy import lists
from mixprec.policy.dtypes import dtype_name, is_castable
from mixprec.policy.levels import Precision, Recipe

__all__ = ["AutocastForward", "Fp32Forward", "convert_autocast"]


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    def one(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and is_castable(leaf) and leaf.dtype != dtype:
            return leaf.to(dtype)
        return leaf

    return pytree.tree_map(one, tree)


class AutocastForward(ForwardBase):
    """A module's ``forward``: its own forward inside ``torch.autocast``.

    Inside the model's region (autocast already on with the level's dtype) it calls the
    forward directly; a direct call of the module (an entry point) enters the region. The
    root entered under the user's own ``torch.autocast`` warns once (inside the model the
    level's dtype and pins apply). A call with nested tensors (only a built-in fast path
    makes them; autocast has no kernels for them) and a module with a built-in fast path
    chosen from run-time values run their own code as written, autocast off, so PyTorch
    picks the fast path exactly as it would for the original.
    """

    def __init__(
        self,
        module: nn.Module,
        device_type: str,
        dtype: torch.dtype,
        *,
        root: bool,
        under_fast_path: bool = False,
    ) -> None:
        self.module = module
        self.device_type = device_type
        self.dtype = dtype
        self.root = root
        self.as_written = isinstance(module, FAST_PATH_MODULES)
        self.may_get_nested = under_fast_path  # only a fast path makes nested tensors
        self.warned = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        device = self.device_type
        if self.as_written or (self.may_get_nested and any_nested(args, kwargs)):
            with torch.autocast(device, enabled=False):
                return type(self.module).forward(self.module, *args, **kwargs)
        if torch.is_autocast_enabled(device):
            if not self.root:
                if torch.get_autocast_dtype(device) == self.dtype:  # inside the model
                    return type(self.module).forward(self.module, *args, **kwargs)
            elif not self.warned:
                self._warn_outer()
        with torch.autocast(device, self.dtype):
            return type(self.module).forward(self.module, *args, **kwargs)

    def _warn_outer(self) -> None:
        self.warned = True
        warn(
            "a model converted by mixprec runs under an outer torch.autocast: inside the "
            "model the level's own dtype, lists and float32 pins apply"
        )


class Fp32Forward(ForwardBase):
    """A float32-pinned module's ``forward``: autocast off, floating arguments cast up
    (also under an outer ``torch.autocast``)."""

    def __init__(self, module: nn.Module, device_type: str) -> None:
        self.module = module
        self.device_type = device_type

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _cast_floating((args, kwargs), torch.float32)
        with standing_aside(), torch.autocast(self.device_type, enabled=False):
            return type(self.module).forward(self.module, *args, **kwargs)


def _precision(recipe: Recipe, scopes: Scopes) -> Precision | None:
    """A pin in scope, or LOW for a module run whole in low precision."""
    for path, module in reversed(scopes):
        pin = recipe.pinned(module, path)
        if pin is not None:
            return pin
    if any(isinstance(m, recipe.unit_modules) for _, m in scopes):
        return Precision.LOW
    return None


Scopes = tuple[tuple[str, nn.Module], ...]


def _walk(module: nn.Module, path: str, scopes: Scopes) -> Iterator[tuple[str, nn.Module, Scopes]]:
    """Every module with its qualified name and enclosing modules (shared ones per place)."""
    yield path, module, scopes
    for name, child in module._modules.items():
        if child is not None:
            child_path = f"{path}.{name}" if path else name
            yield from _walk(child, child_path, (*scopes, (child_path, child)))


def convert_autocast(network: nn.Module, recipe: Recipe) -> nn.Module:
    """The structural copy of ``network`` whose modules run under ``torch.autocast``
    (see the module docstring); :func:`mixprec.explain` reads its plan."""
    root = structural_copy(network)
    seen: set[int] = set()
    for _, module, scopes in _walk(root, "", (("", root),)):
        if id(module) in seen:
            continue
        seen.add(id(module))
        precision = _precision(recipe, scopes)
        if precision is Precision.FP32:
            module.__dict__["forward"] = Fp32Forward(module, recipe.device_type)
        elif precision is Precision.LOW:  # a low pin, a recurrent layer or attention: whole low
            reason = "runs whole in low precision"
            module.__dict__["forward"] = RuntimeForward(
                module, recipe, scopes, None, Precision.LOW, reason
            )
        elif type(module).forward is not nn.Module.forward:
            module.__dict__["forward"] = AutocastForward(
                module,
                recipe.device_type,
                recipe.dtype,
                root=module is root,
                under_fast_path=any(isinstance(m, FAST_PATH_MODULES) for _, m in scopes[:-1]),
            )
    root.__dict__[CONVERSION_ATTR] = Conversion(recipe, static_plan(root, recipe))
    root.__dict__["extra_repr"] = ExtraRepr(root, f"mixprec: {recipe.describe()}")
    return root


#: The op a built-in module runs (what its row in the static plan is decided by).
_MODULE_OPS: tuple[tuple[type[nn.Module], str], ...] = (
    (nn.Linear, "linear"),
    (nn.Bilinear, "bilinear"),
    (nn.Conv1d, "conv1d"),
    (nn.Conv2d, "conv2d"),
    (nn.Conv3d, "conv3d"),
    (nn.ConvTranspose1d, "conv_transpose1d"),
    (nn.ConvTranspose2d, "conv_transpose2d"),
    (nn.ConvTranspose3d, "conv_transpose3d"),
    (nn.LayerNorm, "layer_norm"),
    (nn.GroupNorm, "group_norm"),
    (nn.Embedding, "embedding"),
    *lists.MODULE_OPS,
)


def static_plan(root: nn.Module, recipe: Recipe) -> CastPlan:
    """The module-level view of the plan: a row per built-in one-op module (what
    ``torch.autocast`` computes it in, the weights it casts at use) and per module run
    whole in low precision, in module order (a shared module once per place).
    ``explain(model, *inputs)`` gives the casts a forward with those inputs makes."""
    rows: list[PlanRow] = []
    runtime: list[tuple[str, str]] = []
    low = recipe.dtype
    inside_unit: set[int] = set()
    for path, module, scopes in _walk(root, "", (("", root),)):
        if any(id(m) in inside_unit for _, m in scopes[:-1]):
            continue
        forward = module.__dict__.get("forward")
        if isinstance(forward, RuntimeForward):
            inside_unit.add(id(module))
            rows.append(unit_weight_rows(module, path, recipe, inputs=True))
            continue
        if isinstance(forward, AutocastForward) and forward.as_written:
            reason = "has a built-in fast path chosen from run-time values; runs its own code"
            runtime.append((path, reason))
            rows.append(
                PlanRow.make(
                    path, type(module).__name__, "float32", kind=RowKind.RUNTIME, note=reason
                )
            )
        op = next((name for cls, name in _MODULE_OPS if type(module) is cls), None)
        if op is None:
            continue
        precision = (
            Precision.FP32 if isinstance(forward, Fp32Forward) else recipe.decide(op, scopes)
        )
        if precision is Precision.LOW:
            weights = [
                (f"{path}.{n}" if path else n, low)
                for n, p in module.named_parameters(recurse=False)
                if is_castable(p)
            ]
            rows.append(PlanRow.make(path, op, low, weights, kind=RowKind.MODULE))
        else:
            shown = "float32" if precision is Precision.FP32 else "follows inputs"
            rows.append(PlanRow.make(path, op, shown, kind=RowKind.MODULE))
    return CastPlan(
        level=recipe.level.value,
        dtype=dtype_name(low),
        rows=tuple(rows),
        runtime_parts=tuple(p for p, _ in runtime),
        runtime_reasons=tuple(r for _, r in runtime),
    )
