"""FSDP2 at every level: ``fully_shard`` with one ``MixedPrecisionPolicy`` per module.

FSDP2 owns a sharded model's Parameters: it gathers them before each unit's forward and
swaps them into the modules itself, so a copy that casts them at use (mixprec's
conversion) would never see them. Under FSDP2 the casting is FSDP2's job, and
:func:`fully_shard` tells it what each level means, by making the modules whose precision
differs from their parent's FSDP units of their own:

===========  ===================================================================
level        units and their ``MixedPrecisionPolicy``
===========  ===================================================================
O0           the root: float32
O1           each white-list module (Linear, Conv, RNN cells, ...): low Parameters,
             inputs cast down, outputs back to float32; the rest float32
O2           the root: low Parameters (gathered in the low dtype: half the traffic),
             float32 outputs; each norm (the black list) a float32 island: inputs
             cast up, outputs back down
O3           the root low; batch norms keep float32 weights (their kernels take a
             low input), as mixprec's O3 does
autocast     float32 Parameters, the root's forward runs under ``torch.autocast``
===========  ===================================================================

Gradients are always reduced in float32. Pins (``fp32_modules``, ``low_modules``) and
``keep_batchnorm_fp32`` make islands too. ``blocks`` picks extra units (transformer
blocks, say) that share their parent's precision, as FSDP2 users shard them for memory.
At O1 a block is one unit gathered in the low dtype: its white-list modules cast their
inputs down and their outputs back to float32 (hooks), and its other modules that hold
Parameters (norms, say) become float32 units inside it, so a 32-layer Llama makes 3 units
per layer (the block and its two norms), not 7. White-list *functions* called inside a
forward (``F.linear``, ``torch.matmul``) follow their module's precision here: the O1 and
autocast levels decide per module and per op at run time, not from a graph.

Gradient accumulation: by default every micro-batch reduce-scatters its gradients, so a
rank holds only its shard of the gradients between micro-batches (FSDP's point).
``sync_every_micro_batch=False`` reduces on the last micro-batch only: one reduce-scatter
per optimizer step, but every rank keeps the unsharded float32 gradients of the whole
model between micro-batches (world size times the sharded gradients).

The model remembers its level (:func:`sharded_level`); ``build_train_network`` checks
that it is asked for the same one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from mixprec._check import require_module
from mixprec.convert.structure import HookedCall, set_forward, user_class
from mixprec.fp8.swap import apply_fp8
from mixprec.policy import lists
from mixprec.policy.dtypes import dtype_name
from mixprec.policy.levels import Level, Pins, Precision, Recipe, resolve

__all__ = [
    "ShardedLevel",
    "check_sharded_step",
    "fully_shard",
    "refuse_sharded",
    "sharded_level",
]

_ATTR = "_mixprec_sharded_level"

Blocks = tuple[type[nn.Module], ...] | Callable[[nn.Module, str], bool] | None


@dataclasses.dataclass(frozen=True)
class ShardedLevel:
    """What :func:`fully_shard` made a model compute: the level, the low dtype (None at
    O0) and, for ``auto``, what it chose and why."""

    level: Level
    dtype: torch.dtype | None
    reason: str = ""
    #: whether gradient accumulation reduce-scatters every micro-batch (see the module doc)
    sync_every_micro_batch: bool = True
    #: the conversion options it was sharded with (the step must be built with the same)
    options: tuple[tuple[str, object], ...] = ()


def sharded_level(network: nn.Module) -> ShardedLevel | None:
    """The level :func:`fully_shard` gave ``network``, or None."""
    found = network.__dict__.get(_ATTR)
    return found if isinstance(found, ShardedLevel) else None


class _AutocastForward(HookedCall):
    """A forward that runs the module's own under ``torch.autocast`` (set on the instance)."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        self.module = module
        self.device_type = device_type
        self.dtype = dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return user_class(self.module).forward(self.module, *args, **kwargs)


def _policy(**kwargs: Any) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(reduce_dtype=torch.float32, **kwargs)


def _is_white(recipe: Recipe, module: nn.Module, name: str) -> bool:
    return recipe.module_precision(module, name) is Precision.LOW


def _unit(recipe: Recipe, module: nn.Module, name: str, root_low: bool) -> Any:
    """The policy of ``module`` as a unit of its own, or None when it shares its parent's."""
    low = recipe.dtype
    level = recipe.level
    pin = recipe.pinned(module, name)
    if level is Level.O1:
        if _is_white(recipe, module, name):
            return _policy(param_dtype=low, output_dtype=torch.float32)
        return None
    if not root_low:
        return None
    if recipe.module_precision(module, name, Precision.LOW) is Precision.FP32:
        return _policy(param_dtype=torch.float32, output_dtype=low)
    if pin is None and isinstance(module, lists.FP32_STATE_MODULES):
        return _policy(cast_forward_inputs=False)  # float32 weights, a low input
    return None


def _is_block(blocks: Blocks, module: nn.Module, name: str) -> bool:
    if blocks is None:
        return False
    if isinstance(blocks, tuple):
        return isinstance(module, blocks)
    return bool(blocks(module, name))


