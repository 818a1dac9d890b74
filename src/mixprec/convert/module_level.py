"""Module-level mixed precision (O2, O3, and whole low-precision units inside O1 graphs).

A converted module is a structural copy of the original (same classes, same Parameter
objects) whose ``forward`` is replaced, on the instance, by :class:`CastAtUseForward`:

1. floating inputs are cast to the low dtype;
2. every floating Parameter that computes in low precision is cast **once** and swapped
   into the tree for the duration of the call (a tied weight is cast once and used
   everywhere); the stored tensors keep their dtype and identity, so gradients reach the
   float32 Parameters and an optimizer built before conversion keeps working. Buffers stay
   float32 and are read as they are (running statistics, counters and EMAs updated in
   place keep float32 precision);
3. modules that run in float32 (norms on the black list, modules pinned to float32) have
   their inputs cast up and their outputs cast back down by hooks on the copy; batch and
   instance norms that compute in low precision (O3) keep float32 weights and running
   statistics, which their kernels take with a low-precision input;
4. every low-precision module with weights casts its floating inputs down (a no-op when
   they already are), so a tensor the model makes or promotes to float32 inside its
   forward (a float32 buffer added in, a ``.float()``, ``torch.arange``) still reaches
   the next layer in low precision, as MindSpore casts each cell's inputs;
5. the stored Parameters are put back whatever happens; floating outputs are cast to
   float32.

With gradients off (inference), weight casts are cached and reused until the weight
changes (its version counter or storage), so repeated inference calls cast nothing.
"""

from __future__ import annotations

import functools
import inspect
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.convert.plan import CastPlan, Conversion, PlanRow, dtype_name
from mixprec.convert.structure import CONVERSION_ATTR, structural_copy
from mixprec.policy import lists
from mixprec.policy.dtypes import is_castable
from mixprec.policy.levels import Precision, Recipe
from mixprec.policy.ops import cast_tree

__all__ = [
    "CastAtUseForward",
    "convert_module_level",
    "low_precision_parameters",
    "make_low_unit",
]


@dataclass(frozen=True)
class Slot:
    """A Parameter that computes in low precision: ``owner.<name>``."""

    owner: nn.Module
    name: str
    path: str


# (the dict a Parameter was swapped in, its name, the stored Parameter)
_Swapped = tuple[dict[str, Any], str, torch.Tensor]


class CastAtUseForward:
    """The ``forward`` of a module converted at module level (set on the instance).

    Calls the module's own ``forward`` with floating inputs cast to ``dtype`` and its
    low-precision Parameters and buffers swapped for copies cast once per call.
    """

    def __init__(
        self,
        module: nn.Module,
        dtype: torch.dtype,
        slots: tuple[Slot, ...],
        output_dtype: torch.dtype | None,
    ) -> None:
        self.module = module
        self.dtype = dtype
        self.slots = slots
        self.output_dtype = output_dtype
        self.inner: Callable[..., Any] | None = module.__dict__.get("forward")
        self.recurrent = tuple(
            {id(s.owner): s.owner for s in slots if isinstance(s.owner, nn.RNNBase)}.values()
        )
        # id(stored tensor) -> (weak reference to it, (version, data pointer, device), low copy)
        self._cache: dict[
            int, tuple[weakref.ref[torch.Tensor], tuple[int, int, torch.device], torch.Tensor]
        ] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cache"] = {}
        return state

    @property
    def __signature__(self) -> inspect.Signature:
        """The wrapped forward's signature (what ``inspect`` and ``torch.export`` see)."""
        inner = self.inner or functools.partial(type(self.module).forward, self.module)
        return inspect.signature(inner)

    @property
    def __code__(self) -> types.CodeType:
        """The wrapped forward's code object (tools such as ``torch.export`` read its name
        and location from ``module.forward.__code__``)."""
        code = getattr(self.inner or type(self.module).forward, "__code__", None)
        return code if isinstance(code, types.CodeType) else type(self).__call__.__code__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = cast_tree((args, kwargs), self.dtype)
        swapped = self._swap_in()
        try:
            if self.inner is not None:
                out = self.inner(*args, **kwargs)
            else:
                out = type(self.module).forward(self.module, *args, **kwargs)
        finally:
            self._swap_out(swapped)
        return out if self.output_dtype is None else cast_tree(out, self.output_dtype)

    def clear_cache(self) -> None:
        """Forget the cached inference-time weight casts."""
        self._cache.clear()

    # ------------------------------------------------------------------ internals
    def _low(self, tensor: torch.Tensor) -> torch.Tensor:
        reusable = not (torch.is_grad_enabled() and tensor.requires_grad)
        if not reusable or torch.compiler.is_compiling():
            return tensor.to(self.dtype)
        key = (_version(tensor), tensor.data_ptr(), tensor.device)
        hit = self._cache.get(id(tensor))
        if hit is not None and hit[0]() is tensor and hit[1] == key:
            return hit[2]
        low = tensor.detach().to(self.dtype)
        self._cache[id(tensor)] = (weakref.ref(tensor), key, low)
        return low

    def _swap_in(self) -> list[_Swapped]:
        swapped: list[_Swapped] = []
        lows: dict[int, torch.Tensor] = {}
        try:
            for slot in self.slots:
                table: dict[str, Any] = slot.owner._parameters
                tensor = table.get(slot.name)
                if tensor is None or tensor.dtype == self.dtype or not is_castable(tensor):
                    continue
                low = lows.get(id(tensor))
                if low is None:
                    low = lows[id(tensor)] = self._low(tensor)
                table[slot.name] = low
                swapped.append((table, slot.name, tensor))
            for rnn in self.recurrent:
                rnn._init_flat_weights()
        except BaseException:
            self._swap_out(swapped)
            raise
        return swapped

    def _swap_out(self, swapped: list[_Swapped]) -> None:
        for table, name, original in reversed(swapped):
            table[name] = original
        for rnn in self.recurrent:
            rnn._init_flat_weights()


