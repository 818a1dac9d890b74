"""Loss-scale policies: MindSpore's managers and functional scalers, on one core.

Both families are thin adapters around :class:`~mixprec.training.scale_state.LossScaleState` (the
one implementation of the dynamic rule, its state in tensors on the gradients' device):

* the functional scalers (:class:`StaticLossScaler`, :class:`DynamicLossScaler`) never
  synchronize with the host, for hand-written loops;
* the managers (:class:`FixedLossScaleManager`, :class:`DynamicLossScaleManager`) keep
  MindSpore's API (``get_loss_scale()`` returns a Python float, which reads the device).
  The training step drives their tensor state directly, without a host read.

Every class has ``state_dict``/``load_state_dict`` in one scheme (state as 0-dim tensors,
configuration as numbers), validated before anything is written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from mixprec.training.grads import _inverse_scale, _unscale_grads, to_device
from mixprec.training.scale_state import (
    Check,
    LossScaleState,
    check_bool,
    check_count,
    check_counter_below,
    check_factor,
    check_loss_scale,
    check_steps,
    load_state,
    next_dynamic_scale,
)

__all__ = [
    "DynamicLossScaleManager",
    "DynamicLossScaler",
    "FixedLossScaleManager",
    "LossScaleManager",
    "LossScaler",
    "NoLossScale",
    "StaticLossScaler",
    "next_dynamic_scale",
]

_Scaler = TypeVar("_Scaler", bound="LossScaler")


def _mul_floating(tree: Any, factor: torch.Tensor) -> Any:
    """Multiply every floating tensor in a nested structure by ``factor``, keeping dtypes.

    Low-precision tensors are multiplied in float32: 2**24 is inf in float16.
    """

    def mul(x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            return x
        f = factor if factor.device.type == "cpu" else to_device(factor, x.device)
        return (x.to(torch.promote_types(x.dtype, torch.float32)) * f).to(x.dtype)

    return tree_map_only(torch.Tensor, mul, tree)


class _Adapter:
    """Shared by managers and scalers: a :class:`LossScaleState` and its state dict.

    ``_STATE`` maps state-dict names to the core's tensors (``scale``, ``good_steps``,
    ``bad_steps``); ``_CONFIG`` names configuration attributes (``_<name>``) with checks.
    """

    _STATE: ClassVar[dict[str, str]] = {}
    _CONFIG: ClassVar[dict[str, Check]] = {}
    _core: LossScaleState

    def state_dict(self) -> dict[str, Any]:
        """State entries as 0-dim tensor snapshots, configuration as numbers (no host sync)."""
        state: dict[str, Any] = {
            name: getattr(self._core, part).detach().clone() for name, part in self._STATE.items()
        }
        return state | {name: getattr(self, f"_{name}") for name in self._CONFIG}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load a state dict (numbers or one-element tensors); a bad one changes nothing."""
        checks = {
            name: check_loss_scale if part == "scale" else check_steps
            for name, part in self._STATE.items()
        }
        values = load_state(state, checks | self._CONFIG, type(self).__name__)
        window = values.get("scale_window")
        for name, part in self._STATE.items():
            if part == "good_steps" and window is not None:
                check_counter_below(values[name], name, window)
        for name, part in self._STATE.items():
            getattr(self._core, part).fill_(values[name])
        for name in self._CONFIG:
            setattr(self, f"_{name}", values[name])
        if self._core.dynamic:
            self._core = dataclasses.replace(
                self._core, factor=values["scale_factor"], window=values["scale_window"]
            )


