"""Loss scaling for a training loop that another framework drives.

Lightning, Fabric, the Hugging Face Trainer and Accelerate each run their own loop: they
call backward, clip, step the optimizer and the learning-rate schedule. mixprec's part
is the same in all of them, and lives here once:

1. the loss is multiplied by the loss scale before backward (:meth:`LoopScaling.scale`);
2. before anything reads the gradients (clipping, logging hooks), they are unscaled in
   place, once per step however often it is asked for (:meth:`LoopScaling.unscale_`);
3. the optimizer steps only when the gradients are finite, the scale is updated, and a
   skipped step is counted (:meth:`LoopScaling.step`); a skipped step does not move a
   learning-rate schedule wrapped in :class:`SkipAwareScheduler`;
4. the scale, its counters and the step counts are one ``state_dict`` (exact resume).

With no loss-scale manager (bfloat16 by default) every step is a plain optimizer step.
The framework modules also share :func:`convert_children_` (conversion of a wrapper's
children in place), :func:`default_manager`, :class:`ScalingReport` (what each reports,
by :class:`mixprec.TrainStep`'s names) and :func:`report_skips` (a skip told to
Accelerate, whose loops and schedulers ask ``step_was_skipped``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from mixprec import unscale_
from mixprec.convert.api import check_emulate, convert
from mixprec.convert.declared import with_declared_pins
from mixprec.convert.structure import find_converted
from mixprec.distributed.replicas import fsdp_of
from mixprec.distributed.shard import check_sharded_step
from mixprec.distributed.step import local_shard
from mixprec.policy.dtypes import resolve_dtype
from mixprec.policy.levels import Level, ModulePin, Pins, Recipe, resolve
from mixprec.training.build import DEFAULT
from mixprec.training.grads import _inverse_scale, _unscale_grads
from mixprec.training.scaling import (
    DynamicLossScaleManager,
    LossScaleManager,
    overflow_limit_message,
)

__all__ = [
    "LoopScaling",
    "PluginCore",
    "PrecisionSettings",
    "ScalingReport",
    "SkipAwareScheduler",
    "SkipFlag",
    "convert_children_",
    "default_manager",
    "report_skips",
]

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class PrecisionSettings:
    """What a framework plugin converts with: a level, a dtype and the pins (validated).

    Attributes:
        level: the parsed level.
        dtype: the low dtype, or None for the device's usual one.
        fp32_modules / low_modules: pins, as :func:`mixprec.auto_mixed_precision` takes them.
        emulate: emulate the low-precision GEMMs (:mod:`mixprec.convert.emulate`).
        declared_fp32: keep what a model declares float32 (:mod:`mixprec.convert.declared`).
    """

    level: Level
    dtype: torch.dtype | None
    fp32_modules: Pins = None
    low_modules: Pins = None
    emulate: bool = False
    declared_fp32: bool = True

    @classmethod
    def parse(
        cls,
        level: str | Level,
        dtype: torch.dtype | str | None,
        fp32_modules: Pins,
        low_modules: Pins,
        emulate: bool,
        declared_fp32: bool,
    ) -> PrecisionSettings:
        """Validate the user's arguments (a ValueError/TypeError names the bad one)."""
        if not isinstance(declared_fp32, bool):
            raise TypeError(f"declared_fp32 must be a bool (True or False); got {declared_fp32!r}")
        return cls(
            Level.parse(level, "level"),
            None if dtype is None else resolve_dtype(dtype),
            fp32_modules,
            low_modules,
            check_emulate(emulate),
            declared_fp32,
        )

    def recipe(self, network: nn.Module) -> Recipe:
        """The conversion policy for ``network`` (pins checked against its module names)."""
        return resolve(
            network,
            self.level,
            self.dtype,
            fp32_modules=self.fp32_modules,
            low_modules=self.low_modules,
            argument="level",
        )

    def convert(self, network: nn.Module) -> nn.Module:
        """``network`` converted (the network itself at O0)."""
        return convert(
            network, self.recipe(network), emulate=self.emulate, declared_fp32=self.declared_fp32
        )

    def low_dtype(self, network: nn.Module) -> torch.dtype | None:
        """The dtype the network computes in at this level (None at O0)."""
        recipe = self.recipe(network)
        return None if recipe.level is Level.O0 else recipe.dtype


