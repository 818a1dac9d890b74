"""The conversion entry points: ``auto_mixed_precision`` and ``custom_mixed_precision``.

Arguments are parsed and validated here, at the edge; inside, code passes
:class:`~mixprec.policy.levels.Level` members, ``torch.dtype`` and a frozen
:class:`~mixprec.policy.levels.Recipe`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from mixprec._check import require_module
from mixprec._warn import warn
from mixprec.convert.autocast import convert_autocast, convert_o1
from mixprec.convert.declared import with_declared_pins
from mixprec.convert.emulate import install_emulation
from mixprec.convert.module_level import convert_module_level
from mixprec.convert.structure import find_converted
from mixprec.distributed.shard import refuse_sharded
from mixprec.fp8.swap import apply_fp8
from mixprec.policy import lists
from mixprec.policy.dtypes import device_of, dtype_name, warn_if_slow
from mixprec.policy.levels import Level, Pins, Recipe, check_list, resolve
from mixprec.policy.ops import op_key

__all__ = ["auto_mixed_precision", "custom_mixed_precision", "get_black_list", "get_white_list"]

logger = logging.getLogger("mixprec")


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


def check_network(network: object, level: Level = Level.O0) -> nn.Module:
    """``network`` as a module that ``level`` can convert: not converted already, and (for
    a level other than O0) without float16/bfloat16 parameters, which its float32 parts
    could not run with."""
    network = require_module(network)
    converted = list(find_converted(network))
    if converted:
        where = "the network itself" if "" in converted else f"its submodule {converted[0]!r}"
        raise ValueError(
            f"network is already converted by mixprec ({where}); converting again would cast twice. "
            "Convert the original (unconverted) module instead."
        )
    if level is not Level.O0:
        lazy = [
            name or "(the network itself)"
            for name, module in network.named_modules()
            if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params()  # type: ignore[misc]
        ]
        if lazy:
            raise ValueError(
                f"network holds lazy modules whose parameters are not initialized yet "
                f"({', '.join(repr(n) for n in lazy[:4])}{', ...' if len(lazy) > 4 else ''}): "
                "their first call creates their weights and changes their class, which a "
                f"model converted at level {level.value!r} (a copy with classes of its own) "
                "cannot follow. Run one forward of the model on an example batch before "
                "converting (it initializes them), as DDP and optimizers need too"
            )
        for name, p in network.named_parameters():
            if p.dtype in (torch.float16, torch.bfloat16):
                raise ValueError(
                    f"network holds {p.dtype} parameters (e.g. {name!r}); level "
                    f"{level.value!r} converts a float32 model (its float32 parts would fail "
                    "at the first call). Convert the float32 model (model.float()), or use "
                    "level 'O0' to run it as it is"
                )
    return network


def auto_mixed_precision(
    network: nn.Module,
    amp_level: str | Level = "O0",
    dtype: torch.dtype | str | None = None,
    *,
    fp32_modules: Pins = None,
    low_modules: Pins = None,
    lint: bool = False,
    emulate: bool = False,
    declared_fp32: bool = True,
    fp8: str | None = None,
    fp8_filter: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Convert a model to a mixed-precision level.

    Args:
        network: the model; it is not modified, and the result shares its Parameters.
        amp_level: ``"O0"`` (unchanged), ``"O1"`` (white-list ops low, the rest float32),
            ``"O2"`` (everything low but the black-list norms), ``"O3"`` (everything low),
            ``"autocast"`` (your code under ``torch.autocast``, pins kept)
            or ``"auto"`` (the recommendation for the model's device).
        dtype: ``torch.float16``/``torch.bfloat16`` or ``"fp16"``, ``"bf16"``, ...;
            None for the device's usual low-precision type.
        fp32_modules: modules to keep in float32 whatever the lists say: qualified names
            or a filter ``(module, qualified_name) -> bool``.
        low_modules: modules to run in low precision whatever the lists say.
        lint: run :func:`mixprec.lint` on the model at this level and warn about each
            finding (constants and norm eps that do not fit the dtype; the weights fp8 hurts).
        emulate: compute the low-precision matmuls, convolutions and attention with float32
            kernels on the rounded inputs, rounding each result (and gradient) to the low
            dtype: the level's numerics at float32 speed on a machine without native
            low precision (see :mod:`mixprec.convert.emulate`). No effect at O0.
        declared_fp32: keep the modules the model declares float32 (transformers'
            ``_keep_in_fp32_modules(_strict)``, see :mod:`mixprec.convert.declared`) in float32.
        fp8: ``"tensorwise"``, ``"rowwise"`` or ``"rowwise_with_gw_hp"``: the GEMMs of the
            chosen linear layers run in fp8 with that recipe, at any level (see
            :mod:`mixprec.fp8`): natively on a CUDA GPU with fp8, emulated elsewhere or
            with ``emulate``.
        fp8_filter: ``(module, qualified_name) -> bool``, the linear layers to put in fp8
            (default: dims multiples of 16, not the first and last); fp32 pins win.

    Returns:
        The converted model (the network itself for O0): a module of the original's
        class sharing its Parameters, with its hooks, methods and modes; each module's
        ``forward`` says how it runs. :func:`mixprec.explain` gives the cast plan.

    Raises:
        TypeError: ``network`` is not a module; a pin is malformed.
        ValueError: unknown level or dtype; a converted network; a pin naming no module; a
            model with float16 or bfloat16 parameters (at a level other than O0).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        >>> fast = mixprec.auto_mixed_precision(model, "O2", "bf16")
        >>> fast(torch.randn(2, 8)).dtype
        torch.float32
    """
    network = check_network(network)
    check_emulate(emulate)
    if not isinstance(lint, bool):
        raise TypeError(f"lint must be a bool (True or False); got {lint!r}")
    recipe = resolve(network, amp_level, dtype, fp32_modules=fp32_modules, low_modules=low_modules)
    if lint and (recipe.level is not Level.O0 or fp8 is not None):
        _warn_lint(network, recipe, fp32_modules, fp8, fp8_filter)
    network = apply_fp8(
        network, fp8, filter=fp8_filter, fp32_pin=recipe.fp32_pin, emulate=emulate or None
    )
    return convert(network, recipe, emulate=emulate, declared_fp32=declared_fp32)


