"""``build_train_network``: a level and named options become a configured training step.

MindSpore's positional parameters come first (``network, optimizer, loss_fn, level,
boost_level``), then keyword-only options, each a named, typed parameter. The options are
resolved against the level's defaults into a frozen :class:`~mixprec.training.step.TrainConfig`;
the network is converted; with low-precision Parameters the float32 masters are installed;
a fresh loss-scale manager is made. The step itself is :class:`mixprec.training.step.TrainStep`.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import inspect
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import torch
from torch import nn

from mixprec._check import require_module
from mixprec._warn import warn
from mixprec.convert.api import check_network, convert
from mixprec.distributed.replicas import Replicas, ddp_of, find_replicas, fsdp_of, plain
from mixprec.distributed.shard import check_sharded_step
from mixprec.fp8.swap import apply_fp8
from mixprec.policy.dtypes import resolve_dtype
from mixprec.policy.levels import Level, Pins, Precision, Recipe, resolve
from mixprec.training.master import MasterWeights
from mixprec.training.scaling import DynamicLossScaleManager, LossScaleManager
from mixprec.training.step import StepHooks, TrainConfig, TrainStep, _fused_skip_ready

if TYPE_CHECKING:
    from mixprec.boost.config import BoostLevel

__all__ = ["DEFAULT", "UnsupportedArgError", "build_train_network"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


class _Default(enum.Enum):
    """The sentinel for "the level's default" (``None`` means "none" where it matters)."""

    DEFAULT = "the level's default"

    def __repr__(self) -> str:
        return "DEFAULT"


#: ``loss_scale_manager=DEFAULT`` (what leaving it out means): dynamic for float16, none
#: for bfloat16. An explicit ``None`` means no loss scaling, as in MindSpore.
DEFAULT = _Default.DEFAULT


class UnsupportedArgError(TypeError, ValueError):
    """An unknown keyword argument: a TypeError, and a ValueError as MindSpore raises."""


def _did_you_mean(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """An unknown keyword gets a TypeError that names the close matches."""
    names = list(inspect.signature(function).parameters)

    @functools.wraps(function)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        for key in kwargs:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=2)
                hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
                raise UnsupportedArgError(
                    f"Unsupported arg {key!r} for {function.__name__}{hint} "
                    f"Its parameters: {', '.join(names)}"
                )
        return function(*args, **kwargs)

    return wrapper


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


def _check_float_parameters(network: nn.Module, level: Level, low: torch.dtype | None) -> None:
    """O2/O3 train float32 parameters through a low-precision copy: refuse anything else."""
    for name, p in network.named_parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            raise ValueError(
                f"level {level.value!r} needs a float32 model (it keeps float32 weights and "
                f"computes in {low}); network holds {p.dtype} parameters (e.g. {name!r}). "
                f"Build the step from the float32 model (model.float()), or use level 'O0' to "
                f"train it as it is"
            )


def _check_output_loss(output_loss: object, loss_fn: object) -> None:
    if output_loss is None:
        return
    if isinstance(output_loss, bool) or not isinstance(output_loss, (int, str)):
        raise TypeError(
            f"output_loss must be an index (int), a key or attribute name (str), or None; got "
            f"{output_loss!r}"
        )
    if loss_fn is not None:
        raise ValueError(
            f"output_loss={output_loss!r} picks the loss out of the network's output, but "
            "loss_fn is given (it computes the loss from the whole output): pass one of them"
        )


def _check_optimizer(optimizer: torch.optim.Optimizer, network: nn.Module, loss_fn: object) -> None:
    trained = {id(p) for p in network.parameters()}
    if isinstance(loss_fn, nn.Module):
        trained |= {id(p) for p in loss_fn.parameters()}
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = [p for p in stepped if id(p) not in trained]
    if stepped and len(foreign) == len(stepped):
        raise ValueError(
            f"optimizer holds none of network's parameters ({len(stepped)} tensors, none of "
            "them the network's or the loss's): build it on network.parameters()"
        )
    if foreign:
        warn(
            f"{len(foreign)} of the optimizer's {len(stepped)} parameters belong neither to the "
            "network nor to the loss: the step never gives them a gradient",
            UserWarning,
        )


def _check_hooks(
    optimizer: torch.optim.Optimizer, lr_scheduler: Any, after_unscale: Any, after_skip: Any
) -> StepHooks:
    for name, hook in (("after_unscale", after_unscale), ("after_skip", after_skip)):
        if hook is not None and not callable(hook):
            raise TypeError(f"{name} must be callable or None; got {hook!r}")
    if lr_scheduler is not None:
        if not callable(getattr(lr_scheduler, "step", None)):
            raise TypeError(
                f"lr_scheduler must have a step() method (a torch LRScheduler); got {lr_scheduler!r}"
            )
        if isinstance(lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError(
                "lr_scheduler=ReduceLROnPlateau steps on a metric the step does not have: "
                "leave it out and call scheduler.step(metric) yourself, e.g. after each "
                "validation"
            )
        owner = getattr(lr_scheduler, "optimizer", optimizer)
        if owner is not optimizer:
            raise ValueError("lr_scheduler was built on another optimizer than the step's")
    return StepHooks(after_unscale=after_unscale, after_skip=after_skip, lr_scheduler=lr_scheduler)


def _resolve(
    network: nn.Module,
    level: str | Level,
    distributed: bool,
    dtype: torch.dtype | str | None,
    cast_model_type: torch.dtype | str | None,
    keep_batchnorm_fp32: bool | None,
    master_weights: bool | None,
    accumulation_steps: int,
    clip_grad_norm: float | None,
    fp32_modules: Pins,
    low_modules: Pins,
) -> tuple[TrainConfig, Recipe]:
    """The conversion policy (by :func:`mixprec.policy.levels.resolve`, as for every entry point)
    and the training options on top of it."""
    if keep_batchnorm_fp32 is not None and not isinstance(keep_batchnorm_fp32, bool):
        raise TypeError(f"keep_batchnorm_fp32 must be a bool; got {keep_batchnorm_fp32!r}")
    parsed = Level.parse(level, "level")
    keep_bn = keep_batchnorm_fp32
    if keep_bn is None:  # the level's default: norms in float32 at O2 only
        keep_bn = parsed is Level.O2 or (parsed is Level.AUTO)
    recipe = resolve(
        network,
        parsed,
        dtype,
        fp32_modules=fp32_modules,
        low_modules=low_modules,
        keep_batchnorm_fp32=keep_bn,
        argument="level",
    )
    level = recipe.level
    low = None if level is Level.O0 else recipe.dtype
    module_level = level in (Level.O2, Level.O3)
    if module_level:
        _check_float_parameters(network, level, low)

    cast = torch.float32
    if cast_model_type is not None:
        cast = _parse_cast_model_type(cast_model_type)
        if cast != torch.float32 and (not module_level or cast != low):
            raise ValueError(
                f"cast_model_type={cast_model_type!r} does not fit level {level.value!r} with dtype "
                f"{low}: low-precision parameters go with O2/O3 in their dtype; otherwise use "
                "torch.float32"
            )
    elif module_level and not distributed and low is not None:
        cast = low  # the model holds low-precision Parameters (O2/O3 default)

    master = cast != torch.float32 if master_weights is None else master_weights
    if not isinstance(master, bool):
        raise TypeError(f"master_weights must be a bool; got {master!r}")
    if master and cast == torch.float32:
        raise ValueError(
            f"master_weights=True needs low-precision parameters (level O2/O3 with cast_model_type "
            f"{low}); this step keeps float32 parameters"
            + (" because DistributedDataParallel reduces them" if distributed else "")
        )
    steps = accumulation_steps
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"accumulation_steps must be a positive int; got {steps!r}")
    if steps < 1:
        raise ValueError(f"accumulation_steps must be a positive int; got {steps!r}")
    clip = clip_grad_norm
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))):
        raise TypeError(f"clip_grad_norm must be a positive finite number or None; got {clip!r}")
    if clip is not None and (not math.isfinite(clip) or clip <= 0):
        raise ValueError(f"clip_grad_norm must be a positive finite number or None; got {clip!r}")
    config = TrainConfig(
        level,
        low,
        cast,
        keep_bn and level is not Level.O0,
        master,
        steps,
        None if clip is None else float(clip),
        recipe.reason,
    )
    return config, recipe


@_did_you_mean
def build_train_network(
    network: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    level: str | Level = "O0",
    boost_level: str | BoostLevel = "O0",
    *,
    dtype: torch.dtype | str | None = None,
    cast_model_type: torch.dtype | str | None = None,
    keep_batchnorm_fp32: bool | None = None,
    loss_scale_manager: LossScaleManager | _Default | None = DEFAULT,
    master_weights: bool | None = None,
    accumulation_steps: int = 1,
    clip_grad_norm: float | None = None,
    fp32_modules: Pins = None,
    low_modules: Pins = None,
    lr_scheduler: Any = None,
    after_unscale: Callable[[TrainStep, list[torch.Tensor]], None] | None = None,
    after_skip: Callable[[TrainStep], None] | None = None,
    debug_overflow: bool = False,
    process_group: Any = None,
    boost_config: Mapping[str, Any] | None = None,
    emulate: bool = False,
    output_loss: int | str | None = None,
    fp8: str | None = None,
    fp8_filter: Callable[[nn.Module, str], bool] | None = None,
) -> TrainStep:
    """Build a mixed-precision training step.

    Args:
        network: the model (or a ``DistributedDataParallel`` around it); the step trains
            its Parameters.
        optimizer: a ``torch.optim`` optimizer built on ``network``'s parameters.
        loss_fn: ``loss_fn(output, label)``; None when the network returns its loss.
        level: "O0", "O1", "O2", "O3", "autocast" or "auto" (the device's recommendation).
        boost_level: "O0" (none), "O1" (speedups that keep accuracy, each only where
            it measures faster) or "O2" (O1 plus gradient freezing and, under DDP, AdaSum);
            ``repr(step)`` says what was switched on and why.
        dtype: the low dtype (default: the device's usual one).
        cast_model_type: the dtype of the model's Parameters: float32 = cast at use, the
            low dtype = low-precision Parameters (default for O2/O3).
        keep_batchnorm_fp32: norms in float32 (default: True for O2).
        loss_scale_manager: leave out for the level's default (float16: a dynamic scale
            whose first value comes from the first gradients; bfloat16: none); ``None``
            for no loss scaling; or a manager.
        master_weights: float32 masters for low-precision Parameters (default on).
        accumulation_steps: calls per optimizer step.
        clip_grad_norm: max norm of the unscaled gradients.
        fp32_modules / low_modules: pins, as in :func:`mixprec.auto_mixed_precision`.
        lr_scheduler: stepped after each applied optimizer step, never after a skipped one.
        after_unscale: ``after_unscale(step, params)``, between unscale and optimizer step.
        after_skip: ``after_skip(step)``, after a skipped optimizer step.
        debug_overflow: on each skipped step, probe its batch with
            :func:`mixprec.find_overflow` (no effect on training) and keep the report at
            ``step.last_overflow_report``, with a one-line warning naming the module; costs
            one host sync per step.
        process_group: the ranks the step agrees with under ``torch.distributed``
            (default: the DDP's or FSDP2 mesh's own group, else the whole world).
        boost_config: options of the boost level (see :class:`mixprec.boost.BoostConfig`).
        emulate: run the low-precision GEMMs (forward and backward) as float32 kernels on
            rounded inputs with rounded results, as :func:`mixprec.auto_mixed_precision`.
        output_loss: without ``loss_fn``, where the loss is in the network's output: an
            index (``output[1]`` of ``(logits, loss)``) or a key or attribute name. Left
            out: the output itself, ``output["loss"]``, ``output.loss``, or a scalar
            ``output[0]``; any other output is refused with what it holds.
        fp8 / fp8_filter: fp8 GEMMs for chosen linear layers, as
            :func:`mixprec.auto_mixed_precision` (under FSDP2, pass them to ``fully_shard``).

    Returns:
        A :class:`TrainStep`: ``loss = step(*inputs, label)`` (or ``step(*inputs, **kwargs)``
        without ``loss_fn``).

    Raises:
        TypeError: a non-module network, a non-optimizer, a bad option type, an unknown
            keyword (with the close matches).
        ValueError: an unknown level or dtype; conflicting options; an optimizer over
            other parameters; O2/O3 on a model that is not float32.

    Example:
        >>> step = mixprec.build_train_network(model, torch.optim.AdamW(model.parameters()),
        ...                                    torch.nn.CrossEntropyLoss(), level="O2")
        >>> loss = step(images, labels)
    """
    require_module(network)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}: {optimizer!r}"
        )
    if isinstance(loss_fn, type):
        raise TypeError(
            f"loss_fn must be a loss function or a loss module instance; got the class "
            f"{loss_fn.__qualname__} itself: pass {loss_fn.__qualname__}() (called once, with "
            f"its options) instead"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable or None; got {loss_fn!r}")
    # the boost wing sits above this floor: imported when a step is built
    from mixprec.boost.config import BoostLevel, parse_boost_config
    from mixprec.boost.plan import plan_boost

    boost = BoostLevel.parse(boost_level, "boost_level")
    boost_options = parse_boost_config(boost_config)
    manager = loss_scale_manager
    if manager is not DEFAULT and manager is not None and not isinstance(manager, LossScaleManager):
        raise TypeError(
            f"loss_scale_manager must be a mixprec.LossScaleManager or None; got {manager!r}"
        )
    hooks = _check_hooks(optimizer, lr_scheduler, after_unscale, after_skip)
    _check_output_loss(output_loss, loss_fn)
    if not isinstance(debug_overflow, bool):
        raise TypeError(f"debug_overflow must be a bool; got {debug_overflow!r}")

    ddp = ddp_of(network)
    inner = check_network(ddp.module if ddp is not None else network)
    fsdp = fsdp_of(inner)
    replicas = find_replicas(network, process_group)
    _check_optimizer(optimizer, inner, loss_fn)
    config, recipe = _resolve(
        inner,
        level,
        ddp is not None or fsdp is not None,
        dtype,
        cast_model_type,
        keep_batchnorm_fp32,
        master_weights,
        accumulation_steps,
        clip_grad_norm,
        fp32_modules,
        low_modules,
    )
    if isinstance(manager, LossScaleManager):
        manager.check_network(inner)
    pins = {"fp32_modules": fp32_modules, "low_modules": low_modules}
    options = {**pins, "keep_batchnorm_fp32": keep_batchnorm_fp32}
    _check_wrapped(inner, replicas, config, emulate, options)
    # under FSDP2 the parameters are FSDP2's to cast (see mixprec.distributed.fully_shard)
    if fsdp is not None and fp8 is not None:
        raise ValueError("fp8 under FSDP2 is fully_shard's option: pass fp8= to it, not here")
    fp8_inner = apply_fp8(
        inner, fp8, filter=fp8_filter, fp32_pin=recipe.fp32_pin, emulate=emulate or None
    )
    converted = inner if fsdp is not None else convert(fp8_inner, recipe, emulate=emulate)
    masters = None
    if config.cast_model_type != torch.float32:
        masters = MasterWeights.install(converted, masters_are_stepped=config.master_weights)
        if not config.master_weights:
            _repoint(optimizer, masters)
            optimizer.register_step_post_hook(masters.lows_stepped)
            masters = None
    if isinstance(manager, LossScaleManager):
        pairs = [] if masters is None else list(zip(masters.masters, masters.lows, strict=True))
        manager.attach(converted, pairs)
    plan = plan_boost(boost, boost_options, converted, optimizer, ddp, masters)
    if plan is not None:  # boost times kernels and layouts per rank: every rank runs the first's
        decision = plan.decisions["optimizer"]
        plan.decisions["optimizer"] = replicas.adopt_optimizer_kernels(optimizer, decision)
        plan.adopt_first = replicas.adopt_first if replicas.active else None
    if manager is DEFAULT:
        manager = None
        if config.dtype == torch.float16:  # float16 gradients underflow without scaling
            manager = DynamicLossScaleManager(2.0**16)
            config = dataclasses.replace(config, auto_loss_scale=True)
    replicas.check(
        {
            "level": config.level.value,
            "dtype": str(config.dtype),
            "parameters": str(config.cast_model_type),
            "keep_batchnorm_fp32": config.keep_batchnorm_fp32,
            "master_weights": config.master_weights,
            "accumulation_steps": config.accumulation_steps,
            "clip_grad_norm": config.clip_grad_norm,
            "loss_scale_manager": repr(manager),
            "loss-scale state": None if manager is None else plain(manager.state_dict()),
            "emulate": emulate,
            **{name: _pinned(inner, recipe, pin) for name, pin in _PINS.items()},
            "boost_level": boost.value,
            **{f"boost {k}": d.on for k, d in ({} if plan is None else plan.decisions).items()},
            "decides skips on": _decides_on(manager, hooks, optimizer, debug_overflow),
        },
        "when the training step is built",
        "Build the same step on every rank: pass level and dtype explicitly (not 'auto' on "
        "machines that differ) and give every rank the same loss-scale manager and state",
    )
    step = TrainStep(
        converted,
        optimizer,
        loss_fn,
        dataclasses.replace(config, output_loss=output_loss),
        manager,
        masters,
        hooks,
        replicas,
        debug_overflow=debug_overflow,
    )
    step.boost = plan
    return step


_PINS = {"fp32_modules": Precision.FP32, "low_modules": Precision.LOW}


def _pinned(network: nn.Module, recipe: Recipe, pin: Precision) -> list[str]:
    """The modules a pin names (by name: comparable across ranks, unlike a filter)."""
    return [name for name, m in network.named_modules() if recipe.pinned(m, name) is pin]


def _decides_on(
    manager: LossScaleManager | None, hooks: StepHooks, optimizer: Any, debug: bool
) -> str:
    """Whether the step's skip is decided on the device or the host (every rank must
    decide alike: a host decision all-reduces where a device one does not)."""
    device = (
        (manager is None or manager.device_state() is not None)
        and not hooks.need_host_decision
        and not debug
        and _fused_skip_ready(optimizer)
    )
    return "the device" if device else "the host"


def _check_wrapped(
    inner: nn.Module,
    replicas: Replicas,
    config: TrainConfig,
    emulate: bool,
    options: Mapping[str, object],
) -> None:
    """DDP reduces the Parameters it was built on; FSDP2 casts the ones it shards (with
    the options it was sharded with)."""
    if replicas.ddp is not None and config.cast_model_type != torch.float32:
        raise ValueError(
            f"cast_model_type={config.cast_model_type} under DistributedDataParallel: DDP reduces "
            "the gradients of the Parameters it was built on (float32), but low-precision "
            "Parameters are separate copies whose gradients DDP never sees. Leave "
            "cast_model_type out: under DDP the step keeps float32 Parameters and casts them at "
            "use, so DDP reduces float32 gradients"
        )
    if replicas.fsdp is None:
        return
    if config.cast_model_type != torch.float32:
        raise ValueError(
            f"cast_model_type={config.cast_model_type} under FSDP2: FSDP2 casts the sharded "
            "float32 Parameters itself (its MixedPrecisionPolicy); leave cast_model_type out"
        )
    check_sharded_step(inner, config.level, config.dtype, emulate=emulate, options=options)


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
