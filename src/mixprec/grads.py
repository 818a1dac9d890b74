"""Gradient checks: is anything non-finite, and unscaling, on the device.

:func:`all_finite` and :func:`unscale_grads_` never synchronize with the host (fused
foreach kernels per device and dtype); :func:`any_non_finite` is the training step's one
host sync per optimizer step, made cheap by a fast path.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from mixprec.distributed import agree_on_overflow

__all__ = ["all_finite", "any_non_finite", "inverse_scale", "to_device", "unscale_grads_"]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move a small state tensor, without blocking unless the copy goes to the host."""
    # Host-to-device and device-to-device copies are async; a device-to-host copy must block
    # (a non_blocking one could be read before it lands), so only that one may wait.
    return t.to(device, non_blocking=device.type != "cpu")


def _group(
    tensors: object, argument: str, *, strict: bool = False
) -> dict[tuple[torch.device, torch.dtype], list[Any]]:
    """Floating, non-empty tensors by (device, dtype); sparse ones by their values.

    Other tensors are skipped, or with ``strict`` refused.
    """
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    elif isinstance(tensors, Mapping):
        tensors = tensors.values()
    if not isinstance(tensors, Iterable):
        raise TypeError(f"{argument} must be an iterable of tensors; got {tensors!r}")
    groups: dict[tuple[torch.device, torch.dtype], list[Any]] = {}
    for i, t in enumerate(tensors):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{argument} must hold tensors (or None); got {t!r} at item {i}")
        if strict and t is not None and not t.is_floating_point():
            raise TypeError(f"{argument} must be floating tensors; got {t.dtype} at item {i}")
        values = t._values() if t is not None and t.is_sparse else t
        if values is not None and values.is_floating_point() and values.numel() > 0:
            groups.setdefault((values.device, values.dtype), []).append(values)
    return groups


def all_finite(tensors: Iterable[torch.Tensor | None] | torch.Tensor) -> torch.Tensor:
    """True iff no tensor holds an inf or a NaN, as a 0-dim bool tensor (no host sync).

    Non-floating tensors and ``None`` are ignored; an empty input is finite. The result lives
    on the first accelerator among the tensors' devices, else on the CPU.

    Example:
        >>> all_finite([torch.ones(2), torch.tensor([1.0, float("nan")])])
        tensor(False)
    """
    flags = []
    with torch.no_grad():
        for group in _group(tensors, "tensors").values():
            # max|x| is inf/NaN iff some element is (the kernels propagate NaN), cannot overflow
            # for finite inputs (an L2 norm can), only reads, and _foreach_norm fuses a
            # (device, dtype) group into a few launches. The AMP check-and-unscale kernel with
            # a unit scale gives the same answer but writes every element (bumping version
            # counters, refusing leaves that require grad), so it costs twice the traffic.
            norms = torch._foreach_norm(group, ord=math.inf)
            flags.append(torch.stack(norms).isfinite().all())
    if not flags:
        return torch.tensor(True)
    if len(flags) == 1:
        return flags[0]
    home = next((f.device for f in flags if f.device.type != "cpu"), flags[0].device)
    return torch.stack([to_device(f, home) for f in flags]).all()


def inverse_scale(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` computed in float64 and returned as float32 (as GradScaler does).

    Example:
        >>> inverse_scale(torch.tensor(4.0))
        tensor(0.2500)
    """
    return scale.double().reciprocal().float()


def unscale_grads_(grads: Sequence[torch.Tensor | None], inv_scale: torch.Tensor) -> torch.Tensor:
    """Multiply every gradient by ``inv_scale`` in place and report inf/NaN (no host sync).

    One fused ``torch._amp_foreach_non_finite_check_and_unscale_`` per (device, dtype) group.
    ``None`` entries are skipped; sparse gradients are unscaled through their values.

    ``grads`` may be on any devices, in any floating dtypes; ``inv_scale`` is a one-element
    tensor, usually :func:`inverse_scale` of the loss scale. Returns ``found_inf``: a 0-dim
    float32 tensor on ``inv_scale``'s device, 1.0 if any gradient held an inf/NaN, else 0.0.

    Example:
        >>> g = [torch.full((2,), 1024.0)]
        >>> unscale_grads_(g, inverse_scale(torch.tensor(1024.0))), g[0]
        (tensor(0.), tensor([1., 1.]))
    """
    if not isinstance(inv_scale, torch.Tensor) or inv_scale.numel() != 1:
        raise TypeError(f"inv_scale must be a one-element tensor; got {inv_scale!r}")
    inv_scale = inv_scale.reshape(()).float()
    found: dict[torch.device, torch.Tensor] = {}
    invs: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for (device, _), group in _group(grads, "grads", strict=True).items():
            if device not in found:
                found[device] = torch.zeros((), dtype=torch.float32, device=device)
                invs[device] = to_device(inv_scale, device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, found[device], invs[device])
    flags = [to_device(f, inv_scale.device) for f in found.values()]
    if not flags:
        return torch.zeros((), dtype=torch.float32, device=inv_scale.device)
    return flags[0] if len(flags) == 1 else torch.stack(flags).amax()


def any_non_finite(grads: Sequence[torch.Tensor]) -> bool:
    """Whether any gradient holds inf/NaN, agreed across ranks (a host sync).

    The fast path is one L2 norm per tensor (a fused, vectorised reduction, several times
    cheaper than an exact element check); only when some norm is not finite (which a float32
    norm of huge finite values also is) does the exact check decide.
    """
    if not grads:
        return False
    norms = torch._foreach_norm(list(grads), 2)
    suspect = (~torch.isfinite(torch.stack([n.to(norms[0].device) for n in norms])).all()).float()
    if not agree_on_overflow(suspect).item():
        return False
    exact = (~all_finite(grads)).float()
    return bool(agree_on_overflow(exact).item())
