"""The conversion entry points: ``auto_mixed_precision`` and ``custom_mixed_precision``.

Arguments are parsed and validated here, at the edge; inside, code passes
:class:`~mixprec.levels.Level` members, ``torch.dtype`` and a frozen
:class:`~mixprec.levels.Recipe`.
"""

from __future__ import annotations

import difflib
import logging
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec import lists
from mixprec.convert.graph import convert_graph
from mixprec.convert.module_level import convert_module_level
from mixprec.convert.structure import find_converted
from mixprec.dtypes import device_of, dtype_name, resolve_dtype, warn_if_slow
from mixprec.levels import Level, ModulePin, PathPin, Recipe, make_recipe, recommend

__all__ = ["auto_mixed_precision", "custom_mixed_precision", "get_black_list", "get_white_list"]

logger = logging.getLogger("mixprec")

Pins = Iterable[str] | ModulePin | None


def get_white_list() -> list[type[nn.Module] | Callable[..., object]]:
    """A copy of the default O1 white list: module classes, then functions.

    Changing the returned list changes nothing in mixprec.

    Example:
        >>> torch.nn.Linear in mixprec.get_white_list()
        True
    """
    return [*lists.WHITE_MODULES, *lists.WHITE_FUNCTIONS]


def get_black_list() -> list[type[nn.Module]]:
    """A copy of the default O2 black list (normalisation module classes).

    Example:
        >>> torch.nn.BatchNorm2d in mixprec.get_black_list()
        True
    """
    return list(lists.BLACK_MODULES)


def _check_network(network: object) -> nn.Module:
    if not isinstance(network, nn.Module):
        raise TypeError(
            f"network must be a torch.nn.Module; got {type(network).__name__}: {network!r}"
        )
    converted = list(find_converted(network))
    if converted:
        where = "the network itself" if "" in converted else f"its submodule {converted[0]!r}"
        raise ValueError(
            f"network is already converted by mixprec ({where}); converting again would cast twice. "
            "Convert the original (unconverted) module instead."
        )
    return network


def _pin(argument: str, pins: Pins, network: nn.Module) -> ModulePin | None:
    """Validate a pin: qualified module names, or a ``(module, name) -> bool`` filter."""
    if pins is None:
        return None
    if callable(pins):
        return pins
    if isinstance(pins, str) or not isinstance(pins, Iterable):
        raise TypeError(
            f"{argument} must be a list of qualified module names or a function (module, name) -> bool; "
            f"got {pins!r}"
        )
    names = dict(network.named_modules())
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


def auto_mixed_precision(
    network: nn.Module,
    amp_level: str | Level = "O0",
    dtype: torch.dtype | str | None = None,
    *,
    fp32_modules: Pins = None,
    low_modules: Pins = None,
    lint: bool = False,
) -> nn.Module:
    """Convert a model to a mixed-precision level.

    Args:
        network: the model; it is not modified, and the result shares its Parameters.
        amp_level: ``"O0"`` (unchanged), ``"O1"`` (white-list ops low, the rest float32),
            ``"O2"`` (everything low but the black-list norms), ``"O3"`` (everything low),
            ``"autocast"`` (per-op lists, decided ahead of time, like ``torch.autocast``)
            or ``"auto"`` (the recommendation for the model's device).
        dtype: ``torch.float16``/``torch.bfloat16`` or ``"fp16"``, ``"bf16"``, ...;
            None for the device's usual low-precision type.
        fp32_modules: modules to keep in float32 whatever the lists say: qualified names
            or a filter ``(module, qualified_name) -> bool``.
        low_modules: modules to run in low precision whatever the lists say.
        lint: run :func:`mixprec.lint` on the model at this level and warn about each
            finding (constants and norm eps that do not fit the dtype).

    Returns:
        The converted model (the network itself for O0). O1 and autocast give a
        ``GraphModule`` whose code shows the casts; O2 and O3 a module of the original's
        class. :func:`mixprec.explain` gives its cast plan.

    Raises:
        TypeError: ``network`` is not a module; a pin is malformed.
        ValueError: unknown level or dtype; a converted network; a pin naming no module.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        >>> fast = mixprec.auto_mixed_precision(model, "O2", "bf16")
        >>> fast(torch.randn(2, 8)).dtype
        torch.float32
    """
    network = _check_network(network)
    level = Level.parse(amp_level)
    low = None if dtype is None else resolve_dtype(dtype)
    device = device_of(network)
    if level is Level.AUTO:
        level, low, _ = recommend(device, low)
    if level is Level.O0:
        return network
    recipe = make_recipe(
        level,
        low if low is not None else resolve_dtype(None, device),
        device,
        low_pin=_pin("low_modules", low_modules, network),
        fp32_pin=_pin("fp32_modules", fp32_modules, network),
    )
    if lint:
        _warn_lint(network, recipe, fp32_modules)
    return convert(network, recipe)


