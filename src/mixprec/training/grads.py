"""Gradient checks: is anything non-finite, and unscaling, on the device.

:func:`all_finite`, :func:`found_non_finite` and :func:`unscale_grads_` never synchronize
with the host (fused foreach kernels per device and dtype). Complex tensors are checked
and unscaled through their real view (an inf in either part counts).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["all_finite", "found_non_finite", "inverse_scale", "to_device", "unscale_grads_"]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move a small state tensor, without blocking unless the copy goes to the host."""
    # Host-to-device and device-to-device copies are async; a device-to-host copy must block
    # (a non_blocking one could be read before it lands), so only that one may wait.
    return t.to(device, non_blocking=device.type != "cpu")


def _group(
    tensors: object, argument: str, *, strict: bool = False
) -> dict[tuple[torch.device, torch.dtype], list[Any]]:
    """Floating, non-empty tensors by (device, dtype); sparse ones by their values,
    complex ones by their real view.

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
        if strict and t is not None and not (t.is_floating_point() or t.is_complex()):
            raise TypeError(f"{argument} must be floating tensors; got {t.dtype} at item {i}")
        values = t._values() if t is not None and t.is_sparse else t
        if values is not None and values.is_complex():
            values = torch.view_as_real(values)
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
            group = [t for t in group if t.numel()]  # an FSDP2 shard may be empty
            if group:
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


def found_non_finite(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """1.0 if any tensor holds an inf or a NaN, else 0.0: a 0-dim float32 tensor (no sync).

    The form the fused optimizers take as ``found_inf``; it lives where :func:`all_finite`
    puts its flag.

    Example:
        >>> found_non_finite([torch.tensor([1.0, float("inf")])])
        tensor(1.)
    """
    return (~all_finite(tensors)).float()