@dataclasses.dataclass(frozen=True)
class _Below:
    """A pin on a wrapper, seen from one of its children (picklable)."""

    pin: ModulePin
    prefix: str

    def __call__(self, module: nn.Module, name: str) -> bool:
        return self.pin(module, f"{self.prefix}.{name}" if name else self.prefix)


def convert_children_(module: nn.Module, settings: PrecisionSettings) -> nn.Module:
    """Convert each child of ``module`` that holds parameters, in place; returns ``module``.

    Frameworks keep their own reference to the module they were given (Lightning's
    strategies drop what a precision plugin returns, and its forward redirection needs
    the original object), so the wrapper stays and its children are replaced by their
    converted versions, which share their Parameters. Pins name modules from the
    wrapper, and so do the modules the wrapper declares float32. Children without
    parameters (losses, metrics) are left as they are.

    A module sharded by :func:`mixprec.distributed.fully_shard` (FSDP2, in a Lightning
    ``configure_model``) is not converted: FSDP2 casts it as its level says, which must
    be this plugin's.

    Raises:
        ValueError: a sharded module whose level or dtype differs from the plugin's, or
            sharded by torch's ``fully_shard`` above O0; pins or ``emulate=True`` under FSDP2.
    """
    sharded = fsdp_of(module)
    if sharded is not None:
        own = resolve(sharded, settings.level, settings.dtype, argument="level")
        check_sharded_step(
            sharded,
            own.level,
            None if own.level is Level.O0 else own.dtype,
            emulate=settings.emulate,
            options={"fp32_modules": settings.fp32_modules, "low_modules": settings.low_modules},
        )
        return module
    recipe = settings.recipe(module)
    if recipe.level is Level.O0:
        return module
    if settings.declared_fp32:  # what the wrapper itself declares reaches its children
        recipe = with_declared_pins(module, recipe)
    for name, child in list(module.named_children()):
        if next(child.parameters(), None) is None or next(find_converted(child), None) is not None:
            continue  # nothing to convert, or converted by an earlier setup
        own = dataclasses.replace(
            recipe,
            fp32_pin=None if recipe.fp32_pin is None else _Below(recipe.fp32_pin, name),
            low_pin=None if recipe.low_pin is None else _Below(recipe.low_pin, name),
        )
        converted = convert(
            child, own, emulate=settings.emulate, declared_fp32=settings.declared_fp32
        )
        setattr(module, name, converted)
    return module


def default_manager(
    manager: LossScaleManager | object | None, low: torch.dtype | None
) -> LossScaleManager | None:
    """The loss-scale manager a plugin uses: ``DEFAULT`` is dynamic for float16, none
    otherwise (as in :func:`mixprec.build_train_network`); None is no loss scaling."""
    if manager is DEFAULT:
        return DynamicLossScaleManager(2.0**16) if low == torch.float16 else None
    if manager is not None and not isinstance(manager, LossScaleManager):
        raise TypeError(
            f"loss_scale_manager must be a mixprec LossScaleManager or None; got {manager!r}"
        )
    return manager


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _key(optimizer: Any) -> int:
    """The identity of ``optimizer`` under its wrappers (Lightning's, Fabric's, Accelerate's,
    mixprec's ``optimizer`` attribute), so a wrapper and what it wraps are one optimizer."""
    inner = optimizer
    for _ in range(8):  # wrappers nest a few deep at most
        nested = getattr(inner, "optimizer", None)
        if nested is None or nested is inner:
            break
        inner = nested
    return id(inner)


def _state_count(state: Mapping[str, Any], name: str, default: int | None = None) -> int:
    value = state.get(name, default)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"loss-scaling state: {name} must be an int >= 0; got {value!r}")
    return value


