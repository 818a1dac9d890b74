"""The training step: ``build_train_network`` and :class:`TrainStep`.

One call turns a model, its optimizer and a loss into a training step at a level::

    step = mixprec.build_train_network(model, optimizer, nn.CrossEntropyLoss(), level="O2")
    for images, labels in loader:
        loss = step(images, labels)        # forward, loss in fp32, scaled backward, step
        if step.overflow:                  # the step was skipped, and says why
            print(f"skipped: gradients overflowed at loss scale {step.loss_scale}")

Each call: forward; the loss in float32 (output and label cast first); backward on the
scaled loss; (with master weights) low-precision gradients moved onto float32 masters;
unscale (float64 reciprocal) and the overflow check, fused; one overflow decision for all
ranks; clip; the optimizer step only when the gradients are finite (or when the
loss-scale manager says not to drop); refresh of the low-precision weights; the
loss-scale update. With ``accumulation_steps=N``, N calls make one optimizer step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from mixprec import lists
from mixprec.convert.api import convert
from mixprec.distributed import agree_on_overflow, ddp_of
from mixprec.dtypes import device_of, resolve_dtype
from mixprec.levels import Level, make_recipe, recommend
from mixprec.master import MasterWeights
from mixprec.ops import cast_tree
from mixprec.scaling import (
    DynamicLossScaleManager,
    LossScaleManager,
    all_finite,
    inverse_scale,
    unscale_grads_,
)

__all__ = ["TrainConfig", "TrainStep", "build_train_network"]

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
class TrainConfig:
    """What a training step does, resolved from the level and the keyword arguments."""

    level: Level
    dtype: torch.dtype | None
    cast_model_type: torch.dtype
    keep_batchnorm_fp32: bool
    master_weights: bool
    accumulation_steps: int
    clip_grad_norm: float | None
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class ClassPin:
    """Pins modules of the given classes (a picklable pin)."""

    classes: tuple[type[nn.Module], ...]

    def __call__(self, module: nn.Module, name: str) -> bool:
        return isinstance(module, self.classes)


def _option(kwargs: Mapping[str, Any], key: str, default: Any) -> Any:
    value = kwargs.get(key)
    return default if value is None else value


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
        cast_model_type = (
            torch.float32 if given in (torch.float32, "fp32", "float32") else resolve_dtype(given)
        )
        if cast_model_type != torch.float32 and (not module_level or cast_model_type != low):
            raise ValueError(
                f"cast_model_type={given!r} does not fit level {level.value!r} with dtype {low}: "
                "low-precision parameters go with O2/O3 in their dtype; otherwise use torch.float32"
            )
    elif module_level and not distributed:
        assert low is not None
        cast_model_type = low

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
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
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


def _loss_of(output: Any) -> torch.Tensor:
    """The loss a network returned: a tensor, ``output["loss"]``, ``output.loss`` or ``output[0]``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and "loss" in output:
        return output["loss"]
    if getattr(output, "loss", None) is not None:
        return output.loss
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(
        f"without loss_fn the network must return its loss (a tensor, a dict with 'loss', or an "
        f"object with .loss); got {type(output).__name__}"
    )


def _non_finite(grads: list[torch.Tensor]) -> bool:
    """Whether any gradient holds inf/NaN, agreed across ranks (one host sync).

    The fast path is one L2 norm per tensor (a fused, vectorised reduction, several times
    cheaper than an exact element check); only when some norm is not finite, which is
    also what a float32 norm of huge finite values gives, the exact check decides.
    """
    if not grads:
        return False
    norms = torch._foreach_norm(grads, 2)
    suspect = (~torch.isfinite(torch.stack([n.to(norms[0].device) for n in norms])).all()).float()
    if not agree_on_overflow(suspect).item():
        return False
    exact = (~all_finite(grads)).float()
    return bool(agree_on_overflow(exact).item())


