"""Loss scaling: the overflow check, the next-scale rule, host managers and functional scalers.

Two layers. Tensor functions and the functional scalers (:class:`StaticLossScaler`,
:class:`DynamicLossScaler`) keep their state in tensors and never synchronize with the
host, so a step can run ahead of the device. The managers (:class:`FixedLossScaleManager`,
:class:`DynamicLossScaleManager`, MindSpore's API) hold plain Python numbers for a training
step that already reads its overflow flag once per step.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch.utils._pytree import tree_map_only

__all__ = [
    "DynamicLossScaleManager",
    "DynamicLossScaler",
    "FixedLossScaleManager",
    "LossScaleManager",
    "LossScaler",
    "StaticLossScaler",
    "all_finite",
    "inverse_scale",
    "next_dynamic_scale",
    "unscale_grads_",
]

_Scaler = TypeVar("_Scaler", bound="LossScaler")
_Groups = dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]


# --- validation -------------------------------------------------------------------------------


def _check_loss_scale(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number >= 1 (int or float); got {value!r}")
    if not (math.isfinite(value) and value >= 1):
        raise ValueError(f"{name} must be a finite number >= 1; got {value!r}")
    return float(value)


def _check_factor(value: object, name: str = "scale_factor") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number > 1 (int or float); got {value!r}")
    if not (math.isfinite(value) and value > 1):
        raise ValueError(f"{name} must be a finite number > 1; got {value!r}")
    return float(value)


def _check_count(value: object, name: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {minimum} (not a bool); got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}")
    return int(value)


def _check_drop(value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"drop_overflow_update must be a bool (True or False); got {value!r}")
    return value


def _check_state(state: object, expected: Iterable[str], owner: str) -> Mapping[str, Any]:
    if not isinstance(state, Mapping):
        raise TypeError(f"{owner}.load_state_dict: state must be a dict; got {state!r}")
    missing = sorted(set(expected) - set(state))
    unknown = sorted(set(state) - set(expected))
    if missing or unknown:
        raise ValueError(
            f"{owner}.load_state_dict: state has missing keys {missing} and unknown keys "
            f"{unknown}; expected exactly {sorted(expected)}"
        )
    return state


# --- tensor functions (no host sync) ----------------------------------------------------------


def _group(tensors: Iterable[object], argument: str) -> _Groups:
    """Floating, non-empty tensors by (device, dtype); sparse tensors by their values."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    elif isinstance(tensors, Mapping):
        tensors = tensors.values()
    groups: _Groups = {}
    for i, t in enumerate(tensors):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{argument} must hold tensors (or None); item {i} is {t!r}")
        values = t._values() if t.is_sparse else t
        if values.is_floating_point() and values.numel() > 0:
            groups.setdefault((values.device, values.dtype), []).append(values)
    return groups


def all_finite(tensors: Iterable[torch.Tensor | None] | torch.Tensor) -> torch.Tensor:
    """True iff no tensor holds an inf or a NaN, as a 0-dim bool tensor (no host sync).

    Non-floating tensors and ``None`` are ignored; an empty input is finite. The result is
    on the first floating tensor's device (CPU when there is none).

    Example:
        >>> all_finite([torch.ones(2), torch.tensor([1.0, float("nan")])])
        tensor(False)
    """
    groups = _group(tensors, "tensors")
    if not groups:
        return torch.tensor(True)
    flags = []
    with torch.no_grad():
        for group in groups.values():
            # The max-abs norm is inf/NaN iff some element is (its kernels propagate NaN), it
            # cannot overflow for finite inputs (unlike L2), it only reads the tensors, and
            # _foreach_norm fuses a (device, dtype) group into a few launches on CUDA. The AMP
            # check-and-unscale kernel would write every element (bumping version counters and
            # failing on leaves that require grad) for the same answer.
            norms = torch._foreach_norm(group, ord=math.inf)
            flags.append(torch.stack(norms).isfinite().all())
    if len(flags) == 1:
        return flags[0]
    device = flags[0].device
    return torch.stack([f.to(device, non_blocking=True) for f in flags]).all()


