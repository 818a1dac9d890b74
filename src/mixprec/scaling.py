"""Loss scaling: the next-scale rule, host managers and functional scalers.

Two layers. The tensor functions and the functional scalers (:class:`StaticLossScaler`,
:class:`DynamicLossScaler`) keep their state in tensors and never synchronize with the host,
so a step can run ahead of the device. The managers (:class:`FixedLossScaleManager`,
:class:`DynamicLossScaleManager`, MindSpore's API) hold plain Python numbers, for a training
step that already reads its overflow flag once per step.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, TypeVar

import torch
from torch.utils._pytree import tree_map_only

from mixprec.grads import inverse_scale, to_device

__all__ = [
    "DynamicLossScaleManager",
    "DynamicLossScaler",
    "FixedLossScaleManager",
    "LossScaleManager",
    "LossScaler",
    "StaticLossScaler",
    "next_dynamic_scale",
]

_Scaler = TypeVar("_Scaler", bound="LossScaler")
_Check = Callable[[object, str], Any]  # (value, argument name) -> the validated value


def _check_number(value: object, name: str, *, low: float, strict: bool = False) -> float:
    bound = f"{'>' if strict else '>='} {low:g}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number {bound} (int or float); got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < low or (strict and number == low):
        raise ValueError(f"{name} must be a finite number {bound}; got {value!r}")
    return number


_check_loss_scale = functools.partial(_check_number, low=1)
_check_factor = functools.partial(_check_number, low=1, strict=True)


def _check_count(value: object, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {minimum} (not a bool); got {value!r}")
    if int(value) < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}")
    return int(value)


_check_steps = functools.partial(_check_count, minimum=0)


def _check_bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False); got {value!r}")
    return value


def _check_state(state: object, expected: Iterable[str], owner: str) -> Mapping[str, Any]:
    if not isinstance(state, Mapping):
        raise TypeError(f"{owner}.load_state_dict: state must be a dict; got {state!r}")
    missing, unknown = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unknown:
        raise ValueError(
            f"{owner}.load_state_dict: state has missing keys {missing} and unknown keys "
            f"{unknown}; expected exactly {sorted(expected)}"
        )
    return state


def next_dynamic_scale(
    scale: torch.Tensor,
    counter: torch.Tensor,
    finite: torch.Tensor | bool,
    factor: float,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dynamic loss-scale rule on tensors: returns the next ``(scale, counter)``.

    Pure (new tensors, inputs unchanged) and sync-free (``torch.where``, never ``if``)::

        if finite:
            if counter == window - 1 and isfinite(scale * factor):
                scale = scale * factor
            counter = (counter + 1) % window
        else:
            scale = max(1, scale / factor)
            counter = 0

    ``scale`` is 0-dim float32, ``counter`` 0-dim int32 (clean steps since the last change),
    ``finite`` a 0-dim bool tensor or a bool (True: no inf/NaN this step).

    Example:
        >>> next_dynamic_scale(torch.tensor(8.0), torch.tensor(2), True, 2, 3)
        (tensor(16.), tensor(0))
    """
    factor = _check_factor(factor, "factor")
    window = _check_count(window, "window")
    grown = scale * factor
    grown = torch.where(grown.isfinite() & (counter == window - 1), grown, scale)
    backed_off = torch.clamp_min(scale / factor, 1.0)
    if isinstance(finite, bool):  # known on the host: pick the branch here
        return (grown, (counter + 1) % window) if finite else (backed_off, counter.new_zeros(()))
    if not isinstance(finite, torch.Tensor) or finite.dtype != torch.bool:
        got = finite.dtype if isinstance(finite, torch.Tensor) else repr(finite)  # no tensor repr
        raise TypeError(f"finite must be a bool or a bool tensor (True = no overflow); got {got}")
    finite = to_device(finite.reshape(()), scale.device)
    new_counter = torch.where(finite, (counter + 1) % window, counter.new_zeros(()))
    return torch.where(finite, grown, backed_off), new_counter


