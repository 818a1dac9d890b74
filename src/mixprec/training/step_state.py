"""The training step's bookkeeping: what happened (on the device), checkpoint checks, and
the first loss scale of an fp16 step.

:class:`StepLedger` keeps ``[overflow, skipped steps, consecutive overflows]``: on the host
when the step decides its skips there (it reads the overflow flag anyway), else in one small
tensor on the gradients' device, updated without a host sync (one ``tolist()`` reads all
three). The checks here run before a checkpoint writes anything.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from mixprec.training.grads import _version
from mixprec.training.master import MasterWeights
from mixprec.training.scaling import LossScaleManager

__all__ = [
    "GradNorm",
    "StepLedger",
    "check_checkpoint",
    "check_extra_state",
    "choose_initial_scale",
]

#: the first fp16 scale puts the largest gradient near this value (float16's max is 65504:
#: 2**6 of room for activation gradients larger than the parameters')
INITIAL_GRADIENT_TARGET = 2.0**10
#: the first scale is kept in [1, this]
INITIAL_SCALE_CAP = 2.0**24


class StepLedger:
    """``[overflow, skipped_steps, consecutive_overflows]``: on the host while the step
    decides skips there (one read of the overflow flag per step, nothing else), on the device
    (a float32 tensor, exact to 2**24 steps) while the skip is the device's."""

    def __init__(self) -> None:
        #: the device copy; None while the host copy is the current one
        self._values: torch.Tensor | None = None
        #: the host copy; None while the device copy has steps the host has not read
        self._host: tuple[bool, int, int] | None = (False, 0, 0)
        self._masks: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, found: torch.Tensor) -> None:
        """Record one optimizer step whose overflow flag is ``found`` (a 0-dim float32
        tensor, 1.0 or 0.0) on the device: two fused kernels, no sync."""
        device = found.device
        values = self._values
        if values is None:
            values = _on_device([float(v) for v in self.read()], device)
        elif values.device != device:
            values = values.to(device, non_blocking=True)
        masks = self._masks.get(device)
        if masks is None:
            masks = self._masks[device] = (
                _on_device([0.0, 1.0, 0.0], device),
                _on_device([0.0, 0.0, 1.0], device),
            )
        kept = torch.addcmul(masks[0], masks[1], found)  # [0, 1, found]
        # [found, skipped + found, (run + 1) * found]
        self._values = torch.addcmul(found, values, kept)
        self._host = None

    def record(self, found: torch.Tensor) -> tuple[bool, int, int]:
        """Record one optimizer step whose skip is decided on the host: reads ``found``
        (the one sync) and returns the ledger after it."""
        if self._host is None:  # the device copy has steps of its own: add this one there
            self.update(found)
            return self.read_now()
        overflow = found.item() > 0
        _, skipped, run = self._host
        self._host = (overflow, skipped + overflow, run + 1 if overflow else 0)
        self._values = None
        return self._host

    def read_now(self) -> tuple[bool, int, int]:
        """Read the ledger on the host (a sync when the device copy is the current one)."""
        if self._values is None:
            assert self._host is not None
            return self._host
        overflow, skipped, run = self._values.tolist()
        self._host = (overflow > 0, int(skipped), int(run))
        return self._host

    def read(self) -> tuple[bool, int, int]:
        """The host copy, read from the device only when stale."""
        return self._host if self._host is not None else self.read_now()

    def snapshot(self) -> tuple[torch.Tensor | None, tuple[bool, int, int] | None]:
        """The ledger as it is, to :meth:`restore` if the step fails (no sync)."""
        return self._values, self._host

    def restore(self, snapshot: tuple[torch.Tensor | None, tuple[bool, int, int] | None]) -> None:
        self._values, self._host = snapshot

    def load(self, overflow: bool, skipped: int, run: int) -> None:
        self._values = None
        self._host = (overflow, skipped, run)


def _on_device(values: list[float], device: torch.device) -> torch.Tensor:
    """``values`` as a float32 vector on ``device``, copied without waiting for the device
    (a blocking copy from host memory is a sync)."""
    return torch.tensor(values).to(device, non_blocking=True)