def _warn_lint(network: nn.Module, recipe: Recipe, fp32_modules: Pins) -> None:
    from mixprec.diagnose.lint import lint

    report = lint(network, level=recipe.level, dtype=recipe.dtype, fp32_modules=fp32_modules)
    for finding in report:
        warnings.warn(f"mixprec lint: {finding}", stacklevel=3)


def convert(network: nn.Module, recipe: Recipe) -> nn.Module:
    """Convert ``network`` by an already-built recipe (warns once per process when the
    device runs the recipe's dtype slowly)."""
    if recipe.level is not Level.O0:
        warn_if_slow(recipe.dtype, device_of(network))
    if recipe.level in (Level.O2, Level.O3):
        return convert_module_level(network, recipe)
    if recipe.level in (Level.O1, Level.AUTOCAST):
        return convert_graph(network, recipe)
    return network


def _check_list(argument: str, items: object, *, modules_only: bool) -> list[Any]:
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


def custom_mixed_precision(
    network: nn.Module,
    *,
    white_list: Sequence[type[nn.Module] | Callable[..., object]] | None = None,
    black_list: Sequence[type[nn.Module]] | None = None,
    dtype: torch.dtype | str | None = None,
    fp32_modules: Pins = None,
    low_modules: Pins = None,
) -> nn.Module:
    """Convert with your own list: exactly one of ``white_list`` or ``black_list``.

    A white list (module classes and functions) takes the O1 path with that list; a black
    list (module classes) takes the O2 path with that list. Pins work as in
    :func:`auto_mixed_precision` and beat the list.

    Raises:
        TypeError: a list that is not a ``list`` or holds something other than classes
            (and, for a white list, functions).
        ValueError: both lists or neither.

    Example:
        >>> net = mixprec.custom_mixed_precision(model, white_list=[torch.nn.Linear, torch.matmul])
    """
    network = _check_network(network)
    if (white_list is None) == (black_list is None):
        given = "both" if white_list is not None else "neither"
        raise ValueError(
            f"custom_mixed_precision takes exactly one of white_list or black_list; got {given} "
            f"(white_list={white_list!r}, black_list={black_list!r})"
        )
    device = device_of(network)
    low = resolve_dtype(dtype, device)
    low_pin = _pin("low_modules", low_modules, network)
    fp32_pin = _pin("fp32_modules", fp32_modules, network)
    if white_list is not None:
        items = _check_list("white_list", white_list, modules_only=False)
        recipe = make_recipe(
            Level.O1, low, device, white_list=items, low_pin=low_pin, fp32_pin=fp32_pin
        )
    else:
        items = _check_list("black_list", black_list, modules_only=True)
        left_out = [cls.__name__ for cls in lists.BLACK_MODULES if cls not in items]
        if left_out:
            logger.warning(
                "black_list leaves out built-in black-list entries %s: they will run in %s",
                ", ".join(left_out),
                dtype_name(low),
            )
        recipe = make_recipe(
            Level.O2, low, device, black_list=items, low_pin=low_pin, fp32_pin=fp32_pin
        )
    return convert(network, recipe)