class LossScaler(_Adapter):
    """Base functional scaler: scales nothing and never adjusts (a pass-through).

    Example:
        >>> LossScaler().scale(torch.tensor(2.0))
        tensor(2.)
    """

    def __init__(self) -> None:
        self._core = LossScaleState.create(1.0)

    def scale(self, inputs: Any) -> Any:
        """Multiply every floating tensor in ``inputs`` (any nesting) by the loss scale."""
        return inputs

    def unscale(self, inputs: Any) -> Any:
        """Multiply every floating tensor in ``inputs`` by the reciprocal of the loss scale."""
        return inputs

    def adjust(self, grads_finite: torch.Tensor | bool) -> bool:
        """Update the scale from this step's overflow flag; True if the policy adjusts."""
        return False

    def to(self: _Scaler, device: torch.device | str) -> _Scaler:
        """Move the state tensors to ``device``; returns ``self``."""
        self._core = self._core.to(device)
        return self

    def __repr__(self) -> str:
        args = [f"{name}={getattr(self, f'_{name}')!r}" for name in self._CONFIG]
        if self._STATE:
            args.append(f"device={self._core.scale.device}")
        return f"{type(self).__name__}({', '.join(args)})"


class _TensorScaler(LossScaler):
    """A loss scale held in a 0-dim float32 tensor ``scale_value`` (shared implementation)."""

    _STATE: ClassVar[dict[str, str]] = {"scale_value": "scale"}

    def __init__(self, scale_value: float) -> None:
        self._core = LossScaleState.create(scale_value, name="scale_value")

    @property
    def scale_value(self) -> torch.Tensor:
        """The loss scale, a 0-dim float32 tensor."""
        return self._core.scale

    def scale(self, inputs: Any) -> Any:
        return _mul_floating(inputs, self._core.scale)

    def unscale(self, inputs: Any) -> Any:
        return _mul_floating(inputs, _inverse_scale(self._core.scale))


class StaticLossScaler(_TensorScaler):
    """A constant loss scale; :meth:`adjust` changes nothing and returns False.

    Example:
        >>> scaler = StaticLossScaler(1024)
        >>> scaler.scale(torch.tensor(1.0)), scaler.unscale(torch.tensor(1024.0))
        (tensor(1024.), tensor(1.))
    """


class DynamicLossScaler(_TensorScaler):
    """A loss scale that backs off on overflow and grows after a window of clean steps.

    The state is two 0-dim tensors, ``scale_value`` (float32) and ``counter`` (int32),
    updated in place by :meth:`adjust` with no host sync (the rule is
    :func:`~mixprec.training.scale_state.next_dynamic_scale`; the scale never leaves float32's range).

    Typical use::

        scaler = DynamicLossScaler(2.0**16, scale_factor=2, scale_window=1000)
        for inputs, target in data:
            scaler.scale(loss_fn(model(inputs), target)).backward()
            grads = scaler.unscale([p.grad for p in model.parameters()])
            finite = all_finite(grads)
            scaler.adjust(finite)
            # apply `grads` only where `finite` (torch.where), never via finite.item()

    Example:
        >>> scaler = DynamicLossScaler(1024, scale_factor=2, scale_window=3)
        >>> scaler.adjust(torch.tensor(False)), scaler.scale_value, scaler.counter
        (True, tensor(512.), tensor(0, dtype=torch.int32))
    """

    _STATE: ClassVar[dict[str, str]] = {"scale_value": "scale", "counter": "good_steps"}
    _CONFIG: ClassVar[dict[str, Check]] = {
        "scale_factor": check_factor,
        "scale_window": check_count,
    }

    def __init__(self, scale_value: float, scale_factor: float, scale_window: int) -> None:
        self._core = LossScaleState.create(
            scale_value, scale_factor, scale_window, name="scale_value"
        )
        self._scale_factor = self._core.factor
        self._scale_window = self._core.window

    @property
    def counter(self) -> torch.Tensor:
        """Clean steps since the last change, a 0-dim int32 tensor."""
        return self._core.good_steps

    @property
    def scale_factor(self) -> float:
        return self._scale_factor  # type: ignore[return-value]

    @property
    def scale_window(self) -> int:
        return self._scale_window

    def adjust(self, grads_finite: torch.Tensor | bool) -> bool:
        """Apply the dynamic rule in place (no host sync); returns True (as MindSpore does)."""
        self._core.assign(self._core.adjust(grads_finite))
        return True