def _warn_lint(
    network: nn.Module,
    recipe: Recipe,
    fp32_modules: Pins,
    fp8: str | None,
    fp8_filter: Callable[[nn.Module, str], bool] | None,
) -> None:
    from mixprec.diagnose.lint import lint

    report = lint(
        network,
        level=recipe.level,
        dtype=recipe.dtype,
        fp32_modules=fp32_modules,
        fp8=fp8,
        fp8_filter=fp8_filter,
    )
    for finding in report:
        warn(f"mixprec lint: {finding}")


def check_emulate(emulate: object) -> bool:
    """``emulate`` must be a bool (a TypeError names the value otherwise)."""
    if not isinstance(emulate, bool):
        raise TypeError(f"emulate must be a bool (True or False); got {emulate!r}")
    return emulate


def convert(
    network: nn.Module, recipe: Recipe, *, emulate: bool = False, declared_fp32: bool = True
) -> nn.Module:
    """The one front door of conversion: ``network`` converted by a resolved policy.

    Every entry point (``auto_mixed_precision``, ``custom_mixed_precision``,
    ``build_train_network``, the diagnostics) comes through here, so every one refuses an
    already-converted network and warns (once) when the device runs the dtype slowly
    (not when it is emulated: emulation runs at float32 speed). With ``emulate`` the
    converted model's low-precision GEMMs run emulated (:mod:`mixprec.convert.emulate`).

    Raises:
        TypeError: ``network`` is not a module.
        ValueError: ``network`` (or a submodule) is already converted; it holds float16 or
            bfloat16 parameters (at a level other than O0); it is sharded by FSDP2.
    """
    network = check_network(network, recipe.level)
    check_emulate(emulate)
    if recipe.level is Level.O0:
        return network
    refuse_sharded(network)
    if not isinstance(declared_fp32, bool):
        raise TypeError(f"declared_fp32 must be a bool (True or False); got {declared_fp32!r}")
    if declared_fp32:
        recipe = with_declared_pins(network, recipe)
    if not emulate:
        warn_if_slow(recipe.dtype, device_of(network))
    if recipe.level in (Level.O2, Level.O3):
        converted = convert_module_level(network, recipe)
    elif recipe.level is Level.AUTOCAST:
        converted = convert_autocast(network, recipe)
    else:
        converted = convert_o1(network, recipe)
    return install_emulation(converted, recipe.dtype) if emulate else converted


def custom_mixed_precision(
    network: nn.Module,
    *,
    white_list: Sequence[type[nn.Module] | Callable[..., object]] | None = None,
    black_list: Sequence[type[nn.Module]] | None = None,
    dtype: torch.dtype | str | None = None,
    fp32_modules: Pins = None,
    low_modules: Pins = None,
    emulate: bool = False,
    declared_fp32: bool = True,
) -> nn.Module:
    """Convert with your own list: exactly one of ``white_list`` or ``black_list``.

    A white list (module classes and functions) takes the O1 path with that list; a black
    list (module classes) takes the O2 path with that list. Pins, ``emulate`` and
    ``declared_fp32`` work as
    in :func:`auto_mixed_precision`; pins beat the list.

    Raises:
        TypeError: a list that is not a ``list`` or holds something other than classes
            (and, for a white list, functions).
        ValueError: both lists or neither.

    Example:
        >>> net = mixprec.custom_mixed_precision(model, white_list=[torch.nn.Linear, torch.matmul])
    """
    network = check_network(network)
    check_emulate(emulate)
    if (white_list is None) == (black_list is None):
        given = "both" if white_list is not None else "neither"
        raise ValueError(
            f"custom_mixed_precision takes exactly one of white_list or black_list; got {given} "
            f"(white_list={white_list!r}, black_list={black_list!r})"
        )
    if white_list is not None:
        items = check_list("white_list", white_list, modules_only=False)
        _refuse_own_functions(items)
        recipe = resolve(
            network,
            Level.O1,
            dtype,
            white_list=items,
            fp32_modules=fp32_modules,
            low_modules=low_modules,
        )
    else:
        items = check_list("black_list", black_list, modules_only=True)
        recipe = resolve(
            network,
            Level.O2,
            dtype,
            black_list=items,
            fp32_modules=fp32_modules,
            low_modules=low_modules,
        )
        left_out = [cls.__name__ for cls in lists.BLACK_MODULES if cls not in items]
        if left_out:
            logger.warning(
                "black_list leaves out built-in black-list entries %s: they will run in %s",
                ", ".join(left_out),
                dtype_name(recipe.dtype),
            )
    return convert(network, recipe, emulate=emulate, declared_fp32=declared_fp32)


def _refuse_own_functions(items: Sequence[object]) -> None:
    """O1 runs the model's code as written and applies its list to the torch functions
    it calls: a function of the user's own is not one, so no call of it could be seen."""
    for item in items:
        if not isinstance(item, type) and not isinstance(op_key(item), str):  # type: ignore[arg-type]
            name = getattr(item, "__qualname__", repr(item))
            raise ValueError(
                f"white_list holds {name}, a function of your own: O1 applies its list to "
                "the torch functions your code calls, which cannot see a call of it. List the "
                "torch functions it calls, or a module class that calls it (the module then "
                "runs whole in low precision)"
            )