def fully_shard(
    model: nn.Module,
    level: str | Level = "O2",
    dtype: torch.dtype | str | None = None,
    *,
    blocks: Blocks = None,
    fp32_modules: Pins = None,
    low_modules: Pins = None,
    keep_batchnorm_fp32: bool | None = None,
    sync_every_micro_batch: bool = True,
    fp8: str | None = None,
    fp8_filter: Callable[[nn.Module, str], bool] | None = None,
    **fsdp_kwargs: Any,
) -> nn.Module:
    """Shard ``model`` with FSDP2 so that it computes at ``level``.

    Args:
        model: a float32 model, not yet sharded (each rank builds the same one).
        level: "O0", "O1", "O2", "O3", "autocast" or "auto".
        dtype: the low dtype (default: the device's usual one).
        blocks: module classes (a tuple) or a filter ``(module, qualified_name) -> bool``:
            extra FSDP units (for memory, as usual with FSDP2); at O1 each block is one
            unit gathered low (see the module docstring).
        fp32_modules / low_modules: pins, as in :func:`mixprec.auto_mixed_precision`.
        keep_batchnorm_fp32: as in :func:`mixprec.build_train_network`.
        sync_every_micro_batch: under gradient accumulation, reduce-scatter every
            micro-batch (sharded gradients only; the default) or only the last one
            (one reduce-scatter per step, unsharded float32 gradients kept meanwhile).
        fp8 / fp8_filter: fp8 GEMMs for chosen linear layers (:mod:`mixprec.fp8`), swapped in
            place before sharding.
        **fsdp_kwargs: passed to every ``torch.distributed.fsdp.fully_shard`` call
            (``mesh``, ``reshard_after_forward``, ...); not ``mp_policy``.

    Returns:
        ``model``, sharded in place (FSDP2's way); build the optimizer on it afterwards.

    Raises:
        TypeError: a malformed argument.
        ValueError: an unknown level or dtype, a model already sharded, ``mp_policy``.

    Example:
        >>> model = mixprec.distributed.fully_shard(model, "O2", "bf16")
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> step = mixprec.build_train_network(model, optimizer, loss_fn, "O2", dtype="bf16")
    """
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from mixprec.distributed.replicas import fsdp_of

    require_module(model, "model")
    if not isinstance(sync_every_micro_batch, bool):
        raise TypeError(f"sync_every_micro_batch must be a bool; got {sync_every_micro_batch!r}")
    if keep_batchnorm_fp32 is not None and not isinstance(keep_batchnorm_fp32, bool):
        raise TypeError(f"keep_batchnorm_fp32 must be a bool or None; got {keep_batchnorm_fp32!r}")
    if "mp_policy" in fsdp_kwargs:
        raise ValueError(
            "mp_policy is chosen by the level; to set your own, call torch's fully_shard and "
            "build the step at level 'O0'"
        )
    if fsdp_of(model) is not None:
        raise ValueError("model is already sharded by fully_shard: shard the unsharded model")
    recipe = resolve(
        model,
        level,
        dtype,
        fp32_modules=fp32_modules,
        low_modules=low_modules,
        keep_batchnorm_fp32=keep_batchnorm_fp32,
    )
    model = apply_fp8(model, fp8, filter=fp8_filter, fp32_pin=recipe.fp32_pin, inplace=True)
    for module, policy in reversed(_units(model, recipe, blocks)):  # innermost first
        torch_fully_shard(module, mp_policy=policy, **fsdp_kwargs)
    if recipe.level in (Level.O2, Level.O3):
        root = _policy(param_dtype=recipe.dtype, output_dtype=torch.float32)
    elif recipe.level is Level.O1:
        root = _policy(output_dtype=torch.float32)
    else:
        root = _policy()
    torch_fully_shard(model, mp_policy=root, **fsdp_kwargs)
    if recipe.level is Level.AUTOCAST:
        set_forward(model, _AutocastForward(model, recipe.device_type, recipe.dtype))
    dtype_of = None if recipe.level is Level.O0 else recipe.dtype
    options = (
        ("fp32_modules", fp32_modules),
        ("low_modules", low_modules),
        ("keep_batchnorm_fp32", keep_batchnorm_fp32),
    )
    model.__dict__[_ATTR] = ShardedLevel(
        recipe.level, dtype_of, recipe.reason, sync_every_micro_batch, options
    )
    return model


def _units(model: nn.Module, recipe: Recipe, blocks: Blocks) -> list[tuple[nn.Module, Any]]:
    """The FSDP units below the root and their policies, outermost first."""
    root_low = recipe.level in (Level.O2, Level.O3)
    units: list[tuple[nn.Module, Any]] = []
    decided: set[int] = set()  # units whose policy covers their whole subtree
    for name, module in model.named_modules():
        if name == "" or any(id(p) in decided for p in _ancestors(model, name)):
            continue
        block = _is_block(blocks, module, name)
        own = next(module.parameters(recurse=False), None) is not None
        if recipe.level is Level.O1 and block and not own and not _is_white(recipe, module, name):
            decided.add(id(module))
            low = _policy(
                param_dtype=recipe.dtype, output_dtype=torch.float32, cast_forward_inputs=False
            )
            units.append((module, low))
            _o1_block(recipe, module, name, False, units)
            continue
        policy = _unit(recipe, module, name, root_low)
        if policy is not None:
            decided.add(id(module))
            units.append((module, policy))
        elif block:
            units.append((module, _policy(param_dtype=recipe.dtype) if root_low else _policy()))
    return units


