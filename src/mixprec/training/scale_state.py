"""The loss-scale core: one dynamic rule, its state in tensors, one validated state scheme.

Every loss scale in mixprec (the managers, the functional scalers, the training step) is a
:class:`LossScaleState`: three 0-dim tensors on the gradients' device and a frozen rule.
:meth:`LossScaleState.adjust` returns the next state from this step's ``finite`` flag
without a host sync (``torch.where``, never ``if``), as jmp's loss scales do::

    if finite:
        good_steps, bad_steps = good_steps + 1, 0
        if dynamic and good_steps == window:
            if isfinite(float32(scale * factor)):   # capped: float32's max is the ceiling
                scale = scale * factor
            good_steps = 0
    else:
        good_steps, bad_steps = 0, bad_steps + 1
        if dynamic:
            scale = max(1, scale / factor)

A fixed scale (``factor=None``) never changes but counts its steps the same way.

State dicts: state entries are 0-dim tensors, configuration entries Python numbers.
:func:`load_state` accepts a Python number or a one-element tensor for every entry (so the
plain numbers written by 0.1.0 load), and checks every key, type, shape and range before
anything is written: a bad state changes nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

__all__ = ["FLOAT32_MAX", "LossScaleState", "load_state", "next_dynamic_scale"]

#: The largest loss scale: the scale is a float32 tensor.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)

Check = Callable[[object, str], Any]  # (value, argument name) -> the validated value

#: devices with GradScaler's fused scale-update kernel
_FUSED_UPDATE_DEVICES = ("cpu", "cuda")


def check_number(value: object, name: str, *, low: float, strict: bool = False) -> float:
    """A finite real number ``>= low`` (``> low`` with ``strict``)."""
    bound = f"{'>' if strict else '>='} {low:g}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number {bound} (int or float); got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < low or (strict and number == low):
        raise ValueError(f"{name} must be a finite number {bound}; got {value!r}")
    return number


def check_loss_scale(value: object, name: str) -> float:
    """A loss scale: a finite number in ``[1, float32 max]``."""
    number = check_number(value, name, low=1)
    if number > FLOAT32_MAX:
        raise ValueError(
            f"{name} must be at most {FLOAT32_MAX:g} (float32's max: the scale is held in "
            f"float32); got {value!r}"
        )
    return number


check_factor = functools.partial(check_number, low=1, strict=True)


def check_count(value: object, name: str, minimum: int = 1) -> int:
    """An int ``>= minimum`` (a bool is refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {minimum} (not a bool); got {value!r}")
    if int(value) < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}")
    return int(value)


check_steps = functools.partial(check_count, minimum=0)


def check_bool(value: object, name: str) -> bool:
    """A bool (True or False; 1 and 0 are refused)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False); got {value!r}")
    return value


def _finite_flag(finite: object, device: torch.device) -> torch.Tensor | bool:
    """``finite`` as a Python bool or a 0-dim bool tensor on ``device``."""
    if isinstance(finite, bool):
        return finite
    if not isinstance(finite, torch.Tensor) or finite.dtype != torch.bool:
        got = finite.dtype if isinstance(finite, torch.Tensor) else repr(finite)  # no tensor repr
        raise TypeError(f"finite must be a bool or a bool tensor (True = no overflow); got {got}")
    if finite.numel() != 1:
        raise ValueError(
            f"finite must be a single flag (a 0-dim or one-element bool tensor, True = no "
            f"overflow); got a tensor of shape {tuple(finite.shape)}: reduce it with "
            f"mixprec.all_finite(grads) or flags.all()"
        )
    return finite.reshape(()).to(device, non_blocking=device.type != "cpu")


def next_dynamic_scale(
    scale: torch.Tensor,
    counter: torch.Tensor,
    finite: torch.Tensor | bool,
    factor: float,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dynamic loss-scale rule on tensors: returns the next ``(scale, counter)``.

    Pure (new tensors, inputs unchanged) and sync-free. ``counter`` counts clean steps
    since the last change; the scale grows on the ``window``-th one unless that leaves
    float32's range, and backs off to ``max(1, scale / factor)`` on an overflow.

    Example:
        >>> next_dynamic_scale(torch.tensor(8.0), torch.tensor(2), True, 2, 3)
        (tensor(16.), tensor(0))
    """
    factor = check_factor(factor, "factor")
    window = check_count(window, "window")
    flag = _finite_flag(finite, scale.device)
    counted = counter + 1
    due = counted >= window
    grown = scale * factor
    grown = torch.where(grown.isfinite() & due, grown, scale)
    clean_counter = torch.where(due, torch.zeros_like(counter), counted)
    backed_off = torch.clamp_min(scale / factor, 1.0)
    if isinstance(flag, bool):  # known on the host: pick the branch here
        return (grown, clean_counter) if flag else (backed_off, torch.zeros_like(counter))
    return (
        torch.where(flag, grown, backed_off),
        torch.where(flag, clean_counter, torch.zeros_like(counter)),
    )


