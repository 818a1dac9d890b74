"""``build_train_network``: a level and options become a configured training step.

The keyword arguments are resolved against the level's defaults (DESIGN.md section 4) into
a frozen :class:`TrainConfig`; the network is converted; with low-precision Parameters the
float32 masters are installed; a fresh loss-scale manager is made. The step itself is
:class:`mixprec.train.TrainStep`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from mixprec import lists
from mixprec.convert.api import convert
from mixprec.distributed import ddp_of
from mixprec.dtypes import device_of, resolve_dtype
from mixprec.levels import Level, make_recipe, recommend
from mixprec.master import MasterWeights
from mixprec.scaling import DynamicLossScaleManager, LossScaleManager
from mixprec.train import TrainConfig, TrainStep

__all__ = ["build_train_network"]

_OPTIONS = (
    "dtype",
    "cast_model_type",
    "keep_batchnorm_fp32",
    "loss_scale_manager",
    "master_weights",
    "accumulation_steps",
    "clip_grad_norm",
)


@dataclasses.dataclass(frozen=True)
class ClassPin:
    """Pins modules of the given classes (a picklable pin)."""

    classes: tuple[type[nn.Module], ...]

    def __call__(self, module: nn.Module, name: str) -> bool:
        return isinstance(module, self.classes)


def _option(kwargs: Mapping[str, Any], key: str, default: Any) -> Any:
    value = kwargs.get(key)
    return default if value is None else value


def _parse_cast_model_type(value: object) -> torch.dtype:
    if value in (torch.float32, "fp32", "float32"):
        return torch.float32
    try:
        return resolve_dtype(value)
    except ValueError:
        raise ValueError(
            "cast_model_type must be torch.float32 ('fp32', 'float32') or a low-precision dtype "
            f"(torch.bfloat16, torch.float16, 'bf16', 'fp16', ...); got {value!r}"
        ) from None


def _resolve(
    network: nn.Module, level: Level, kwargs: Mapping[str, Any], distributed: bool
) -> TrainConfig:
    device = device_of(network)
    low = None if kwargs.get("dtype") is None else resolve_dtype(kwargs["dtype"])
    reason = ""
    if level is Level.AUTO:
        level, low, reason = recommend(device, low)
    if level is Level.O0:
        low = None
    elif low is None:
        low = resolve_dtype(None, device)
    module_level = level in (Level.O2, Level.O3)

    cast_model_type = torch.float32
    if kwargs.get("cast_model_type") is not None:
        given = kwargs["cast_model_type"]
        cast_model_type = _parse_cast_model_type(given)
        if cast_model_type != torch.float32 and (not module_level or cast_model_type != low):
            raise ValueError(
                f"cast_model_type={given!r} does not fit level {level.value!r} with dtype {low}: "
                "low-precision parameters go with O2/O3 in their dtype; otherwise use torch.float32"
            )
    elif module_level and not distributed and low is not None:
        cast_model_type = low  # the model holds low-precision Parameters (O2/O3 default)

    keep_bn = _option(kwargs, "keep_batchnorm_fp32", level is Level.O2)
    if not isinstance(keep_bn, bool):
        raise TypeError(f"keep_batchnorm_fp32 must be a bool; got {keep_bn!r}")
    master = _option(kwargs, "master_weights", cast_model_type != torch.float32)
    if not isinstance(master, bool):
        raise TypeError(f"master_weights must be a bool; got {master!r}")
    if master and cast_model_type == torch.float32:
        raise ValueError(
            f"master_weights=True needs low-precision parameters (level O2/O3 with cast_model_type "
            f"{low}); this step keeps float32 parameters"
            + (" because DistributedDataParallel reduces them" if distributed else "")
        )
    steps = _option(kwargs, "accumulation_steps", 1)
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"accumulation_steps must be a positive int; got {steps!r}")
    if steps < 1:
        raise ValueError(f"accumulation_steps must be a positive int; got {steps!r}")
    clip = kwargs.get("clip_grad_norm")
    if clip is not None and (
        isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip <= 0
    ):
        raise ValueError(f"clip_grad_norm must be a positive number or None; got {clip!r}")
    return TrainConfig(
        level,
        low,
        cast_model_type,
        keep_bn,
        master,
        steps,
        None if clip is None else float(clip),
        reason,
    )


def _convert(network: nn.Module, config: TrainConfig) -> nn.Module:
    if config.level is Level.O0 or config.dtype is None:
        return network
    device = device_of(network)
    if config.level in (Level.O2, Level.O3):
        black = list(lists.BLACK_MODULES) if config.keep_batchnorm_fp32 else []
        recipe = make_recipe(Level.O2, config.dtype, device, black_list=black)
        recipe = dataclasses.replace(recipe, level=config.level)
    else:
        pin = ClassPin(lists.BLACK_MODULES) if config.keep_batchnorm_fp32 else None
        recipe = make_recipe(config.level, config.dtype, device, fp32_pin=pin)
    return convert(network, recipe)


def _default_manager(config: TrainConfig) -> LossScaleManager | None:
    """float16 gradients underflow without loss scaling at every level that computes in
    float16; bfloat16 has float32's range and needs none."""
    if config.dtype == torch.float16:
        return DynamicLossScaleManager()
    return None