def _o1_block(
    recipe: Recipe,
    module: nn.Module,
    prefix: str,
    in_fp32: bool,
    units: list[tuple[nn.Module, Any]],
) -> None:
    """Inside an O1 block gathered low: white-list modules cast at their boundaries, other
    modules holding Parameters become float32 units (white-list ones inside those, low units)."""
    for child_name, child in module.named_children():
        name = f"{prefix}.{child_name}"
        if _is_white(recipe, child, name):
            if in_fp32:
                units.append((child, _policy(param_dtype=recipe.dtype, output_dtype=torch.float32)))
            else:
                child.register_forward_pre_hook(_Cast(recipe.dtype))
                child.register_forward_hook(_CastOutput())
            continue
        own = next(child.parameters(recurse=False), None) is not None
        if own and not in_fp32:
            units.append((child, _policy(output_dtype=torch.float32)))
        _o1_block(recipe, child, name, in_fp32 or own, units)


class _Cast:
    """A forward pre-hook casting floating inputs to ``dtype``."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> Any:
        return tree_map(lambda t: _cast(t, self.dtype), args)


class _CastOutput:
    """A forward hook casting floating outputs back to float32."""

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        return tree_map(lambda t: _cast(t, torch.float32), output)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


def _ancestors(model: nn.Module, name: str) -> list[nn.Module]:
    parts = name.split(".")
    found = []
    module = model
    for part in parts[:-1]:
        module = module._modules[part]  # type: ignore[assignment]
        found.append(module)
    return found


def check_sharded_step(
    network: nn.Module,
    level: Level,
    dtype: torch.dtype | None,
    *,
    emulate: bool,
    options: Mapping[str, object],
) -> None:
    """Refuse a step on an FSDP2 model that would not compute as asked (before it runs).

    ``options`` are the step's conversion options (``fp32_modules``, ``low_modules``,
    ``keep_batchnorm_fp32``); under FSDP2 they are :func:`fully_shard`'s to apply, so the
    step accepts them only as the model was sharded with (or left out).

    Raises:
        ValueError: a model sharded by torch's ``fully_shard`` above O0; a level, dtype or
            option that differs from the one the model was sharded with; ``emulate=True``.
    """
    shard = sharded_level(network)
    low = "" if dtype is None else f", {dtype_name(dtype)!r}"
    if shard is None and level is not Level.O0:
        raise ValueError(
            f"level {level.value!r} on a model sharded by torch's fully_shard: FSDP2 "
            "gathers and swaps in the Parameters itself, so mixprec cannot cast them at use. "
            f"Shard with mixprec.distributed.fully_shard(model, {level.value!r}{low}) "
            "(FSDP2 then casts per module as the level says), or keep your own "
            "MixedPrecisionPolicy and build the step at level 'O0'"
        )
    if shard is not None and (shard.level, shard.dtype) != (level, dtype):
        raise ValueError(
            f"the model was sharded at level {shard.level.value!r} ({shard.dtype}) by "
            f"mixprec.distributed.fully_shard; build the step at the same level and dtype, not "
            f"{level.value!r} ({dtype})"
        )
    if emulate:
        raise ValueError(
            "emulate=True under FSDP2: FSDP2 gathers the Parameters in the low dtype and runs "
            "the modules' own kernels, so there is no cast-at-use copy to emulate; leave "
            "emulate out (check the level's numerics on one process with emulate=True)"
        )
    sharded = dict(shard.options) if shard is not None else {}
    for name, value in options.items():
        if value is None or value == sharded.get(name):
            continue
        raise ValueError(
            f"{name}={value!r} under FSDP2: the model's precision was fixed when it was "
            f"sharded ({name}={sharded.get(name)!r}); pass {name} to "
            "mixprec.distributed.fully_shard instead, or leave it out here"
        )


def refuse_sharded(network: nn.Module) -> None:
    """Conversion cannot cast what FSDP2 swaps in: a clear error instead of a DTensor one.

    Raises:
        ValueError: ``network`` (or a module in it) is sharded by FSDP2's ``fully_shard``.
    """
    from mixprec.distributed.replicas import fsdp_of

    if fsdp_of(network) is not None:
        raise ValueError(
            "network is sharded by FSDP2's fully_shard: FSDP2 gathers and swaps in the "
            "Parameters at each forward, so mixprec cannot convert it. Shard the float32 model "
            "with mixprec.distributed.fully_shard(model, level, dtype) instead (FSDP2 then "
            "casts per module as the level says) and build the step on it"
        )