@dataclasses.dataclass(frozen=True)
class LossScaleState:
    """A loss scale and its counters, as 0-dim tensors on one device (jmp-shaped).

    Attributes:
        scale: float32, in ``[1, float32 max]``.
        good_steps: int32, clean steps since the start or the last change of the scale.
        bad_steps: int32, consecutive overflowing steps.
        factor: growth and back-off factor; None for a fixed scale.
        window: clean steps before the scale grows (dynamic only).

    Example:
        >>> state = LossScaleState.create(1024.0, factor=2, window=3)
        >>> state.adjust(torch.tensor(False)).scale
        tensor(512.)
    """

    scale: torch.Tensor
    good_steps: torch.Tensor
    bad_steps: torch.Tensor
    factor: float | None = None
    window: int = 1

    @classmethod
    def create(
        cls,
        scale: float,
        factor: float | None = None,
        window: int = 1,
        *,
        name: str = "loss_scale",
        device: torch.device | str = "cpu",
    ) -> LossScaleState:
        """A fresh state (counters zero); ``name`` is the argument named in errors."""
        value = check_loss_scale(scale, name)
        zero = torch.zeros((), dtype=torch.int32, device=device)
        return cls(
            torch.tensor(value, dtype=torch.float32, device=device),
            zero,
            zero.clone(),
            None if factor is None else check_factor(factor, "scale_factor"),
            check_count(window, "scale_window"),
        )

    @property
    def dynamic(self) -> bool:
        return self.factor is not None

    def adjust(self, finite: torch.Tensor | bool) -> LossScaleState:
        """The next state after a step whose gradients were ``finite`` (no host sync)."""
        if self.factor is not None:
            scale, good = next_dynamic_scale(
                self.scale, self.good_steps, finite, self.factor, self.window
            )
        else:
            scale, good = (
                self.scale,
                torch.where(_as_tensor_flag(finite, self.scale.device), self.good_steps + 1, 0).to(
                    torch.int32
                ),
            )
        flag = _as_tensor_flag(finite, self.scale.device)
        bad = torch.where(flag, 0, self.bad_steps + 1).to(torch.int32)
        return dataclasses.replace(self, scale=scale, good_steps=good, bad_steps=bad)

    def to(self, device: torch.device | str) -> LossScaleState:
        """The same state on ``device`` (a no-op when it is already there)."""
        device = torch.device(device)
        if self.scale.device == device:
            return self
        move = functools.partial(torch.Tensor.to, device=device, non_blocking=True)
        return dataclasses.replace(
            self,
            scale=move(self.scale),
            good_steps=move(self.good_steps),
            bad_steps=move(self.bad_steps),
        )

    def update_(self, found: torch.Tensor) -> None:
        """``assign(adjust(found == 0))`` in a few fused kernels (no host sync): ``found`` is
        a step's overflow flag, a 0-dim float32 tensor (nonzero = overflow).

        A dynamic scale whose factor is a power of two takes GradScaler's kernel
        (``torch._amp_update_scale_``: back-off by the factor's exact reciprocal, growth on
        the window's clean step unless it leaves float32's range), then the floor of 1;
        every other rule goes through :meth:`adjust`. The result is bit for bit
        :meth:`adjust`'s."""
        if found.device != self.scale.device:
            found = found.to(self.scale.device, non_blocking=True)
        overflow = found != 0
        if self.factor is None:  # fixed: only the counters move
            self.good_steps.add_(1).mul_(~overflow)
        elif (
            math.frexp(self.factor)[0] == 0.5
            and found.dtype == torch.float32
            and self.scale.device.type in _FUSED_UPDATE_DEVICES
        ):
            torch._amp_update_scale_(
                self.scale, self.good_steps, found, self.factor, 1.0 / self.factor, self.window
            )
            self.scale.clamp_min_(1.0)
        else:
            self.assign(self.adjust(~overflow))
            return
        self.bad_steps.add_(1).mul_(overflow)

    def assign(self, other: LossScaleState) -> None:
        """Write ``other``'s tensors into this state's tensors, in place."""
        self.scale.copy_(other.scale)
        self.good_steps.copy_(other.good_steps)
        self.bad_steps.copy_(other.bad_steps)


def _as_tensor_flag(finite: torch.Tensor | bool, device: torch.device) -> torch.Tensor:
    flag = _finite_flag(finite, device)
    return torch.tensor(flag, device=device) if isinstance(flag, bool) else flag


# ---------------------------------------------------------------- the state-dict scheme


def _one_number(value: object, name: str, owner: str) -> object:
    """A one-element tensor becomes a Python number (a host read: loading is rare)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"{owner}.load_state_dict: {name} must be a number or a one-element tensor; "
                f"got a tensor of shape {tuple(value.shape)}"
            )
        return value.item()
    return value


def load_state(
    state: object,
    fields: Mapping[str, Check],
    owner: str,
) -> dict[str, Any]:
    """Validate a state dict against ``fields`` (name -> check); returns plain values.

    Raises:
        TypeError: ``state`` is not a dict, or an entry has the wrong type.
        ValueError: missing or unknown keys, a tensor with more than one element, or a
            value out of range (a scale <= 0, NaN or inf, a negative counter).
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"{owner}.load_state_dict: state must be a dict; got {state!r}")
    _check_keys(state, fields, owner)
    return {
        name: check(_one_number(state[name], name, owner), name) for name, check in fields.items()
    }


def _check_keys(state: Mapping[str, Any], expected: Iterable[str], owner: str) -> None:
    missing, unknown = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unknown:
        raise ValueError(
            f"{owner}.load_state_dict: state has missing keys {missing} and unknown keys "
            f"{unknown}; expected exactly {sorted(expected)}"
        )


def check_counter_below(value: int, name: str, window: int) -> int:
    """A counter that must stay below the window it counts towards."""
    if value >= window:
        raise ValueError(f"{name} must be below scale_window={window}; got {value!r}")
    return value