def build_train_network(
    network: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    level: str | Level = "O0",
    boost_level: str = "O0",
    **kwargs: Any,
) -> TrainStep:
    """Build a mixed-precision training step.

    Args:
        network: the model (or a ``DistributedDataParallel`` around it). Not modified;
            the step trains its Parameters.
        optimizer: a ``torch.optim`` optimizer built on ``network``'s parameters.
        loss_fn: ``loss_fn(output, label)``; None when the network returns its loss.
        level: "O0", "O1", "O2", "O3", "autocast" or "auto" (the device's recommendation).
        boost_level: MindSpore's boost level; only "O0" (no boost) is supported.
        **kwargs: ``dtype``; ``cast_model_type`` (the dtype of the model's Parameters:
            float32 = cast at use, the low dtype = low-precision Parameters); ``keep_batchnorm_fp32``;
            ``loss_scale_manager`` (default: dynamic for float16, none for bfloat16);
            ``master_weights`` (float32 masters for low-precision Parameters; default on);
            ``accumulation_steps`` (calls per optimizer step); ``clip_grad_norm``
            (max norm of the unscaled gradients).

    Returns:
        A :class:`TrainStep`: ``loss = step(*inputs, label)`` (or ``step(*inputs, **kwargs)``
        without ``loss_fn``).

    Raises:
        TypeError: a non-module network, a non-optimizer, a bad option type.
        ValueError: an unknown level, dtype or keyword; conflicting options.

    Example:
        >>> step = mixprec.build_train_network(model, torch.optim.AdamW(model.parameters()),
        ...                                    torch.nn.CrossEntropyLoss(), level="O2")
        >>> loss = step(images, labels)
    """
    if not isinstance(network, nn.Module):
        raise TypeError(
            f"network must be a torch.nn.Module; got {type(network).__name__}: {network!r}"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}: {optimizer!r}"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable or None; got {loss_fn!r}")
    unknown = [key for key in kwargs if key not in _OPTIONS]
    if unknown:
        raise ValueError(
            f"Unsupported arg {unknown[0]!r} for build_train_network; allowed: {', '.join(_OPTIONS)}"
        )
    if boost_level != "O0":
        if boost_level in ("O1", "O2"):
            raise NotImplementedError(
                f"boost_level={boost_level!r} (MindSpore's LessBN, GradientFreeze, AdaSum) is not available in mixprec; use 'O0'"
            )
        raise ValueError(f"boost_level must be one of 'O0', 'O1', 'O2'; got {boost_level!r}")
    manager = kwargs.get("loss_scale_manager")
    if manager is not None and not isinstance(manager, LossScaleManager):
        raise TypeError(
            f"loss_scale_manager must be a mixprec.LossScaleManager or None; got {manager!r}"
        )

    ddp = ddp_of(network)
    inner = ddp.module if ddp is not None else network
    config = _resolve(inner, Level.parse(level, "level"), kwargs, distributed=ddp is not None)
    converted = _convert(inner, config)
    masters = None
    if config.cast_model_type != torch.float32:
        masters = MasterWeights.install(converted)
        if not config.master_weights:
            _repoint(optimizer, masters)
            masters = None
    if ddp is not None:
        ddp.module = converted  # same Parameters: DDP's reducer keeps working
        converted = ddp
    if manager is None and "loss_scale_manager" not in kwargs:
        manager = _default_manager(config)
    return TrainStep(converted, optimizer, loss_fn, config, manager, masters)


def _repoint(optimizer: torch.optim.Optimizer, masters: MasterWeights) -> None:
    """Pure low-precision training: the optimizer steps the low-precision Parameters."""
    if optimizer.state:
        raise ValueError(
            "master_weights=False makes the optimizer step low-precision parameters, but it already "
            "holds state for the float32 ones: build the step before the first optimizer step"
        )
    low_of = {id(m): low for m, low in zip(masters.masters, masters.lows, strict=True)}
    for group in optimizer.param_groups:
        group["params"] = [low_of.get(id(p), p) for p in group["params"]]