def _mul_floating(tree: Any, factor: torch.Tensor) -> Any:
    """Multiply every floating tensor in a nested structure by ``factor``, keeping dtypes.

    Low-precision tensors are multiplied in float32: 2**24 is inf in float16.
    """

    def mul(x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            return x
        f = (
            factor if factor.device.type == "cpu" else to_device(factor, x.device)
        )  # CPU 0-dim: scalar
        return (x.to(torch.promote_types(x.dtype, torch.float32)) * f).to(x.dtype)

    return tree_map_only(torch.Tensor, mul, tree)


class LossScaler:
    """Base functional scaler: scales nothing and never adjusts (a pass-through).

    Subclasses name their state: ``_TENSORS`` (0-dim tensors, attributes ``_<name>``) and
    ``_CONFIG`` (numbers, with validators); ``state_dict``, ``load_state_dict``, ``to`` and
    ``repr`` cover exactly those, with no host sync.

    Example:
        >>> LossScaler().scale(torch.tensor(2.0))
        tensor(2.)
    """

    _TENSORS: ClassVar[tuple[str, ...]] = ()
    _CONFIG: ClassVar[dict[str, _Check]] = {}

    def scale(self, inputs: Any) -> Any:
        """Multiply every floating tensor in ``inputs`` (any nesting) by the loss scale."""
        return inputs

    def unscale(self, inputs: Any) -> Any:
        """Multiply every floating tensor in ``inputs`` by the reciprocal of the loss scale."""
        return inputs

    def adjust(self, grads_finite: torch.Tensor | bool) -> bool:
        """Update the scale from this step's overflow flag; True if the policy adjusts."""
        return False

    def state_dict(self) -> dict[str, Any]:
        state = {name: getattr(self, f"_{name}").detach().clone() for name in self._TENSORS}
        return state | {name: getattr(self, f"_{name}") for name in self._CONFIG}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = _check_state(state, (*self._TENSORS, *self._CONFIG), type(self).__name__)
        config = {name: check(state[name], name) for name, check in self._CONFIG.items()}
        for name in self._TENSORS:
            getattr(self, f"_{name}").copy_(torch.as_tensor(state[name]).reshape(()))
        for name, value in config.items():
            setattr(self, f"_{name}", value)

    def to(self: _Scaler, device: torch.device | str) -> _Scaler:
        """Move the state tensors to ``device``; returns ``self``."""
        for name in self._TENSORS:
            setattr(self, f"_{name}", getattr(self, f"_{name}").to(device))
        return self

    def __repr__(self) -> str:
        args = [f"{name}={getattr(self, f'_{name}')!r}" for name in self._CONFIG]
        if self._TENSORS:
            args.append(f"device={getattr(self, f'_{self._TENSORS[0]}').device}")
        return f"{type(self).__name__}({', '.join(args)})"


class _TensorScaler(LossScaler):
    """A loss scale held in a 0-dim float32 tensor ``scale_value`` (shared implementation)."""

    _TENSORS: ClassVar[tuple[str, ...]] = ("scale_value",)

    def __init__(self, scale_value: float) -> None:
        self._scale_value = torch.tensor(_check_loss_scale(scale_value, "scale_value"))

    @property
    def scale_value(self) -> torch.Tensor:
        """The loss scale, a 0-dim float32 tensor."""
        return self._scale_value

    def scale(self, inputs: Any) -> Any:
        return _mul_floating(inputs, self._scale_value)

    def unscale(self, inputs: Any) -> Any:
        return _mul_floating(inputs, inverse_scale(self._scale_value))


class StaticLossScaler(_TensorScaler):
    """A constant loss scale; :meth:`adjust` changes nothing and returns False.

    Example:
        >>> scaler = StaticLossScaler(1024)
        >>> scaler.scale(torch.tensor(1.0)), scaler.unscale(torch.tensor(1024.0))
        (tensor(1024.), tensor(1.))
    """


class DynamicLossScaler(_TensorScaler):
    """A loss scale that backs off on overflow and grows after a window of clean steps.

    It looks for the largest scale that keeps the gradients finite. The state is two 0-dim
    tensors, ``scale_value`` (float32) and ``counter`` (int32), updated in place by
    :meth:`adjust` with no host sync (see :func:`next_dynamic_scale`)::

        scale_value, counter = init, 0
        for step in range(num_steps):
            grads = grad(loss * scale_value) / scale_value
            if all_finite(grads):
                if counter == scale_window - 1 and isfinite(scale_value * scale_factor):
                    scale_value *= scale_factor
                counter = (counter + 1) % scale_window
            else:
                scale_value = max(1, scale_value / scale_factor)
                counter = 0

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

    _TENSORS = ("scale_value", "counter")
    _CONFIG: ClassVar[dict[str, _Check]] = {
        "scale_factor": _check_factor,
        "scale_window": _check_count,
    }

    def __init__(self, scale_value: float, scale_factor: float, scale_window: int) -> None:
        super().__init__(scale_value)
        self._counter = torch.zeros((), dtype=torch.int32)
        self._scale_factor = _check_factor(scale_factor, "scale_factor")
        self._scale_window = _check_count(scale_window, "scale_window")

    @property
    def counter(self) -> torch.Tensor:
        """Clean steps since the last change, a 0-dim int32 tensor."""
        return self._counter

    @property
    def scale_factor(self) -> float:
        return self._scale_factor

    @property
    def scale_window(self) -> int:
        return self._scale_window

    def adjust(self, grads_finite: torch.Tensor | bool) -> bool:
        """Apply :func:`next_dynamic_scale` in place; returns True (as MindSpore does)."""
        scale, counter = next_dynamic_scale(
            self._scale_value, self._counter, grads_finite, self._scale_factor, self._scale_window
        )
        self._scale_value.copy_(scale)
        self._counter.copy_(counter)
        return True


class LossScaleManager:
    """Base loss-scale policy for a training step: scale 1, never changes, skips overflows.

    Subclasses list their state in ``_FIELDS`` (name -> validator; attributes ``_<name>``);
    ``state_dict``, ``load_state_dict`` and ``repr`` cover exactly those fields.

    Example:
        >>> LossScaleManager().get_loss_scale()
        1.0
    """

    _FIELDS: ClassVar[dict[str, _Check]] = {}
    _loss_scale: float = 1.0
    _drop_overflow_update: bool = True

    @property
    def loss_scale(self) -> float:
        return self._loss_scale

    @property
    def drop_overflow_update(self) -> bool:
        return self._drop_overflow_update

    def get_loss_scale(self) -> float:
        """The loss scale for the next step."""
        return self._loss_scale

    def update_loss_scale(self, overflow: bool) -> None:
        """Tell the policy whether this step's gradients overflowed."""

    def get_drop_overflow_update(self) -> bool:
        """Whether the step checks for overflow and skips the optimizer step on one."""
        return self._drop_overflow_update

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self, f"_{name}") for name in self._FIELDS}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = _check_state(state, self._FIELDS, type(self).__name__)
        values = {name: check(state[name], name) for name, check in self._FIELDS.items()}
        for name, value in values.items():  # all validated first: a bad state changes nothing
            setattr(self, f"_{name}", value)

    def __repr__(self) -> str:
        args = ", ".join(f"{name}={value!r}" for name, value in self.state_dict().items())
        return f"{type(self).__name__}({args})"


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

    _FIELDS: ClassVar[dict[str, _Check]] = {
        "loss_scale": _check_loss_scale,
        "drop_overflow_update": _check_bool,
    }

    def __init__(self, loss_scale: float = 128.0, drop_overflow_update: bool = True) -> None:
        self._loss_scale = _check_loss_scale(loss_scale, "loss_scale")
        self._drop_overflow_update = _check_bool(drop_overflow_update, "drop_overflow_update")


