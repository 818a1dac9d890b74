"""What a level means: the policy a level, a dtype, lists and pins become.

:func:`resolve` is the one function that turns the user's arguments (a network, a level
string, a dtype spelling, custom lists, pins, ``keep_batchnorm_fp32``) into a frozen
:class:`Recipe`; ``auto_mixed_precision``, ``custom_mixed_precision``,
``build_train_network``, ``lint``, ``find_overflow`` and the command line all call it, so
``auto``, the default dtype and the validation of lists and pins happen in one place.

A :class:`Recipe` is everything a conversion needs to know: the level, the compute,
parameter and output dtypes, the lists (as module classes and op keys) and the user's
pins. Its :meth:`Recipe.decide` says which precision an op runs in (the run-time list of
O1 and of modules run whole in low precision asks it); its :meth:`Recipe.module_precision` says
what a whole module computes in (module-level conversion, FSDP2 sharding, ``lint``,
``calibrate`` and ``find_overflow`` ask it).

The levels, in one table (parameters stay float32 and are cast at use at every level):

===========  ==========================================  =====================  =========
level        low precision                               float32                outputs
===========  ==========================================  =====================  =========
O0           nothing                                     everything             as is
O1           white-list modules and functions             everything else        float32
O2           every module                                black-list modules     float32
O3           everything                                  nothing                float32
autocast     ``torch.autocast``'s lower-precision ops     its float32 ops        as computed
auto         O2 where the device runs the dtype natively, else O0 (a warning)
===========  ==========================================  =====================  =========
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from mixprec._warn import warn
from mixprec.policy import lists
from mixprec.policy.dtypes import (
    default_low_dtype,
    device_of,
    dtype_name,
    has_native_low_precision,
    resolve_dtype,
)
from mixprec.policy.ops import op_key

__all__ = ["Level", "ModulePin", "Pins", "Precision", "Recipe", "recommend", "resolve"]

#: A pin: ``(module, qualified_name) -> bool``.
ModulePin = Callable[[nn.Module, str], bool]
#: What users pass as pins: qualified module names, or a filter.
Pins = Iterable[str] | ModulePin | None
OpKey = str | Callable[..., object]


class Level(str, enum.Enum):
    """An AMP level (parsed from the user's string at the edge)."""

    O0 = "O0"
    O1 = "O1"
    O2 = "O2"
    O3 = "O3"
    AUTOCAST = "autocast"
    AUTO = "auto"

    @classmethod
    def parse(cls, value: object, argument: str = "amp_level") -> Level:
        """``"O2"``, ``"o2"``, ``Level.O2`` -> ``Level.O2``; anything else is a ValueError."""
        if isinstance(value, Level):
            return value
        if isinstance(value, str):
            for level in cls:
                if value.strip().lower() == level.value.lower():
                    return level
        choices = ", ".join(repr(level.value) for level in cls)
        raise ValueError(
            f"The amp level {value!r} is not supported: {argument} must be one of {choices}"
        )

    def __str__(self) -> str:
        return self.value


class Precision(str, enum.Enum):
    """What an op or module computes in."""

    LOW = "low"  # the recipe's low dtype; floating inputs cast down
    FP32 = "fp32"  # float32; low inputs cast up
    PROMOTE = "promote"  # the widest floating input type
    FOLLOW = "follow"  # whatever its inputs are; no casts


@dataclass(frozen=True)
class PathPin:
    """Pins the modules at the given qualified names (a picklable pin)."""

    paths: frozenset[str]

    def __call__(self, module: nn.Module, name: str) -> bool:
        return name in self.paths


@dataclass(frozen=True)
class Recipe:
    """A level and a dtype, made concrete.

    Attributes:
        level: O0, O1, O2, O3 or AUTOCAST (``auto`` is resolved before a recipe exists).
        dtype: the low-precision dtype.
        device_type: ``"cpu"`` or ``"cuda"``: whose autocast lists the AUTOCAST level uses.
        white_modules: module classes computing low (O1), whole.
        low_ops / fp32_ops / promote_ops: op keys (see :func:`mixprec.policy.ops.op_key`).
        black_modules: module classes kept in float32 (O2).
        unit_modules: module classes the AUTOCAST level runs whole in low precision when
            they cannot be traced.
        low_pin / fp32_pin: the user's pins; a pin beats every list.
        leaf_functions: user functions on a list, kept as single calls when tracing.
    """

    level: Level
    dtype: torch.dtype
    device_type: str = "cpu"
    white_modules: tuple[type[nn.Module], ...] = ()
    low_ops: frozenset[OpKey] = frozenset()
    fp32_ops: frozenset[OpKey] = frozenset()
    promote_ops: frozenset[OpKey] = frozenset()
    black_modules: tuple[type[nn.Module], ...] = ()
    unit_modules: tuple[type[nn.Module], ...] = ()
    low_pin: ModulePin | None = None
    fp32_pin: ModulePin | None = None
    leaf_functions: tuple[Callable[..., object], ...] = field(default=())
    reason: str = ""

    @property
    def compute_dtype(self) -> torch.dtype:
        """What the level computes in where it computes low (float32 at O0)."""
        return torch.float32 if self.level is Level.O0 else self.dtype

    @property
    def output_dtype(self) -> torch.dtype | None:
        """float32 for O1-O3; None (as computed) for O0 and the AUTOCAST level."""
        return torch.float32 if self.casts_outputs_to_fp32 else None

    @property
    def casts_outputs_to_fp32(self) -> bool:
        """O1, O2 and O3 return float32 outputs; the AUTOCAST level returns what it computes."""
        return self.level in (Level.O1, Level.O2, Level.O3)

    def pinned(self, module: nn.Module, name: str) -> Precision | None:
        """The user's pin for one module, if any (float32 wins a tie)."""
        if self.fp32_pin is not None and self.fp32_pin(module, name):
            return Precision.FP32
        if self.low_pin is not None and self.low_pin(module, name):
            return Precision.LOW
        return None

    def decide(self, op: OpKey | None, scopes: Sequence[tuple[str, nn.Module]]) -> Precision:
        """The precision of one op (``op``, None for a module call) inside ``scopes``
        (the enclosing modules, outermost first, as ``(qualified_name, module)``).

        Order: the innermost pinned module; then (O1) the innermost white-list module; then
        the op's own list; else FOLLOW.
        """
        for name, module in reversed(scopes):
            pin = self.pinned(module, name)
            if pin is not None:
                return pin
        if self.level is Level.O1:
            for _, module in reversed(scopes):
                if isinstance(module, self.white_modules):
                    return Precision.LOW
        elif (
            self.level is Level.AUTOCAST
            and op is None
            and scopes
            and isinstance(scopes[-1][1], self.unit_modules)
        ):
            return Precision.LOW
        if op is not None:
            if op in self.low_ops:
                return Precision.LOW
            if op in self.fp32_ops:
                return Precision.FP32
            if op in self.promote_ops:
                return Precision.PROMOTE
        return Precision.FOLLOW

    def module_precision(
        self, module: nn.Module, path: str, parent: Precision | None = None
    ) -> Precision:
        """What ``module`` (qualified name ``path``) computes in at this level.

        The one answer conversion (O2/O3 and whole low units), FSDP2 sharding, ``lint``,
        ``calibrate`` and ``find_overflow`` share. ``parent`` is the answer for the module
        around it (None for the root). LOW and FP32 mean the whole module (and what it
        contains, unless a module inside answers otherwise); FOLLOW means its own ops
        decide (:meth:`decide`), which happens only at O1 and the AUTOCAST level.

        Order: O0 computes everything in float32; then the module's pin; then a
        parametrization (its math runs on the float32 original) is float32; then, at
        O2/O3, a black-list module is float32 and any other follows its parent (the root
        is low); at O1 (white list) and AUTOCAST (modules run whole low) a parent that is
        LOW or FP32 decides, then the list, else FOLLOW.
        """
        if self.level is Level.O0:
            return Precision.FP32
        pin = self.pinned(module, path)
        if pin is not None:
            return pin
        if isinstance(module, parametrize.ParametrizationList):
            return Precision.FP32
        if self.level in (Level.O2, Level.O3):
            if isinstance(module, self.black_modules):
                return Precision.FP32
            return Precision.LOW if parent is None else parent
        if parent in (Precision.LOW, Precision.FP32):
            return parent
        whole = self.white_modules if self.level is Level.O1 else self.unit_modules
        return Precision.LOW if isinstance(module, whole) else Precision.FOLLOW

    def module_precisions(self, network: nn.Module, prefix: str = "") -> dict[str, Precision]:
        """:meth:`module_precision` of every module of ``network`` by qualified name (a
        module reached twice answers at its first place, as conversion treats it)."""
        answers: dict[str, Precision] = {}
        seen: set[int] = set()

        def visit(module: nn.Module, path: str, parent: Precision | None) -> None:
            if id(module) in seen:
                return
            seen.add(id(module))
            here = answers[path] = self.module_precision(module, path, parent)
            for name, child in module._modules.items():
                if child is not None:
                    visit(child, f"{path}.{name}" if path else name, here)

        visit(network, prefix, None)
        return answers

    def describe(self) -> str:
        return f"level={self.level.value}, dtype={dtype_name(self.compute_dtype)}"


def function_keys(functions: Iterable[Callable[..., object]]) -> frozenset[OpKey]:
    return frozenset(op_key(f) for f in functions)


def make_recipe(
    level: Level,
    dtype: torch.dtype,
    device: torch.device,
    *,
    white_list: Sequence[type[nn.Module] | Callable[..., object]] | None = None,
    black_list: Sequence[type[nn.Module]] | None = None,
    low_pin: ModulePin | None = None,
    fp32_pin: ModulePin | None = None,
) -> Recipe:
    """The recipe for a concrete level (not AUTO) on ``device``."""
    device_type = "cuda" if device.type == "cuda" else "cpu"
    common = Recipe(level, dtype, device_type, low_pin=low_pin, fp32_pin=fp32_pin)
    if level is Level.O1:
        items = (
            list(lists.WHITE_MODULES) + list(lists.WHITE_FUNCTIONS)
            if white_list is None
            else list(white_list)
        )
        modules = tuple(i for i in items if isinstance(i, type))
        functions = [i for i in items if not isinstance(i, type)]
        user_functions = tuple(f for f in functions if not isinstance(op_key(f), str))
        return dataclasses.replace(
            common,
            white_modules=modules,
            low_ops=function_keys(functions),
            leaf_functions=user_functions,
        )
    if level is Level.AUTOCAST:
        cuda = device_type == "cuda"
        return dataclasses.replace(
            common,
            low_ops=lists.CUDA_LOWER_OPS if cuda else lists.CPU_LOWER_OPS,
            fp32_ops=lists.CUDA_FP32_OPS if cuda else lists.CPU_FP32_OPS,
            promote_ops=lists.CUDA_PROMOTE_OPS if cuda else lists.CPU_PROMOTE_OPS,
            unit_modules=lists.AUTOCAST_LOW_MODULES,
        )
    if level is Level.O2:
        black = lists.BLACK_MODULES if black_list is None else tuple(black_list)
        return dataclasses.replace(common, black_modules=black)
    return common  # O0 and O3


def recommend(
    device: torch.device, dtype: torch.dtype | None, *, quiet: bool = False
) -> tuple[Level, torch.dtype | None, str]:
    """The ``auto`` level: what mixprec recommends for a model on ``device``.

    A GPU: O2 (bfloat16 where supported, else float16 with dynamic loss scaling); a CPU
    with native bfloat16: O2 bfloat16; any other CPU: O0, with a warning. An explicit
    ``dtype`` is respected (O2 in that dtype). What counts as native is
    :func:`mixprec.policy.hardware.is_native`'s answer.

    Args:
        device: where the model lives.
        dtype: the user's explicit low dtype, or None.
        quiet: do not warn when the answer is O0 (``mixprec doctor`` only reports).

    Returns:
        ``(level, dtype or None for O0, reason)``.
    """
    if dtype is not None:
        return Level.O2, dtype, f"O2 in the requested {dtype_name(dtype)}"
    if device.type == "cuda":
        low = default_low_dtype(device)
        return Level.O2, low, f"O2 {dtype_name(low)} on a CUDA GPU"
    if device.type == "cpu" and has_native_low_precision(device):
        return Level.O2, torch.bfloat16, "O2 bfloat16 on a CPU with native bfloat16"
    reason = (
        f"O0: {device.type} has no native low-precision matmul, so mixed precision would be slower"
    )
    if not quiet:
        warn(f"mixprec level 'auto' chose {reason}")
    return Level.O0, None, reason


@dataclass(frozen=True)
class ClassPin:
    """Pins the modules of the given classes (a picklable pin)."""

    classes: tuple[type[nn.Module], ...]

    def __call__(self, module: nn.Module, name: str) -> bool:
        return isinstance(module, self.classes)


def resolve(
    network: nn.Module,
    level: str | Level = "O0",
    dtype: torch.dtype | str | None = None,
    *,
    white_list: Sequence[type[nn.Module] | Callable[..., object]] | None = None,
    black_list: Sequence[type[nn.Module]] | None = None,
    fp32_modules: Pins = None,
    low_modules: Pins = None,
    keep_batchnorm_fp32: bool | None = None,
    argument: str = "amp_level",
) -> Recipe:
    """The policy for ``network``: every user argument parsed and validated, once.

    Args:
        network: the model (its device decides ``auto`` and the default dtype; its module
            names check the pins).
        level: ``"O0"``-``"O3"``, ``"autocast"``, ``"auto"`` or a :class:`Level`.
        dtype: a low-precision dtype or spelling; None for the device's usual one.
        white_list: a custom O1 list (module classes and functions), or None.
        black_list: a custom O2 list (module classes), or None.
        fp32_modules / low_modules: pins, qualified names or a ``(module, name)`` filter.
        keep_batchnorm_fp32: the training step's switch: None leaves the level's lists as
            they are; True keeps the norms in float32 at every level (O2 by its black
            list, others by a pin); False at O2 empties the black list.
        argument: the name of the level argument in error messages.

    Returns:
        The :class:`Recipe`; ``level`` is never ``AUTO`` (``reason`` says what ``auto``
        chose and why) and is ``O0`` when nothing converts.

    Raises:
        ValueError: an unknown level or dtype; a pin naming no module.
        TypeError: a malformed pin.
    """
    parsed = Level.parse(level, argument)
    low = None if dtype is None else resolve_dtype(dtype)
    device = device_of(network)
    reason = ""
    if parsed is Level.AUTO:
        parsed, low, reason = recommend(device, low)
    if low is None:
        low = resolve_dtype(None, device)
    low_pin = _pin("low_modules", low_modules, network)
    fp32_pin = _pin("fp32_modules", fp32_modules, network)
    if keep_batchnorm_fp32 is not None and parsed is not Level.O0:
        if parsed is Level.O2:
            if black_list is None and not keep_batchnorm_fp32:
                black_list = []
        elif keep_batchnorm_fp32:
            fp32_pin = _either(fp32_pin, ClassPin(lists.BLACK_MODULES))
    recipe = make_recipe(
        parsed,
        low,
        device,
        white_list=white_list,
        black_list=black_list,
        low_pin=low_pin,
        fp32_pin=fp32_pin,
    )
    return dataclasses.replace(recipe, reason=reason)


@dataclass(frozen=True)
class _AnyPin:
    pins: tuple[ModulePin, ...]

    def __call__(self, module: nn.Module, name: str) -> bool:
        return any(pin(module, name) for pin in self.pins)


def _either(first: ModulePin | None, second: ModulePin) -> ModulePin:
    return second if first is None else _AnyPin((first, second))


def _pin(argument: str, pins: Pins, network: nn.Module) -> ModulePin | None:
    """Validate a pin: qualified module names, or a ``(module, name) -> bool`` filter."""
    if pins is None:
        return None
    if callable(pins):
        return pins
    if isinstance(pins, str) or not isinstance(pins, Iterable):
        raise TypeError(
            f"{argument} must be a list of qualified module names or a function "
            f"(module, name) -> bool; got {pins!r}"
        )
    names = dict(network.named_modules(remove_duplicate=False))  # (a shared module's every name)
    paths = list(pins)
    for path in paths:
        if not isinstance(path, str):
            raise TypeError(f"{argument} must hold qualified module names (str); got {path!r}")
        if path not in names:
            close = difflib.get_close_matches(path, list(names), n=3)
            if close:
                hint = f"; did you mean {', '.join(map(repr, close))}?"
            else:
                shown = [n for n in names if n][:8]
                more = ", ..." if len(names) - 1 > len(shown) else ""
                hint = f"; its modules are {', '.join(map(repr, shown))}{more}"
            raise ValueError(
                f"{argument} names {path!r}, which is not a module of the network{hint}"
            )
    return PathPin(frozenset(paths))


def check_list(argument: str, items: object, *, modules_only: bool) -> list[Any]:
    """Validate a custom list: a ``list`` of module classes (and, unless
    ``modules_only``, functions)."""
    if not isinstance(items, list):
        raise TypeError(f"{argument} must be a list; got {type(items).__name__}: {items!r}")
    allowed = "nn.Module subclasses" if modules_only else "nn.Module subclasses or functions"
    for index, item in enumerate(items):
        if isinstance(item, type):
            if issubclass(item, nn.Module):
                continue
        elif isinstance(item, nn.Module):
            raise TypeError(
                f"{argument}[{index}] must be a class, not an instance: got {item!r}; "
                f"pass {type(item).__name__} itself"
            )
        elif callable(item) and not modules_only:
            continue
        raise TypeError(f"{argument}[{index}] must be one of {allowed}; got {item!r}")
    return items