class LoopScaling:
    """Scale, unscale once, check, step or skip, for one framework's loop.

    Each optimizer is unscaled at most once per step of its own (a wrapper and what it
    wraps count as one), by the scale its loss was multiplied with, and is skipped on
    its own overflow; :class:`SkipAwareScheduler` follows the optimizer it schedules.

    Args:
        manager: the loss-scale policy; None for no scaling (every step is taken).

    Example:
        >>> scaling = LoopScaling(mixprec.DynamicLossScaleManager(1024))
        >>> scaling.scale(loss).backward()
        >>> scaling.step(optimizer, optimizer.step)  # None when skipped
    """

    #: a RuntimeError after more consecutive skipped steps than this (as :class:`mixprec.TrainStep`)
    MAX_CONSECUTIVE_OVERFLOWS: ClassVar[int] = 1000
    #: what lives within one step or one process only, and is not in :meth:`state_dict`
    TRANSIENT: ClassVar[frozenset[str]] = frozenset(
        {"manager", "_found", "_taken", "_taken_total", "_scaled_by"}
    )

    def __init__(self, manager: LossScaleManager | None) -> None:
        self.manager = manager
        self.steps = 0
        self.skipped_steps = 0
        self.overflow = False
        self.consecutive_overflows = 0
        self.overflow_module: str | None = None
        self.grad_norm: torch.Tensor | None = None
        self._found: dict[int, torch.Tensor] = {}  # per optimizer: unscaled this step
        self._taken: dict[int, int] = {}  # per optimizer: steps taken in this process
        self._taken_total = 0
        self._scaled_by: float | None = None  # the scale of the last scaled loss

    @property
    def enabled(self) -> bool:
        """Whether the loss is scaled at all."""
        return self.manager is not None

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without a manager; reads the device)."""
        return 1.0 if self.manager is None else self.manager.get_loss_scale()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (the loss itself without a manager); the scale is
        kept to unscale with, even if another optimizer's step moves it meanwhile."""
        if self.manager is None:
            return loss
        self._scaled_by = scale = self.loss_scale
        return loss * scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Unscale ``optimizer``'s gradients in place (:func:`mixprec.unscale_`), once per
        step of that optimizer; returns the found-inf flag (a 0-dim bool tensor)."""
        key = _key(optimizer)
        if key not in self._found:
            if self.manager is None:
                self._found[key] = torch.tensor(False)
            else:
                self._found[key] = self._unscale(optimizer)
        return self._found[key]

    def _unscale(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        used = self.loss_scale if self._scaled_by is None else self._scaled_by
        grads = [p.grad for p in _params(optimizer) if p.grad is not None]
        mesh = next((g.device_mesh for g in grads if hasattr(g, "device_mesh")), None)
        if mesh is None:
            return unscale_(optimizer, used)
        # FSDP2: each rank unscales and checks its own shards; the ranks of the mesh
        # agree, so one rank's inf skips the step everywhere
        import torch.distributed as dist

        local = [local_shard(g) for g in grads]
        device = local[0].device
        scale = torch.tensor(used, dtype=torch.float64, device=device)
        found = _unscale_grads(local, _inverse_scale(scale))
        for dim in range(mesh.ndim):
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
        return found > 0

    def steps_taken(self, optimizer: Any | None = None) -> int:
        """Optimizer steps taken in this process by ``optimizer`` (by any, for None)."""
        return self._taken_total if optimizer is None else self._taken.get(_key(optimizer), 0)

    def _took(self, key: int) -> None:
        self.steps += 1
        self._taken[key] = self._taken.get(key, 0) + 1
        self._taken_total += 1

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        do_step: Callable[[], _T],
        model: nn.Module | None = None,
    ) -> _T | None:
        """Unscale (if not done yet), then ``do_step()`` unless the gradients overflowed;
        update the scale. Returns what ``do_step`` returned, None for a skipped step.

        ``model`` (optional) names the module whose gradient overflowed first.

        Raises:
            RuntimeError: after more than :attr:`MAX_CONSECUTIVE_OVERFLOWS` skipped steps in
                a row (the count survives a checkpoint).
        """
        key = _key(optimizer)
        if self.manager is None:
            self._found.pop(key, None)
            self.overflow = False
            self._took(key)
            return do_step()
        found = self.unscale_(optimizer)
        self._found.pop(key, None)  # the next backward starts this optimizer's next step
        drop = self.manager.get_drop_overflow_update()
        overflow = bool(found) if drop else False
        self.overflow = overflow
        result: _T | None = None
        self.consecutive_overflows = self.consecutive_overflows + 1 if overflow else 0
        if overflow:
            self.skipped_steps += 1
            self.overflow_module = _first_non_finite(optimizer, model)
        else:
            result = do_step()
            self._took(key)
        self.manager.update_loss_scale(overflow)
        if self.consecutive_overflows > self.MAX_CONSECUTIVE_OVERFLOWS:
            fixed = self.manager.is_fixed()
            raise RuntimeError(
                "mixprec loss scaling: "
                + overflow_limit_message(self.consecutive_overflows, self.loss_scale, fixed=fixed)
            )
        return result

    def metrics(self) -> dict[str, float]:
        """What the plugins log (the names of :meth:`mixprec.TrainStep.metrics`): the loss
        scale, skipped steps, the last step's overflow, consecutive overflows and, where
        the plugin clipped, the unscaled gradient norm."""
        out = {
            "loss_scale": self.loss_scale,
            "skipped_steps": float(self.skipped_steps),
            "overflow": float(self.overflow),
            "consecutive_overflows": float(self.consecutive_overflows),
        }
        if self.grad_norm is not None:
            out["grad_norm"] = float(self.grad_norm)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The manager's state, the step counts and the overflow record (the last step's
        flag, the run of skipped steps, the module that overflowed, the last clipped norm),
        so a resumed run goes on counting where it stopped."""
        return {
            "loss_scale_manager": None if self.manager is None else self.manager.state_dict(),
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "overflow": self.overflow,
            "consecutive_overflows": self.consecutive_overflows,
            "overflow_module": self.overflow_module,
            "grad_norm": None if self.grad_norm is None else self.grad_norm.detach(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (a state without the overflow record,
        from an earlier mixprec, loads as no overflow)."""
        manager_state = state.get("loss_scale_manager")
        if (manager_state is None) != (self.manager is None):
            raise ValueError(
                "the checkpoint's loss scaling does not match this plugin's: "
                f"checkpoint manager state {manager_state!r}, plugin manager {self.manager!r}"
            )
        steps = _state_count(state, "steps")
        skipped = _state_count(state, "skipped_steps")
        run = _state_count(state, "consecutive_overflows", 0)
        overflow = state.get("overflow", False)
        if isinstance(overflow, torch.Tensor) and overflow.numel() == 1:
            overflow = bool(overflow.item())
        if not isinstance(overflow, bool):
            raise ValueError(f"loss-scaling state: overflow must be a bool; got {overflow!r}")
        module = state.get("overflow_module")
        if module is not None and not isinstance(module, str):
            raise ValueError(
                f"loss-scaling state: overflow_module must be a str or None; got {module!r}"
            )
        norm = state.get("grad_norm")
        if norm is not None and not isinstance(norm, torch.Tensor):
            raise ValueError(
                f"loss-scaling state: grad_norm must be a tensor or None; got {norm!r}"
            )
        if self.manager is not None and manager_state is not None:
            self.manager.load_state_dict(manager_state)
        self.steps, self.skipped_steps, self.consecutive_overflows = steps, skipped, run
        self.overflow, self.overflow_module, self.grad_norm = overflow, module, norm
        self._found.clear()
        self._scaled_by = None


def _first_non_finite(optimizer: torch.optim.Optimizer, model: nn.Module | None) -> str | None:
    names: dict[torch.Tensor, str] = {}
    if model is not None:
        names = {p: n for n, p in model.named_parameters()}
    for p in _params(optimizer):  # under FSDP2, this rank's shards
        if p.grad is not None and not bool(torch.isfinite(local_shard(p.grad)).all()):
            name = names.get(p)
            return None if name is None else name.rpartition(".")[0] or name
    return None


class SkipAwareScheduler:
    """A learning-rate scheduler that does not move after a skipped optimizer step.

    It steps only when its own optimizer (the scheduler's ``optimizer``; any optimizer
    for a scheduler without one) took a step since the scheduler's last step, so an
    overflow skipped by the loss scaling leaves the learning rate where it was, and
    another optimizer's step or skip does not move it. Every other attribute
    (``state_dict``, ``get_last_lr``, ``optimizer``) is the scheduler's.
    """

    def __init__(self, scheduler: Any, scaling: LoopScaling) -> None:
        self.scheduler = scheduler
        self.scaling = scaling
        self.seen = self.taken()

    def taken(self) -> int:
        """Steps its optimizer has taken in this process (what ``step`` compares)."""
        return self.scaling.steps_taken(getattr(self.scheduler, "optimizer", None))

    def step(self, *args: Any, **kwargs: Any) -> None:
        """The scheduler's ``step``, unless its optimizer took no step since the last one."""
        taken = self.taken()
        if taken == self.seen:
            return
        self.seen = taken
        self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["scheduler"], name)


class SkipFlag:
    """Whether the last optimizer step was skipped, read from ``source.overflow`` when
    asked (so a step decided on the device is not waited for until then).

    Args:
        source: what reports the overflow: a :class:`LoopScaling` or a :class:`mixprec.TrainStep`.
    """

    def __init__(self, source: Any) -> None:
        self.source = source

    def __bool__(self) -> bool:
        return bool(self.source.overflow)

    def __repr__(self) -> str:
        return f"SkipFlag({bool(self)})"


def report_skips(optimizer: Any, source: Any) -> bool:
    """Make an Accelerate ``AcceleratedOptimizer`` report mixprec's skips.

    Accelerate asks ``optimizer.step_was_skipped`` (``accelerator.optimizer_step_was_skipped``,
    the Hugging Face Trainer's learning-rate step, ``AcceleratedScheduler``); it is only
    set by Accelerate's own GradScaler. Returns whether ``optimizer`` is one to tell.
    """
    if not hasattr(optimizer, "step_was_skipped") or not hasattr(optimizer, "_is_overflow"):
        return False
    optimizer._is_overflow = SkipFlag(source)
    return True


class PluginCore:
    """What every framework plugin holds: the validated settings and the loss scaling.

    Args: as :class:`mixprec.lightning.MixedPrecision` (``loss_scale_manager=DEFAULT`` is
    the dtype's default, decided when the model is converted if ``dtype`` is None).
    """

    def __init__(
        self,
        level: str | Level,
        dtype: torch.dtype | str | None,
        fp32_modules: Pins,
        low_modules: Pins,
        loss_scale_manager: LossScaleManager | object | None,
        emulate: bool,
        declared_fp32: bool,
    ) -> None:
        self.settings = PrecisionSettings.parse(
            level, dtype, fp32_modules, low_modules, emulate, declared_fp32
        )
        self.manager_arg = loss_scale_manager
        low = None if self.settings.level is Level.O0 else self.settings.dtype
        self.scaling = LoopScaling(default_manager(loss_scale_manager, low))
        self.converted = False

    def convert_children_(self, module: nn.Module) -> nn.Module:
        """Convert ``module``'s children in place (again: only what is new); returns it."""
        if not self.converted and self.manager_arg is DEFAULT and self.settings.dtype is None:
            # the dtype comes from the device: so does the default manager
            low = self.settings.low_dtype(module)
            self.scaling = LoopScaling(default_manager(DEFAULT, low))
        self.converted = True
        return convert_children_(module, self.settings)


class ScalingReport:
    """What every framework integration reports, by :class:`mixprec.TrainStep`'s names:
    ``overflow``, ``skipped_steps``, ``consecutive_overflows``, ``loss_scale`` and
    ``overflow_module``."""

    core: PluginCore

    @property
    def scaling(self) -> LoopScaling:
        """The loss scaling of this integration's loop."""
        return self.core.scaling

    @property
    def overflow(self) -> bool:
        """Whether the last optimizer step was skipped because its gradients overflowed."""
        return self.scaling.overflow

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because the gradients overflowed."""
        return self.scaling.skipped_steps

    @property
    def consecutive_overflows(self) -> int:
        """Skipped optimizer steps in a row, up to the last one."""
        return self.scaling.consecutive_overflows

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without loss scaling)."""
        return self.scaling.loss_scale

    @property
    def overflow_module(self) -> str | None:
        """At the last skip, the module owning the first parameter (in the optimizer's
        order) whose gradient was inf/NaN (None when not known)."""
        return self.scaling.overflow_module