def _version(tensor: torch.Tensor) -> int:
    try:
        return int(tensor._version)
    except RuntimeError:  # an inference tensor has no version counter
        return -1


class ExtraRepr:
    """``extra_repr`` of a converted module: the original class's, after ``text`` (the
    level and dtype) when there is one."""

    def __init__(self, module: nn.Module, text: str, cls: type[nn.Module] | None = None) -> None:
        self.module = module
        self.text = text
        self.cls = type(module) if cls is None else cls

    def __call__(self) -> str:
        try:
            own = self.cls.extra_repr(self.module)
        except AttributeError:  # the original's extra_repr reads something the copy lacks
            own = ""
        return "\n".join(part for part in (self.text, own) if part)


def _settled(values: Any, dtype: torch.dtype) -> bool:
    """No value needs a cast to ``dtype`` (checked without walking containers)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.dtype != dtype and is_castable(value):
                return False
        elif not isinstance(value, (int, float, bool, str, type(None))):
            return False  # a container: let cast_tree look inside
    return True


def _cast_inputs_hook(
    dtype: torch.dtype, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    if _settled(args, dtype) and _settled(kwargs.values(), dtype):
        return None  # the common case: nothing to cast, no tree walk
    return cast_tree(args, dtype), cast_tree(kwargs, dtype)


def _cast_output_hook(
    dtype: torch.dtype, module: nn.Module, args: tuple[Any, ...], output: Any
) -> Any:
    return cast_tree(output, dtype)


def _precision(recipe: Recipe, module: nn.Module, path: str, parent: Precision) -> Precision:
    pin = recipe.pinned(module, path)
    if pin is not None:
        return pin
    if isinstance(module, recipe.black_modules):
        return Precision.FP32
    return parent


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def convert_module_level(
    network: nn.Module,
    recipe: Recipe,
    *,
    output_dtype: torch.dtype | None = torch.float32,
    prefix: str = "",
    copy: bool = True,
) -> nn.Module:
    """Convert ``network`` at module level: everything low but the float32 islands.

    Args:
        network: the module (not modified when ``copy`` is True).
        recipe: O2 (black list) or O3 (empty black list) recipe; pins apply.
        output_dtype: floating outputs are cast to this (None: left as computed).
        prefix: the module's qualified name inside a larger model (for the plan).
        copy: convert a structural copy (True) or ``network`` itself (already a copy).

    Returns:
        The converted module: same class as ``network``, same Parameters.
    """
    root = structural_copy(network) if copy else network
    low = recipe.dtype
    slots: list[Slot] = []
    rows: list[PlanRow] = [
        PlanRow(prefix, "inputs", dtype_name(low), ("floating inputs -> " + dtype_name(low),))
    ]
    seen_modules: set[int] = set()
    seen_tensors: set[int] = set()

    def visit(module: nn.Module, path: str, parent: Precision) -> None:
        if id(module) in seen_modules:
            return
        seen_modules.add(id(module))
        precision = _precision(recipe, module, path, parent)
        dtype = low if precision is Precision.LOW else torch.float32
        if precision is not parent:
            outer = low if parent is Precision.LOW else torch.float32
            module.register_forward_pre_hook(
                functools.partial(_cast_inputs_hook, dtype), with_kwargs=True
            )
            module.register_forward_hook(functools.partial(_cast_output_hook, outer))
            rows.append(
                PlanRow(
                    path,
                    type(module).__name__,
                    dtype_name(dtype),
                    (f"input -> {dtype_name(dtype)}",),
                    (f"output -> {dtype_name(outer)}",),
                    note="island",
                )
            )
        cast_here: list[str] = []
        if precision is Precision.LOW and not isinstance(module, lists.FP32_STATE_MODULES):
            owned = [
                (n, t) for n, t in module._parameters.items() if t is not None and is_castable(t)
            ]
            for name, tensor in owned:
                slots.append(Slot(module, name, _join(path, name)))
                if tensor.dtype != low and id(tensor) not in seen_tensors:
                    cast_here.append(f"{_join(path, name)} -> {dtype_name(low)}")
                seen_tensors.add(id(tensor))
            if owned and module is not root and precision is parent:
                hook = functools.partial(_cast_inputs_hook, low)
                module.register_forward_pre_hook(hook, with_kwargs=True)
        if cast_here:
            rows.append(
                PlanRow(
                    path, type(module).__name__, dtype_name(dtype), tuple(cast_here), note="weights"
                )
            )
        for name, child in module._modules.items():
            if child is not None:
                visit(child, _join(path, name), precision)

    visit(root, prefix, Precision.LOW)
    if output_dtype is not None:
        rows.append(
            PlanRow(
                prefix,
                "outputs",
                dtype_name(low),
                (),
                ("floating outputs -> " + dtype_name(output_dtype),),
            )
        )
    forward = CastAtUseForward(root, low, tuple(slots), output_dtype)
    root.__dict__["forward"] = forward
    plan = CastPlan(level=recipe.level.value, dtype=dtype_name(low), rows=tuple(rows))
    root.__dict__[CONVERSION_ATTR] = Conversion(recipe, plan)
    root.__dict__["extra_repr"] = ExtraRepr(root, f"mixprec: {recipe.describe()}")
    return root


def make_low_unit(module: nn.Module, recipe: Recipe, prefix: str) -> nn.Module:
    """A whole module computing in low precision, its outputs left low (used for
    white-list modules inside O1 / autocast graphs that cannot be traced)."""
    unit_recipe = Recipe(
        level=recipe.level, dtype=recipe.dtype, low_pin=recipe.low_pin, fp32_pin=recipe.fp32_pin
    )
    return convert_module_level(module, unit_recipe, output_dtype=None, prefix=prefix, copy=False)


def low_precision_parameters(
    module: nn.Module,
) -> tuple[torch.dtype, tuple[tuple[nn.Module, str], ...]]:
    """The low dtype of a module converted at O2/O3 and the Parameters it casts at use.

    Returns ``(dtype, ((owner, name), ...))``: ``getattr(owner, name)`` is a Parameter the
    forward computes with in ``dtype``. Replacing it with ``setattr(owner, name, p)`` (a
    Parameter already in ``dtype``) makes the forward use ``p`` as it is, with no cast.
    This is how the training step gives the model low-precision Parameters of its own.

    Raises:
        TypeError: ``module`` was not converted at module level.

    Example:
        >>> net = mixprec.auto_mixed_precision(torch.nn.Linear(2, 2), "O2", "bf16")
        >>> dtype, slots = low_precision_parameters(net)
        >>> dtype, [name for _, name in slots]
        (torch.bfloat16, ['weight', 'bias'])
    """
    forward = module.__dict__.get("forward")
    if not isinstance(forward, CastAtUseForward):
        raise TypeError(
            f"expected a module converted at level O2 or O3; got {type(module).__name__}"
        )
    return forward.dtype, tuple((slot.owner, slot.name) for slot in forward.slots)