class LossScaleManager(_Adapter):
    """Base loss-scale policy for a training step: scale 1, never changes, skips overflows.

    A subclass may override :meth:`get_loss_scale` and :meth:`update_loss_scale` (the
    host API, as in MindSpore); the training step then calls them and reads its overflow
    flag on the host once per step. The built-in managers are driven on the device.

    Example:
        >>> LossScaleManager().get_loss_scale()
        1.0
    """

    _drop_overflow_update: bool = True

    def __init__(self) -> None:
        self._core = LossScaleState.create(1.0)

    @property
    def loss_scale(self) -> float:
        """The current loss scale (reads the device)."""
        return float(self._core.scale)

    @property
    def drop_overflow_update(self) -> bool:
        return self._drop_overflow_update

    def get_loss_scale(self) -> float:
        """The loss scale for the next step (a Python float: reads the device)."""
        return float(self._core.scale)

    def update_loss_scale(self, overflow: bool | torch.Tensor) -> None:
        """Tell the policy whether this step's gradients overflowed (a bool or bool tensor)."""
        self._core.assign(self._core.adjust(_finite_of(overflow)))

    def get_drop_overflow_update(self) -> bool:
        """Whether the step checks for overflow and skips the optimizer step on one."""
        return self._drop_overflow_update

    def device_state(self) -> LossScaleState | None:
        """The tensor state the training step drives without a host sync, or None when a
        subclass overrides the host API (the step then calls it)."""
        own = type(self)
        if (
            own.get_loss_scale is not LossScaleManager.get_loss_scale
            or own.update_loss_scale not in _CORE_UPDATES
        ):
            return None
        return self._core

    def device_states(self) -> list[LossScaleState]:
        """Every tensor state of the policy (what the ranks of a step must hold alike):
        :meth:`device_state`'s, or none for a host-API subclass."""
        state = self.device_state()
        return [] if state is None else [state]

    def _to(self, device: torch.device) -> None:
        self._core = self._core.to(device)

    # ------------------------------------------------------------------ the step's protocol
    # What the training step asks of every manager (each a harmless default here, so
    # Fixed, Dynamic and user subclasses need nothing; GroupLossScaleManager overrides them).
    def check_network(self, network: nn.Module) -> None:
        """Refuse a network this policy cannot scale (before conversion); by default any."""
        del network

    def attach(
        self, network: nn.Module, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()
    ) -> None:
        """Wire the policy into the converted network (``pairs``: (master, low copy)
        Parameters); by default nothing."""
        del network, pairs

    def unscale_step(
        self,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        inverse: torch.Tensor,
        agree: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> torch.Tensor:
        """Unscale one optimizer step's gradients in place; returns its overflow flag (a
        0-dim float32 tensor, no sync). ``grads`` are ``params``' gradients (their local
        shards under FSDP2), ``inverse`` is ``1 / scale``; ``agree`` all-reduces (MAX)
        per-part flags across ranks for a policy that keeps several (None in one process)."""
        del params, agree
        return _unscale_grads(grads, inverse)

    def abandon(self) -> None:
        """A backward was abandoned (an exception, a skip): forget what it recorded."""

    def scale_on(self, device: torch.device) -> torch.Tensor | None:
        """The 0-dim factor the step multiplies the loss by, on ``device`` (None: the loss
        is not multiplied). The device state moves there once; a manager with its own host
        API is asked for a float each step."""
        state = self.device_state()
        if state is None:
            return torch.tensor(float(self.get_loss_scale()), device=device)
        if state.scale.device != device:
            self._to(device)
            state = self._core
        return state.scale

    def decides_on_device(self) -> bool:
        """Whether the step may leave the skip to the device (no host read of the flag)."""
        return self.device_state() is not None

    def after_step(
        self, found: torch.Tensor, chosen: torch.Tensor | None, overflow: Callable[[], bool]
    ) -> None:
        """Apply the rule after an optimizer step (``found``: the agreed overflow flag;
        ``overflow()`` reads it on the host, for a manager with its own host API)."""
        if self.device_state() is None:
            self.update_loss_scale(overflow())
        else:
            self.update_on_device(found, chosen)

    def is_fixed(self) -> bool:
        """A scale that never changes (the overflow-limit message may blame it)."""
        state = self.device_state()
        return state is not None and not state.dynamic

    def update_on_device(self, found: torch.Tensor, chosen: torch.Tensor | None) -> None:
        """Apply the rule after an optimizer step whose agreed overflow flag is ``found``
        (``chosen``: the first scale picked from the gradients, or None). No host sync;
        only called when :meth:`device_state` is not None."""
        state = self.device_state()
        assert state is not None
        if chosen is None:
            state.update_(found)
            return
        finite = found == 0
        after = state.adjust(finite)
        state.assign(dataclasses.replace(after, scale=torch.where(finite, chosen, after.scale)))

    def __repr__(self) -> str:
        parts = {name: float(getattr(self._core, part)) for name, part in self._STATE.items()}
        shown = {
            name: (int(value) if self._STATE[name] != "scale" else value)
            for name, value in parts.items()
        } | {name: getattr(self, f"_{name}") for name in self._CONFIG}
        order = [*self._ORDER] if self._ORDER else list(shown)
        args = ", ".join(f"{name}={shown[name]!r}" for name in order)
        return f"{type(self).__name__}({args})"

    _ORDER: ClassVar[tuple[str, ...]] = ()


def _finite_of(overflow: bool | torch.Tensor) -> bool | torch.Tensor:
    if isinstance(overflow, torch.Tensor):
        if overflow.dtype != torch.bool:
            overflow = overflow != 0
        return ~overflow
    if not isinstance(overflow, (bool, int)):
        raise TypeError(f"overflow must be a bool or a bool tensor; got {overflow!r}")
    return not overflow


class FixedLossScaleManager(LossScaleManager):
    """A constant loss scale.

    With ``drop_overflow_update=True`` a step whose gradients overflow is skipped; with False
    the step neither checks nor skips.

    Example:
        >>> manager = FixedLossScaleManager(128.0)
        >>> manager.update_loss_scale(True)
        >>> manager.get_loss_scale()
        128.0
    """

    _STATE: ClassVar[dict[str, str]] = {"loss_scale": "scale"}
    _CONFIG: ClassVar[dict[str, Check]] = {"drop_overflow_update": check_bool}
    _ORDER = ("loss_scale", "drop_overflow_update")

    def __init__(self, loss_scale: float = 128.0, drop_overflow_update: bool = True) -> None:
        self._core = LossScaleState.create(loss_scale, name="loss_scale")
        self._drop_overflow_update = check_bool(drop_overflow_update, "drop_overflow_update")


class DynamicLossScaleManager(LossScaleManager):
    """MindSpore's dynamic loss scale (state on the gradients' device).

    ``good_steps`` counts clean steps since the start or the last change of the scale,
    ``bad_steps`` consecutive overflows::

        if overflow:                      # the step is skipped
            loss_scale = max(loss_scale / scale_factor, 1)
            good_steps, bad_steps = 0, bad_steps + 1
            if bad_steps > 1000: raise RuntimeError
        else:
            good_steps, bad_steps = good_steps + 1, 0
            if good_steps == scale_window:
                loss_scale *= scale_factor    # unless that leaves float32's range
                good_steps = 0

    Example:
        >>> manager = DynamicLossScaleManager(1024, scale_factor=2, scale_window=3)
        >>> for overflow in (False, False, False):
        ...     manager.update_loss_scale(overflow)
        >>> manager.get_loss_scale()
        2048.0
    """

    #: More consecutive overflows than this raise a RuntimeError.
    MAX_CONSECUTIVE_OVERFLOWS: ClassVar[int] = 1000
    _STATE: ClassVar[dict[str, str]] = {
        "loss_scale": "scale",
        "good_steps": "good_steps",
        "bad_steps": "bad_steps",
    }
    _CONFIG: ClassVar[dict[str, Check]] = {
        "scale_factor": check_factor,
        "scale_window": check_count,
    }
    _ORDER = ("loss_scale", "scale_factor", "scale_window", "good_steps", "bad_steps")

    def __init__(
        self, init_loss_scale: float = 2**24, scale_factor: float = 2, scale_window: int = 2000
    ) -> None:
        self._core = LossScaleState.create(
            init_loss_scale, scale_factor, scale_window, name="init_loss_scale"
        )
        self._scale_factor = self._core.factor
        self._scale_window = self._core.window

    @property
    def scale_factor(self) -> float:
        return self._scale_factor  # type: ignore[return-value]

    @property
    def scale_window(self) -> int:
        return self._scale_window

    @property
    def good_steps(self) -> int:
        """Clean steps since the start or the last change of the scale (reads the device)."""
        return int(self._core.good_steps)

    @property
    def bad_steps(self) -> int:
        """Consecutive overflowing steps (reads the device)."""
        return int(self._core.bad_steps)

    def update_loss_scale(self, overflow: bool | torch.Tensor) -> None:
        """Back off on an overflow, grow after ``scale_window`` clean steps.

        Raises:
            RuntimeError: on the 1001st consecutive overflow.
        """
        super().update_loss_scale(overflow)
        bad = self.bad_steps
        if bad > self.MAX_CONSECUTIVE_OVERFLOWS:
            raise RuntimeError(overflow_limit_message(bad, self.get_loss_scale()))


class NoLossScale(LossScaleManager):
    """No loss scaling: what a step holds without a manager (``loss_scale_manager=None``).

    The loss is not multiplied, the gradients are checked for overflow (a step with
    inf/NaN gradients is skipped) and nothing is ever updated; the step reads it as any
    other manager and shows it as ``step.loss_scale_manager is None``.
    """

    def scale_on(self, device: torch.device) -> torch.Tensor | None:
        return None

    def device_state(self) -> LossScaleState | None:
        return None  # no state for the ranks to agree on

    def decides_on_device(self) -> bool:
        return True

    def after_step(
        self, found: torch.Tensor, chosen: torch.Tensor | None, overflow: Callable[[], bool]
    ) -> None:
        del found, chosen, overflow

    def is_fixed(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "NoLossScale()"


_CORE_UPDATES = (LossScaleManager.update_loss_scale, DynamicLossScaleManager.update_loss_scale)


def overflow_limit_message(count: int, scale: float, *, fixed: bool = False) -> str:
    """The error after too many consecutive overflows: what to check, how to recover.

    With a ``fixed`` scale above 1 the scale itself may be the cause, and the message says so.
    """
    recover = (
        "To recover, fix the cause and call the step again: a clean step resets the count "
        "(or load the last good checkpoint)."
    )
    if fixed and scale > 1:
        return (
            f"the gradients overflowed (inf/NaN) on {count} consecutive steps at the fixed loss "
            f"scale {scale:g}: the scale is the likely cause (the scaled gradients exceed the "
            f"low-precision range, and a FixedLossScaleManager never lowers it). Use a smaller "
            f"FixedLossScaleManager scale, or DynamicLossScaleManager, which backs off by "
            f"itself; if it still overflows at scale 1, check the data and the model for "
            f"inf/NaN. {recover}"
        )
    return (
        f"the gradients overflowed (inf/NaN) on {count} consecutive steps although the loss "
        f"scale is {scale:g}, so the scale is not the cause. Check the data and the model for "
        f"inf/NaN (e.g. log(0), a division by zero), lower the learning rate, or train in "
        f"bfloat16, which has float32's range. {recover}"
    )