class TrainStep(nn.Module):
    """One training step per call (see :func:`build_train_network`).

    Attributes:
        network: the converted model (evaluate with ``step.network.eval()``).
        optimizer: the optimizer; it steps float32 weights.
        overflow: whether the last optimizer step was skipped for non-finite gradients.
        skipped_steps: how many optimizer steps were skipped so far.
        loss_scale: the current loss scale (1.0 without a manager).
    """

    def __init__(
        self,
        network: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        config: TrainConfig,
        manager: LossScaleManager | None,
        masters: MasterWeights | None,
    ) -> None:
        super().__init__()
        self.network = network
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.config = config
        self.loss_scale_manager = manager
        self.masters = masters
        self.overflow = False
        self.skipped_steps = 0
        self.optimizer_steps = 0
        self._micro_step = 0

    @property
    def level(self) -> Level:
        return self.config.level

    @property
    def dtype(self) -> torch.dtype | None:
        return self.config.dtype

    @property
    def loss_scale(self) -> float:
        return (
            1.0
            if self.loss_scale_manager is None
            else float(self.loss_scale_manager.get_loss_scale())
        )

    def forward(self, *inputs: Any, **kwargs: Any) -> torch.Tensor:
        """Run one micro-batch; returns its unscaled float32 loss (detached)."""
        if self.loss_fn is not None:
            if not inputs:
                raise TypeError(
                    "step(*inputs, label): the label is the last positional argument; got none"
                )
            *net_inputs, label = inputs
            output = self.network(*net_inputs, **kwargs)
            loss = self.loss_fn(cast_tree(output, torch.float32), cast_tree(label, torch.float32))
        else:
            loss = _loss_of(self.network(*inputs, **kwargs))
        loss = loss.float()
        if loss.dim() != 0:
            raise ValueError(f"the loss must be a scalar tensor; got shape {tuple(loss.shape)}")
        (loss * (self.loss_scale / self.config.accumulation_steps)).backward()
        if self.masters is not None:
            self.masters.collect_grads()
        self._micro_step += 1
        if self._micro_step == self.config.accumulation_steps:
            self._micro_step = 0
            self._step()
        return loss.detach()

    def _step(self) -> None:
        params = [
            p
            for group in self.optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        grads = [p.grad for p in params]
        manager = self.loss_scale_manager
        check = manager is None or manager.get_drop_overflow_update()
        scale = self.loss_scale
        overflow = False
        if scale != 1.0 and grads:
            inverse = inverse_scale(
                torch.tensor(scale, dtype=torch.float64, device=grads[0].device)
            )
            found_inf = unscale_grads_(grads, inverse)  # unscale and check in one fused pass
            if check:
                overflow = bool(agree_on_overflow(found_inf).item())  # the one host sync per step
        elif check:
            overflow = _non_finite(grads)
        if overflow:
            self.skipped_steps += 1
        else:
            if self.config.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, self.config.clip_grad_norm)
            self.optimizer.step()
            if self.masters is not None:
                self.masters.refresh()
        self.optimizer_steps += 1
        self.overflow = overflow
        if self.masters is not None:
            self.masters.step_done()
        if manager is not None:
            manager.update_loss_scale(overflow)
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ checkpoints
    def get_extra_state(self) -> dict[str, Any]:
        if self._micro_step:
            raise RuntimeError(
                f"cannot checkpoint in the middle of gradient accumulation ({self._micro_step} of "
                f"{self.config.accumulation_steps} micro-batches done): save after an optimizer step"
            )
        return {
            "loss_scale_manager": None
            if self.loss_scale_manager is None
            else self.loss_scale_manager.state_dict(),
            "masters": None if self.masters is None else self.masters.state(),
            "overflow": self.overflow,
            "skipped_steps": self.skipped_steps,
            "optimizer_steps": self.optimizer_steps,
        }

    def set_extra_state(self, state: Any) -> None:
        if not isinstance(state, Mapping):
            raise ValueError(f"not a mixprec training-step checkpoint: {type(state).__name__}")
        if (state.get("loss_scale_manager") is None) != (self.loss_scale_manager is None):
            raise ValueError("the checkpoint and this step disagree on having a loss-scale manager")
        if self.loss_scale_manager is not None:
            self.loss_scale_manager.load_state_dict(state["loss_scale_manager"])
        if (state.get("masters") is None) != (self.masters is None):
            raise ValueError("the checkpoint and this step disagree on master weights")
        if self.masters is not None:
            self.masters.load(state["masters"])
        self.overflow = bool(state["overflow"])
        self.skipped_steps = int(state["skipped_steps"])
        self.optimizer_steps = int(state["optimizer_steps"])
        self._micro_step = 0

    def extra_repr(self) -> str:
        c = self.config
        dtype = "-" if c.dtype is None else str(c.dtype).removeprefix("torch.")
        level = f"{c.level.value} ({c.reason})" if c.reason else c.level.value
        params = str(c.cast_model_type).removeprefix("torch.")
        return (
            f"level={level}, dtype={dtype}, parameters={params}, master_weights={c.master_weights}, "
            f"loss_scale_manager={self.loss_scale_manager!r}, accumulation_steps={c.accumulation_steps}, "
            f"clip_grad_norm={c.clip_grad_norm}"
        )