class GradNorm:
    """A step's ``grad_norm``: the L2 norm of the unscaled gradients of the last applied
    optimizer step (before clipping), computed only when something needs it.

    While :attr:`eager` (clipping needs the norm; under FSDP2 it takes a collective, which
    every rank must run alike; an optimizer from outside ``torch.optim`` may write the
    gradients in place; or the norm has been read before) every applied step computes it on
    the device. Otherwise a step only keeps its gradients (and their version counters) until
    the next call begins: a read before then computes the norm from them and makes the
    record eager; a step whose gradients go unread leaves the norm unknown (NaN) until the
    next step that computes one.

    Args:
        norm: the gradients' total norm, a 0-dim float32 tensor (no sync).
        eager: compute at every applied step from the start.
    """

    def __init__(self, norm: Callable[[list[torch.Tensor]], torch.Tensor], *, eager: bool) -> None:
        self._norm = norm
        self.eager = eager
        #: the last applied step's norm; None when its gradients went unread
        self._value: torch.Tensor | None = torch.tensor(math.nan)
        #: (gradients, their versions, the device's overflow flag or None, the norm before)
        self._pending: (
            tuple[list[torch.Tensor], list[int], torch.Tensor | None, torch.Tensor | None] | None
        ) = None

    def last(self, device: torch.device) -> torch.Tensor:
        """The norm so far (NaN when unknown), on ``device``, for a step that may be skipped."""
        return _known(self._value, device)

    def set(self, norm: torch.Tensor) -> None:
        """An applied step's norm, computed."""
        self._value, self._pending = norm, None

    def defer(self, grads: list[torch.Tensor], found: torch.Tensor | None) -> None:
        """An applied step's gradients, whose norm is computed if read before the next call
        (``found``: the overflow flag of a step the device decides; a skipped one keeps the
        norm before it)."""
        self._pending = (grads, [_version(g) for g in grads], found, self._value)

    def release(self) -> None:
        """The next call begins: the kept gradients go, unread (their norm is unknown)."""
        if self._pending is not None:
            self._pending = None
            self._value = None

    def read(self) -> torch.Tensor:
        """The norm as a 0-dim tensor (no sync); from now on every applied step computes it."""
        self.eager = True
        pending, self._pending = self._pending, None
        if pending is not None:
            grads, versions, found, before = pending
            if [_version(g) for g in grads] != versions:  # written since: not that step's
                self._value = None
            else:
                norm = self._norm(grads)
                if found is not None:
                    norm = torch.where(found > 0, _known(before, norm.device), norm)
                self._value = norm
        return torch.tensor(math.nan) if self._value is None else self._value


def _known(norm: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``norm`` (NaN when None) on ``device``, moved without waiting for the device."""
    value = torch.tensor(math.nan) if norm is None else norm
    return value if value.device == device else value.to(device, non_blocking=True)


def choose_initial_scale(grads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The power of two that brings the largest gradient (taken at scale 1) near
    :data:`INITIAL_GRADIENT_TARGET`, in ``[1, 2**24]`` (no sync); ``inf`` when no gradient
    tells (none, all empty, all zero, or not finite): across ranks the smallest choice wins,
    so a rank holding only empty FSDP2 shards has no say. :func:`settled_initial_scale`
    turns ``inf`` into 2**16.

    Example:
        >>> choose_initial_scale([torch.tensor([0.01, -0.002])], torch.float16)
        tensor(65536.)
    """
    del dtype  # the target is float16's; bfloat16 steps need no scale
    grads = [g for g in grads if g.numel()]  # an FSDP2 shard may be empty
    if not grads:
        return torch.tensor(math.inf)
    device = grads[0].device
    values = [(g.coalesce()._values() if g.is_sparse else g).float() for g in grads]
    norms = torch._foreach_norm([v for v in values if v.numel()] or [torch.zeros(1)], ord=math.inf)
    amax = torch.stack([n.to(device) for n in norms]).max()
    exponent = torch.floor(torch.log2(INITIAL_GRADIENT_TARGET / amax))
    chosen = torch.exp2(exponent).clamp(1.0, INITIAL_SCALE_CAP)
    usable = (amax > 0) & amax.isfinite()
    return torch.where(usable, chosen, torch.full_like(chosen, math.inf))


def settled_initial_scale(chosen: torch.Tensor) -> torch.Tensor:
    """The (agreed) choice of :func:`choose_initial_scale`, 2**16 where nothing told."""
    return torch.where(chosen.isinf(), torch.full_like(chosen, 2.0**16), chosen)


_V1_KEYS = ("loss_scale_manager", "masters", "overflow", "skipped_steps", "optimizer_steps")
_V2_KEYS = ("format", *_V1_KEYS, "consecutive_overflows")


def _count(value: object, name: str) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"training-step checkpoint: {name} must be an int >= 0; got {value!r}")
    if value != int(value):
        raise ValueError(f"training-step checkpoint: {name} must be an int >= 0; got {value!r}")
    return int(value)