def inverse_scale(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` computed in float64 and returned as float32 (as GradScaler does).

    Example:
        >>> inverse_scale(torch.tensor(4.0))
        tensor(0.2500)
    """
    return scale.double().reciprocal().float()


def unscale_grads_(grads: Sequence[torch.Tensor | None], inv_scale: torch.Tensor) -> torch.Tensor:
    """Multiply every gradient by ``inv_scale`` in place; return ``found_inf`` (no host sync).

    Uses the fused ``torch._amp_foreach_non_finite_check_and_unscale_`` once per
    (device, dtype) group. ``None`` entries are skipped; sparse gradients are unscaled
    through their values.

    Args:
        grads: floating gradients, on any devices and in any floating dtypes.
        inv_scale: a one-element tensor, usually :func:`inverse_scale` of the loss scale.

    Returns:
        A 0-dim float32 tensor on ``inv_scale``'s device: 1.0 if any gradient held an inf
        or a NaN, else 0.0.

    Example:
        >>> g = [torch.full((2,), 1024.0)]
        >>> unscale_grads_(g, inverse_scale(torch.tensor(1024.0))), g[0]
        (tensor(0.), tensor([1., 1.]))
    """
    if not isinstance(inv_scale, torch.Tensor) or inv_scale.numel() != 1:
        raise TypeError(f"inv_scale must be a one-element tensor; got {inv_scale!r}")
    for i, g in enumerate(grads):
        if isinstance(g, torch.Tensor) and not g.is_floating_point():
            raise TypeError(f"grads must be floating tensors; grads[{i}] has dtype {g.dtype}")
    inv_scale = inv_scale.reshape(()).float()
    found: dict[torch.device, torch.Tensor] = {}
    invs: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for (device, _), group in _group(grads, "grads").items():
            if device not in found:
                found[device] = torch.zeros((), dtype=torch.float32, device=device)
                invs[device] = inv_scale.to(device, non_blocking=True)
            torch._amp_foreach_non_finite_check_and_unscale_(group, found[device], invs[device])
    home = inv_scale.device
    flags = [f.to(home, non_blocking=True) for f in found.values()]
    if not flags:
        return torch.zeros((), dtype=torch.float32, device=home)
    return flags[0] if len(flags) == 1 else torch.stack(flags).amax()


def next_dynamic_scale(
    scale: torch.Tensor,
    counter: torch.Tensor,
    finite: torch.Tensor | bool,
    factor: float,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dynamic loss-scale rule, on tensors: returns the next ``(scale, counter)``.

    Pure (new tensors; the inputs are not changed) and sync-free (``torch.where``)::

        if finite:
            if counter == window - 1 and isfinite(scale * factor):
                scale = scale * factor
            counter = (counter + 1) % window
        else:
            scale = max(1, scale / factor)
            counter = 0

    Args:
        scale: 0-dim float32 loss scale.
        counter: 0-dim int32 count of clean steps since the last change.
        finite: whether this step's gradients were finite (0-dim bool tensor or bool).
        factor: growth and back-off factor, > 1.
        window: clean steps between growths, >= 1.

    Example:
        >>> next_dynamic_scale(torch.tensor(8.0), torch.tensor(2), True, 2, 3)
        (tensor(16.), tensor(0))
    """
    factor = _check_factor(factor)
    window = _check_count(window, "window", minimum=1)
    if isinstance(finite, torch.Tensor):
        if finite.dtype != torch.bool:
            raise TypeError(
                f"finite must be a bool tensor (True = no overflow); got {finite.dtype}"
            )
        finite = finite.reshape(()).to(scale.device, non_blocking=True)
    else:
        finite = torch.tensor(bool(finite), device=scale.device)
    grown = scale * factor
    grown = torch.where(grown.isfinite(), grown, scale)
    kept = torch.where(counter.to(scale.device) == window - 1, grown, scale)
    new_scale = torch.where(finite, kept, torch.clamp_min(scale / factor, 1.0))
    new_counter = torch.where(finite.to(counter.device), (counter + 1) % window, 0)
    return new_scale, new_counter.to(counter.dtype)


def _mul_floating(tree: Any, factor: torch.Tensor) -> Any:
    """Multiply every floating tensor in a nested structure by ``factor``, keeping dtypes.

    Low-precision tensors are multiplied in float32 so a large scale (2**24 is inf in
    float16) or a tiny inverse never rounds before the product does.
    """

    def mul(x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point():
            return x
        wide = torch.promote_types(x.dtype, torch.float32)
        return (x.to(wide) * factor.to(x.device, non_blocking=True)).to(x.dtype)

    return tree_map_only(torch.Tensor, mul, tree)


# --- functional scalers (state in tensors) ----------------------------------------------------


class LossScaler:
    """Base functional scaler: scales nothing and never adjusts (a harmless pass-through).

    Example:
        >>> LossScaler().scale(torch.tensor(2.0))
        tensor(2.)
    """

    def scale(self, inputs: Any) -> Any:
        """Multiply every floating tensor in ``inputs`` (any nesting) by the loss scale."""
        return inputs

    def unscale(self, inputs: Any) -> Any:
        """Multiply every floating tensor in ``inputs`` by the reciprocal of the loss scale."""
        return inputs

    def adjust(self, grads_finite: torch.Tensor | bool) -> bool:
        """Update the scale for this step's overflow flag; True if the policy adjusts."""
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_state(state, (), type(self).__name__)

    def to(self: _Scaler, device: torch.device | str) -> _Scaler:
        """Move the state tensors to ``device``; returns ``self``."""
        return self


class StaticLossScaler(LossScaler):
    """A constant loss scale.

    Example:
        >>> scaler = StaticLossScaler(1024)
        >>> scaler.scale(torch.tensor(1.0)), scaler.unscale(torch.tensor(1024.0))
        (tensor(1024.), tensor(1.))
    """

    def __init__(self, scale_value: float) -> None:
        self._scale = torch.tensor(_check_loss_scale(scale_value, "scale_value"))
        self._inv = inverse_scale(self._scale)

    @property
    def scale_value(self) -> torch.Tensor:
        """The loss scale, a 0-dim float32 tensor."""
        return self._scale

    def scale(self, inputs: Any) -> Any:
        return _mul_floating(inputs, self._scale)

    def unscale(self, inputs: Any) -> Any:
        return _mul_floating(inputs, self._inv)

    def state_dict(self) -> dict[str, Any]:
        return {"scale_value": self._scale.detach().clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = _check_state(state, ("scale_value",), type(self).__name__)
        self._scale.copy_(torch.as_tensor(state["scale_value"]).reshape(()))
        self._inv = inverse_scale(self._scale)

    def to(self, device: torch.device | str) -> StaticLossScaler:
        self._scale, self._inv = self._scale.to(device), self._inv.to(device)
        return self

    def __repr__(self) -> str:
        return f"StaticLossScaler(device={self._scale.device})"


class DynamicLossScaler(LossScaler):
    """A loss scale that backs off on overflow and grows after a window of clean steps.

    It looks for the largest scale that keeps gradients finite. The state is two 0-dim
    tensors updated in place, with no host sync (:func:`next_dynamic_scale`)::

        scale_value, counter = init, 0
        for step in range(num_steps):
            grads = backward(loss * scale_value) / scale_value
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
            loss = loss_fn(model(inputs), target)
            scaler.scale(loss).backward()
            grads = scaler.unscale([p.grad for p in model.parameters()])
            finite = all_finite(grads)
            scaler.adjust(finite)
            # apply `grads` only where `finite` (e.g. torch.where), never via finite.item()

    Example:
        >>> scaler = DynamicLossScaler(1024, scale_factor=2, scale_window=3)
        >>> scaler.adjust(torch.tensor(False)), scaler.scale_value, scaler.counter
        (True, tensor(512.), tensor(0, dtype=torch.int32))
    """

    def __init__(self, scale_value: float, scale_factor: float, scale_window: int) -> None:
        self._scale = torch.tensor(_check_loss_scale(scale_value, "scale_value"))
        self._counter = torch.zeros((), dtype=torch.int32)
        self._factor = _check_factor(scale_factor)
        self._window = _check_count(scale_window, "scale_window", minimum=1)

    @property
    def scale_value(self) -> torch.Tensor:
        """The loss scale, a 0-dim float32 tensor (updated in place)."""
        return self._scale

    @property
    def counter(self) -> torch.Tensor:
        """Clean steps since the last change, a 0-dim int32 tensor (updated in place)."""
        return self._counter

    @property
    def scale_factor(self) -> float:
        return self._factor

    @property
    def scale_window(self) -> int:
        return self._window

    def scale(self, inputs: Any) -> Any:
        return _mul_floating(inputs, self._scale)

    def unscale(self, inputs: Any) -> Any:
        return _mul_floating(inputs, inverse_scale(self._scale))

    def adjust(self, grads_finite: torch.Tensor | bool) -> bool:
        """Apply :func:`next_dynamic_scale` in place; returns True (as MindSpore does)."""
        scale, counter = next_dynamic_scale(
            self._scale, self._counter, grads_finite, self._factor, self._window
        )
        self._scale.copy_(scale)
        self._counter.copy_(counter)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale_value": self._scale.detach().clone(),
            "counter": self._counter.detach().clone(),
            "scale_factor": self._factor,
            "scale_window": self._window,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        keys = ("scale_value", "counter", "scale_factor", "scale_window")
        state = _check_state(state, keys, type(self).__name__)
        factor = _check_factor(state["scale_factor"])
        window = _check_count(state["scale_window"], "scale_window", minimum=1)
        self._scale.copy_(torch.as_tensor(state["scale_value"]).reshape(()))
        self._counter.copy_(torch.as_tensor(state["counter"]).reshape(()))
        self._factor, self._window = factor, window

    def to(self, device: torch.device | str) -> DynamicLossScaler:
        self._scale, self._counter = self._scale.to(device), self._counter.to(device)
        return self

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(scale_factor={self._factor}, scale_window={self._window}, "
            f"device={self._scale.device})"
        )


# --- host-side managers (MindSpore API, plain Python numbers) ---------------------------------


class LossScaleManager:
    """Base loss-scale policy for a training step: scale 1, never changes, skips overflows.

    Example:
        >>> LossScaleManager().get_loss_scale()
        1.0
    """

    def get_loss_scale(self) -> float:
        """The loss scale for the next step."""
        return 1.0

    def update_loss_scale(self, overflow: bool) -> None:
        """Tell the policy whether this step's gradients overflowed."""

    def get_drop_overflow_update(self) -> bool:
        """Whether the step must check for overflow and skip the optimizer step on one."""
        return True

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_state(state, (), type(self).__name__)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FixedLossScaleManager(LossScaleManager):
    """A constant loss scale.

    With ``drop_overflow_update=True`` a step that overflows is skipped; with False the
    step never checks and always applies the update.

    Example:
        >>> manager = FixedLossScaleManager(128.0)
        >>> manager.update_loss_scale(True)
        >>> manager.get_loss_scale()
        128.0
    """

    def __init__(self, loss_scale: float = 128.0, drop_overflow_update: bool = True) -> None:
        self._loss_scale = _check_loss_scale(loss_scale, "loss_scale")
        self._drop = _check_drop(drop_overflow_update)

    @property
    def loss_scale(self) -> float:
        return self._loss_scale

    @property
    def drop_overflow_update(self) -> bool:
        return self._drop

    def get_loss_scale(self) -> float:
        return self._loss_scale

    def get_drop_overflow_update(self) -> bool:
        return self._drop

    def state_dict(self) -> dict[str, Any]:
        return {"loss_scale": self._loss_scale, "drop_overflow_update": self._drop}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = _check_state(state, ("loss_scale", "drop_overflow_update"), type(self).__name__)
        loss_scale = _check_loss_scale(state["loss_scale"], "loss_scale")
        self._drop = _check_drop(state["drop_overflow_update"])
        self._loss_scale = loss_scale

    def __repr__(self) -> str:
        return (
            f"FixedLossScaleManager(loss_scale={self._loss_scale}, "
            f"drop_overflow_update={self._drop})"
        )


class DynamicLossScaleManager(LossScaleManager):
    """MindSpore's dynamic loss scale, on the host.

    ``good_steps`` counts clean steps since the start or the last change of the scale,
    ``bad_steps`` consecutive overflows::

        if overflow:
            loss_scale = max(loss_scale / scale_factor, 1)   # and the step is skipped
            good_steps, bad_steps = 0, bad_steps + 1
            if bad_steps > 1000: raise RuntimeError
        else:
            good_steps, bad_steps = good_steps + 1, 0
            if good_steps == scale_window:
                loss_scale *= scale_factor                   # unless that is inf
                good_steps = 0

    Example:
        >>> manager = DynamicLossScaleManager(1024, scale_factor=2, scale_window=3)
        >>> for overflow in (False, False, False):
        ...     manager.update_loss_scale(overflow)
        >>> manager.get_loss_scale()
        2048.0
    """

    #: More consecutive overflows than this raise a RuntimeError.
    MAX_CONSECUTIVE_OVERFLOWS = 1000

    def __init__(
        self, init_loss_scale: float = 2**24, scale_factor: float = 2, scale_window: int = 2000
    ) -> None:
        self._loss_scale = _check_loss_scale(init_loss_scale, "init_loss_scale")
        self._factor = _check_factor(scale_factor)
        self._window = _check_count(scale_window, "scale_window", minimum=1)
        self._good_steps = 0
        self._bad_steps = 0

    @property
    def loss_scale(self) -> float:
        return self._loss_scale

    @property
    def scale_factor(self) -> float:
        return self._factor

    @property
    def scale_window(self) -> int:
        return self._window

    @property
    def good_steps(self) -> int:
        """Clean steps since the start or the last change of the scale."""
        return self._good_steps

    @property
    def bad_steps(self) -> int:
        """Consecutive overflowing steps."""
        return self._bad_steps

    def get_loss_scale(self) -> float:
        return self._loss_scale

    def update_loss_scale(self, overflow: bool) -> None:
        """Back off on overflow, grow after ``scale_window`` clean steps.

        Raises:
            RuntimeError: after more than 1000 consecutive overflows.
        """
        if overflow:
            self._loss_scale = max(self._loss_scale / self._factor, 1.0)
            self._good_steps = 0
            self._bad_steps += 1
            if self._bad_steps > self.MAX_CONSECUTIVE_OVERFLOWS:
                raise RuntimeError(
                    f"DynamicLossScaleManager: the gradients overflowed (inf/NaN) on "
                    f"{self._bad_steps} consecutive steps and the loss scale is down to "
                    f"{self._loss_scale}, so scaling cannot be the cause. Check the data and "
                    f"the model for inf/NaN (e.g. log(0), division by zero), lower the "
                    f"learning rate, or train in bfloat16, which has float32's range."
                )
            return
        self._bad_steps = 0
        self._good_steps += 1
        if self._good_steps >= self._window:
            grown = self._loss_scale * self._factor
            if math.isfinite(grown):
                self._loss_scale = grown
            self._good_steps = 0

    def get_drop_overflow_update(self) -> bool:
        return True

    def state_dict(self) -> dict[str, Any]:
        return {
            "loss_scale": self._loss_scale,
            "scale_factor": self._factor,
            "scale_window": self._window,
            "good_steps": self._good_steps,
            "bad_steps": self._bad_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        keys = ("loss_scale", "scale_factor", "scale_window", "good_steps", "bad_steps")
        state = _check_state(state, keys, type(self).__name__)
        loss_scale = _check_loss_scale(state["loss_scale"], "loss_scale")
        factor = _check_factor(state["scale_factor"])
        window = _check_count(state["scale_window"], "scale_window", minimum=1)
        good = _check_count(state["good_steps"], "good_steps", minimum=0)
        bad = _check_count(state["bad_steps"], "bad_steps", minimum=0)
        self._loss_scale, self._factor, self._window = loss_scale, factor, window
        self._good_steps, self._bad_steps = good, bad

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaleManager(loss_scale={self._loss_scale}, "
            f"scale_factor={self._factor}, scale_window={self._window}, "
            f"good_steps={self._good_steps}, bad_steps={self._bad_steps})"
        )
