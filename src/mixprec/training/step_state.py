"""The training step's bookkeeping: what happened (on the device), checkpoint checks, and
the first loss scale of an fp16 step.

:class:`StepLedger` keeps ``[overflow, skipped steps, consecutive overflows]`` in one small
tensor on the gradients' device, updated without a host sync; one ``tolist()`` reads all
three. The checks here run before a checkpoint writes anything.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from mixprec.training.master import MasterWeights
from mixprec.training.scaling import LossScaleManager

__all__ = ["StepLedger", "check_checkpoint", "check_extra_state", "choose_initial_scale"]

#: the first fp16 scale puts the largest gradient near this value (float16's max is 65504:
#: 2**6 of room for activation gradients larger than the parameters')
INITIAL_GRADIENT_TARGET = 2.0**10
#: the first scale is kept in [1, this]
INITIAL_SCALE_CAP = 2.0**24


class StepLedger:
    """``[overflow, skipped_steps, consecutive_overflows]`` as a float32 tensor (exact to
    2**24 steps) on the device, with a host copy once read."""

    def __init__(self) -> None:
        self._values = torch.zeros(3)
        self._host: tuple[bool, int, int] | None = (False, 0, 0)

    def update(self, found: torch.Tensor) -> None:
        """Record one optimizer step whose overflow flag is ``found`` (1.0 or 0.0); no sync."""
        old = self._values.to(found.device, non_blocking=True)
        self._values = torch.stack([found, old[1] + found, (old[2] + 1) * found])
        self._host = None

    def read_now(self) -> tuple[bool, int, int]:
        """Read the ledger on the host: the one sync."""
        overflow, skipped, run = self._values.tolist()
        self._host = (overflow > 0, int(skipped), int(run))
        return self._host

    def read(self) -> tuple[bool, int, int]:
        """The host copy, read from the device only when stale."""
        return self._host if self._host is not None else self.read_now()

    def snapshot(self) -> tuple[torch.Tensor, tuple[bool, int, int] | None]:
        """The ledger as it is, to :meth:`restore` if the step fails (no sync)."""
        return self._values, self._host

    def restore(self, snapshot: tuple[torch.Tensor, tuple[bool, int, int] | None]) -> None:
        self._values, self._host = snapshot

    def load(self, overflow: bool, skipped: int, run: int) -> None:
        self._values = torch.tensor(
            [float(overflow), float(skipped), float(run)], device=self._values.device
        )
        self._host = (overflow, skipped, run)


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