class DynamicLossScaleManager(LossScaleManager):
    """MindSpore's dynamic loss scale, on the host.

    ``good_steps`` counts clean steps since the start or the last change of the scale,
    ``bad_steps`` consecutive overflows::

        if overflow:                      # the step is skipped
            loss_scale = max(loss_scale / scale_factor, 1)
            good_steps, bad_steps = 0, bad_steps + 1
            if bad_steps > 1000: raise RuntimeError
        else:
            good_steps, bad_steps = good_steps + 1, 0
            if good_steps == scale_window:
                loss_scale *= scale_factor    # unless that is inf
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
    _FIELDS: ClassVar[dict[str, _Check]] = {
        "loss_scale": _check_loss_scale,
        "scale_factor": _check_factor,
        "scale_window": _check_count,
        "good_steps": _check_steps,
        "bad_steps": _check_steps,
    }

    def __init__(
        self, init_loss_scale: float = 2**24, scale_factor: float = 2, scale_window: int = 2000
    ) -> None:
        self._loss_scale = _check_loss_scale(init_loss_scale, "init_loss_scale")
        self._scale_factor = _check_factor(scale_factor, "scale_factor")
        self._scale_window = _check_count(scale_window, "scale_window")
        self._good_steps = 0
        self._bad_steps = 0

    @property
    def scale_factor(self) -> float:
        return self._scale_factor

    @property
    def scale_window(self) -> int:
        return self._scale_window

    @property
    def good_steps(self) -> int:
        """Clean steps since the start or the last change of the scale."""
        return self._good_steps

    @property
    def bad_steps(self) -> int:
        """Consecutive overflowing steps."""
        return self._bad_steps

    def update_loss_scale(self, overflow: bool) -> None:
        """Back off on an overflow, grow after ``scale_window`` clean steps.

        Raises:
            RuntimeError: on the 1001st consecutive overflow.
        """
        if not overflow:
            self._bad_steps, self._good_steps = 0, self._good_steps + 1
            if self._good_steps >= self._scale_window:
                grown = self._loss_scale * self._scale_factor
                self._loss_scale = grown if math.isfinite(grown) else self._loss_scale
                self._good_steps = 0
            return
        self._loss_scale = max(self._loss_scale / self._scale_factor, 1.0)
        self._good_steps, self._bad_steps = 0, self._bad_steps + 1
        if self._bad_steps > self.MAX_CONSECUTIVE_OVERFLOWS:
            raise RuntimeError(
                f"DynamicLossScaleManager: the gradients overflowed (inf/NaN) on "
                f"{self._bad_steps} consecutive steps although the loss scale is down to "
                f"{self._loss_scale}, so the scale is not the cause. Check the data and the "
                f"model for inf/NaN (e.g. log(0), a division by zero), lower the learning rate, "
                f"or train in bfloat16, which has float32's range."
            )