def check_extra_state(
    state: object, manager: LossScaleManager | None, masters: MasterWeights | None
) -> dict[str, Any]:
    """Validate a step's extra state (format 2, or format 1 written by mixprec 0.1.0)
    without writing anything; returns it normalised to format 2."""
    if not isinstance(state, Mapping):
        raise ValueError(
            f"not a mixprec training-step checkpoint: its extra state is a {type(state).__name__}"
        )
    version = state.get("format", 1)
    if version not in (1, 2):
        raise ValueError(
            f"training-step checkpoint format {version!r} is unknown; this mixprec reads 1 and 2"
        )
    keys = _V1_KEYS if version == 1 else _V2_KEYS
    missing, unknown = sorted(set(keys) - set(state)), sorted(set(state) - set(keys))
    if missing or unknown:
        raise ValueError(
            f"training-step checkpoint (format {version}) has missing keys {missing} and unknown "
            f"keys {unknown}; expected exactly {sorted(keys)}"
        )
    if (state["loss_scale_manager"] is None) != (manager is None):
        raise ValueError("the checkpoint and this step disagree on having a loss-scale manager")
    if manager is not None:
        try:
            copy.deepcopy(manager).load_state_dict(state["loss_scale_manager"])
        except (TypeError, ValueError) as error:
            old = " (written by mixprec 0.1.0)" if version == 1 else ""
            raise ValueError(
                f"training-step checkpoint{old}: its loss-scale state does not load: {error}. "
                f"Fix the entry checkpoint['_extra_state']['loss_scale_manager'] (or drop it and "
                f"load the weights alone with step.network.load_state_dict)"
            ) from error
    if (state["masters"] is None) != (masters is None):
        raise ValueError("the checkpoint and this step disagree on master weights")
    if masters is not None:
        masters.check(state["masters"])
    if not isinstance(state["overflow"], (bool, torch.Tensor)):
        raise ValueError(
            f"training-step checkpoint: overflow must be a bool; got {state['overflow']!r}"
        )
    return {
        "loss_scale_manager": state["loss_scale_manager"],
        "masters": state["masters"],
        "overflow": bool(state["overflow"]),
        "skipped_steps": _count(state["skipped_steps"], "skipped_steps"),
        "optimizer_steps": _count(state["optimizer_steps"], "optimizer_steps"),
        "consecutive_overflows": _count(
            state.get("consecutive_overflows", 0), "consecutive_overflows"
        ),
    }


def check_checkpoint(
    children: Mapping[str, nn.Module],
    state_dict: Mapping[str, Any],
    strict: bool,
    manager: LossScaleManager | None,
    masters: MasterWeights | None,
) -> None:
    """Check a whole step checkpoint (keys, shapes, extra state) before anything is written:
    ``children`` are the step's named submodules, ``manager`` and ``masters`` its parts."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a dict; got {type(state_dict).__name__}")
    expected: dict[str, Any] = {}
    for name, child in children.items():
        expected.update(child.state_dict(prefix=f"{name}.", keep_vars=True))
    extra = "_extra_state"
    missing = sorted(set(expected) - set(state_dict) | ({extra} - set(state_dict)))
    unknown = sorted(set(state_dict) - set(expected) - {extra})
    if strict and (missing or unknown):
        raise ValueError(
            f"the checkpoint does not fit this training step: missing keys {missing[:8]}, "
            f"unknown keys {unknown[:8]} (nothing was loaded)"
        )
    for key, own in expected.items():
        given = state_dict.get(key)
        if (
            isinstance(own, torch.Tensor)
            and isinstance(given, torch.Tensor)
            and given.shape != own.shape
        ):
            raise ValueError(
                f"the checkpoint's {key!r} has shape {tuple(given.shape)}; this step's has "
                f"{tuple(own.shape)} (nothing was loaded)"
            )
    if extra in state_dict:
        check_extra_state(state_dict[extra], manager, masters)
