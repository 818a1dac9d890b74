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

Gradients are always reduced in float32. Pins (``fp32_modules``, ``low_modules``) make
islands too. ``blocks`` picks extra units (transformer blocks, say) that share their
parent's precision, as FSDP2 users shard them for memory. White-list *functions* called
inside a forward (``F.linear``, ``torch.matmul``) follow their module's precision here:
the O1 and autocast levels decide per module and per op at run time, not from a graph.

The model remembers its level (:func:`sharded_level`); ``build_train_network`` checks
that it is asked for the same one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec.fp8.swap import apply_fp8
from mixprec.policy import lists
from mixprec.policy.levels import Level, Pins, Precision, Recipe, resolve

__all__ = ["ShardedLevel", "fully_shard", "sharded_level"]

_ATTR = "_mixprec_sharded_level"

Blocks = tuple[type[nn.Module], ...] | Callable[[nn.Module, str], bool] | None


@dataclasses.dataclass(frozen=True)
class ShardedLevel:
    """What :func:`fully_shard` made a model compute: the level, the low dtype (None at
    O0) and, for ``auto``, what it chose and why."""

    level: Level
    dtype: torch.dtype | None
    reason: str = ""


def sharded_level(network: nn.Module) -> ShardedLevel | None:
    """The level :func:`fully_shard` gave ``network``, or None."""
    found = network.__dict__.get(_ATTR)
    return found if isinstance(found, ShardedLevel) else None


class _AutocastForward:
    """A forward that runs the module's own under ``torch.autocast`` (set on the instance)."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        self.module = module
        self.device_type = device_type
        self.dtype = dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return type(self.module).forward(self.module, *args, **kwargs)


def _policy(**kwargs: Any) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(reduce_dtype=torch.float32, **kwargs)


def _unit(recipe: Recipe, module: nn.Module, name: str, root_low: bool) -> Any:
    """The policy of ``module`` as a unit of its own, or None when it shares its parent's."""
    low = recipe.dtype
    level = recipe.level
    pin = recipe.pinned(module, name)
    if level is Level.O1:
        if pin is Precision.LOW or (pin is None and isinstance(module, recipe.white_modules)):
            return _policy(param_dtype=low, output_dtype=torch.float32)
        return None
    if not root_low:
        return None
    if recipe.is_fp32_island(module, name):
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
            extra FSDP units in their parent's precision (for memory, as usual with FSDP2).
        fp32_modules / low_modules: pins, as in :func:`mixprec.auto_mixed_precision`.
        fp8 / fp8_filter: fp8 GEMMs for chosen linear layers (:mod:`mixprec.fp8`), swapped in
            place before sharding.
        **fsdp_kwargs: passed to every ``torch.distributed.fsdp.fully_shard`` call
            (``mesh``, ``reshard_after_forward``, ...); not ``mp_policy``.

    Returns:
        ``model``, sharded in place (FSDP2's way); build the optimizer on it afterwards.

    Raises:
        ValueError: an unknown level or dtype, a model already sharded, ``mp_policy``.

    Example:
        >>> model = mixprec.distributed.fully_shard(model, "O2", "bf16")
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> step = mixprec.build_train_network(model, optimizer, loss_fn, "O2", dtype="bf16")
    """
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from mixprec.distributed.replicas import fsdp_of

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if "mp_policy" in fsdp_kwargs:
        raise ValueError(
            "mp_policy is chosen by the level; to set your own, call torch's fully_shard and "
            "build the step at level 'O0'"
        )
    if fsdp_of(model) is not None:
        raise ValueError("model is already sharded by fully_shard: shard the unsharded model")
    recipe = resolve(model, level, dtype, fp32_modules=fp32_modules, low_modules=low_modules)
    model = apply_fp8(model, fp8, filter=fp8_filter, fp32_pin=recipe.fp32_pin, inplace=True)
    root_low = recipe.level in (Level.O2, Level.O3)
    units: list[tuple[nn.Module, Any]] = []
    islands: set[int] = set()
    for name, module in model.named_modules():
        if name == "" or any(id(p) in islands for p in _ancestors(model, name)):
            continue
        policy = _unit(recipe, module, name, root_low)
        if policy is not None:
            islands.add(id(module))
            units.append((module, policy))
        elif _is_block(blocks, module, name):
            units.append((module, _policy(param_dtype=recipe.dtype) if root_low else _policy()))
    for module, policy in reversed(units):  # innermost first, as FSDP2 requires
        torch_fully_shard(module, mp_policy=policy, **fsdp_kwargs)
    if root_low:
        root = _policy(param_dtype=recipe.dtype, output_dtype=torch.float32)
    elif recipe.level is Level.O1:
        root = _policy(output_dtype=torch.float32)
    else:
        root = _policy()
    torch_fully_shard(model, mp_policy=root, **fsdp_kwargs)
    if recipe.level is Level.AUTOCAST:
        model.__dict__["forward"] = _AutocastForward(model, recipe.device_type, recipe.dtype)
    dtype_of = None if recipe.level is Level.O0 else recipe.dtype
    model.__dict__[_ATTR] = ShardedLevel(recipe.level, dtype_of, recipe.reason)
    return model


def _ancestors(model: nn.Module, name: str) -> list[nn.Module]:
    parts = name.split(".")
    found = []
    module = model
    for part in parts[:-1]:
        module = module._modules[part]  # type: ignore[assignment]
        found.append(module)
    return found
