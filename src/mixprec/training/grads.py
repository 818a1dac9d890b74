"""Gradient checks: is anything non-finite, unscaling and the gradient norm, on the device.

:func:`unscale_` (public as ``mixprec.unscale_``), :func:`all_finite`,
:func:`found_non_finite`, :func:`_unscale_grads` and :func:`total_norm` never synchronize
with the host (fused foreach kernels per device and dtype). Complex tensors are checked
and unscaled through their real view (an inf in either part counts); sparse ones through
their values.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["all_finite", "found_non_finite", "mark_unscaled", "to_device", "total_norm", "unscale_"]

#: names that were public here in mixprec 0.1, each with what replaces it
_DEPRECATED = {
    "unscale_grads_": ("_unscale_grads", "mixprec.unscale_(params, scale)"),
    "inverse_scale": ("_inverse_scale", "mixprec.unscale_(params, scale)"),
}


def __getattr__(name: str) -> Any:
    """The 0.1 names, for one release, with a DeprecationWarning."""
    if name in _DEPRECATED:
        import warnings

        private, instead = _DEPRECATED[name]
        warnings.warn(
            f"mixprec.training.grads.{name} is deprecated and will be removed in the next "
            f"release; use {instead}",
            DeprecationWarning,
            stacklevel=2,
        )
        return globals()[private]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: the attribute a gradient unscaled by :func:`unscale_` carries: (its version after the
#: unscale, the found_inf of that call)
_UNSCALED = "_mixprec_unscaled"


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move a small state tensor, without blocking unless the copy goes to the host."""
    # Host-to-device and device-to-device copies are async; a device-to-host copy must block
    # (a non_blocking one could be read before it lands), so only that one may wait.
    if t.device == device:
        return t
    return t.to(device, non_blocking=device.type != "cpu")


class _NoGrad:
    """``torch.no_grad()`` for the training step's hot path: the same switch, without the
    Python layers around it (the step enters it several times per call)."""

    __slots__ = ("_before",)

    def __enter__(self) -> None:
        self._before = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)

    def __exit__(self, *exc: object) -> None:
        torch._C._set_grad_enabled(self._before)


def _uniform(tensors: Sequence[Any]) -> bool:
    """Whether ``tensors`` are all dense, real floating tensors of one dtype on one device
    (what a training step's gradients usually are): one fused kernel takes them as they are,
    without :func:`_group`'s walk. Empty tensors are fine (the kernels skip them)."""
    if not tensors:
        return False
    try:
        first = tensors[0]
        dtype, device, strided = first.dtype, first.device, torch.strided
        return dtype.is_floating_point and all(
            t.layout is strided and t.dtype is dtype and t.device == device for t in tensors
        )
    except AttributeError:  # None or a non-tensor: the general path says what it is
        return False


def _group(
    tensors: object, argument: str, *, strict: bool = False, coalesce: bool = False
) -> dict[tuple[torch.device, torch.dtype], list[Any]]:
    """Floating, non-empty tensors by (device, dtype); sparse ones by their values
    (summed over repeated indices first with ``coalesce``: what a norm needs, where a finiteness
    check or an in-place scale does not), complex ones by their real view.

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
        values = t
        if t is not None and t.is_sparse:
            values = (t.coalesce() if coalesce else t)._values()
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


def _inverse_scale(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` computed in float64 and returned as float32 (as GradScaler does).

    Example:
        >>> _inverse_scale(torch.tensor(4.0))
        tensor(0.2500)
    """
    return scale.double().reciprocal().float()


def _unscale_grads(grads: Sequence[torch.Tensor | None], inv_scale: torch.Tensor) -> torch.Tensor:
    """Multiply every gradient by ``inv_scale`` in place and report inf/NaN (no host sync).

    One fused ``torch._amp_foreach_non_finite_check_and_unscale_`` per (device, dtype) group.
    ``None`` entries are skipped; sparse gradients are unscaled through their values.

    ``grads`` may be on any devices, in any floating dtypes; ``inv_scale`` is a one-element
    tensor, usually :func:`_inverse_scale` of the loss scale. Returns ``found_inf``: a 0-dim
    float32 tensor on ``inv_scale``'s device, 1.0 if any gradient held an inf/NaN, else 0.0.

    Example:
        >>> g = [torch.full((2,), 1024.0)]
        >>> _unscale_grads(g, _inverse_scale(torch.tensor(1024.0))), g[0]
        (tensor(0.), tensor([1., 1.]))
    """
    if not isinstance(inv_scale, torch.Tensor) or inv_scale.numel() != 1:
        raise TypeError(f"inv_scale must be a one-element tensor; got {inv_scale!r}")
    if inv_scale.dim():
        inv_scale = inv_scale.reshape(())
    if inv_scale.dtype != torch.float32:
        inv_scale = inv_scale.float()
    if _uniform(grads):  # the usual case: one kernel, no grouping
        device = grads[0].device  # type: ignore[union-attr]
        flag = torch.zeros((), dtype=torch.float32, device=device)
        with _NoGrad():
            _check_and_unscale(list(grads), flag, to_device(inv_scale, device))  # type: ignore[arg-type]
        return to_device(flag, inv_scale.device)
    found: dict[torch.device, torch.Tensor] = {}
    invs: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for (device, _), group in _group(grads, "grads", strict=True).items():
            if device not in found:
                found[device] = torch.zeros((), dtype=torch.float32, device=device)
                invs[device] = to_device(inv_scale, device)
            _check_and_unscale(group, found[device], invs[device])
    flags = [to_device(f, inv_scale.device) for f in found.values()]
    if not flags:
        return torch.zeros((), dtype=torch.float32, device=inv_scale.device)
    return flags[0] if len(flags) == 1 else torch.stack(flags).amax()


def _check_and_unscale(
    group: list[torch.Tensor], found: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """GradScaler's fused kernel where torch has it, else foreach ops with its semantics."""
    fused = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
    if fused is not None:
        fused(group, found, inv_scale)
        return
    norms = torch._foreach_norm(group, ord=math.inf)  # pragma: no cover - older torch
    found.copy_(torch.maximum(found, (~torch.stack(norms).isfinite().all()).float()))
    torch._foreach_mul_(group, inv_scale)


def _gradients(optimizer_or_params: object) -> list[torch.Tensor]:
    if isinstance(optimizer_or_params, torch.optim.Optimizer):
        params: Iterable[Any] = (
            p for group in optimizer_or_params.param_groups for p in group["params"]
        )
    elif isinstance(optimizer_or_params, torch.Tensor):
        params = [optimizer_or_params]
    elif isinstance(optimizer_or_params, Iterable) and not isinstance(
        optimizer_or_params, (str, bytes, Mapping)
    ):
        params = optimizer_or_params
    else:
        raise TypeError(
            "optimizer_or_params must be a torch.optim.Optimizer, a tensor or an iterable of "
            f"tensors whose .grad to unscale; got {optimizer_or_params!r}"
        )
    grads = []
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"optimizer_or_params must hold tensors (Parameters); got {p!r} at item {i}"
            )
        if p.grad is not None:
            grads.append(p.grad)
    return grads


def _version(grad: torch.Tensor) -> int:
    return (grad._values() if grad.is_sparse else grad)._version


def unscale_(optimizer_or_params: object, scale: float | torch.Tensor) -> torch.Tensor:
    """Divide the gradients by ``scale`` in place; returns whether any was inf/NaN.

    The tool of ``torch.amp.GradScaler.unscale_``, without a scaler: ``optimizer_or_params``
    is an optimizer (every ``p.grad`` of its param groups) or Parameters; ``scale`` a
    positive float or a one-element tensor (the loss scale the backward ran with). The
    reciprocal is taken in float64, as GradScaler does, and each (device, dtype) group of
    gradients goes through one fused check-and-unscale kernel. No host sync.

    Idempotent within a step: a gradient this call already unscaled, and that nothing has
    written since (a backward accumulating into it does), is left alone and reports the
    flag it had; a new gradient (after ``zero_grad``) is unscaled again.

    Returns:
        ``found_inf``: a 0-dim bool tensor on the first gradient's device (CPU when there
        are none), True if any gradient held an inf or a NaN.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> (w.sum() * 1024.0).backward()
        >>> mixprec.unscale_([w], 1024.0), w.grad
        (tensor(False), tensor([1., 1.]))
    """
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or not scale.is_floating_point():
            raise TypeError(
                f"scale must be a float or a one-element floating tensor; got {scale!r}"
            )
        scale_t = scale.detach().reshape(())
    elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a finite number > 0; got {scale!r}")
        scale_t = torch.tensor(float(scale), dtype=torch.float64)
    else:
        raise TypeError(f"scale must be a float or a one-element floating tensor; got {scale!r}")
    grads = _gradients(optimizer_or_params)
    device = grads[0].device if grads else scale_t.device
    fresh = []
    flags = []
    for g in grads:
        seen = getattr(g, _UNSCALED, None)
        if seen is not None and seen[0] == _version(g):
            flags.append(seen[1])
        else:
            fresh.append(g)
    if fresh:
        found = _unscale_grads(fresh, _inverse_scale(to_device(scale_t, device))).bool()
        mark_unscaled(fresh, found)
        flags.append(found)
    if not flags:
        return torch.zeros((), dtype=torch.bool, device=device)
    if len(flags) == 1:
        return flags[0]
    return torch.stack([to_device(f, device) for f in flags]).any()


def mark_unscaled(grads: Sequence[torch.Tensor | None], found: torch.Tensor) -> None:
    """Record that ``grads`` were unscaled (with overflow flag ``found``), so that a later
    :func:`unscale_` in the same step leaves them alone."""
    flag = found.bool()
    for g in grads:
        if g is not None:
            setattr(g, _UNSCALED, (_version(g), flag))


def total_norm(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """The L2 norm of all the tensors together, as a 0-dim float32 tensor (no host sync).

    A sparse tensor counts as the dense tensor it stands for (its values summed over
    repeated indices, as ``nn.Embedding(sparse=True)``'s gradient holds them), a complex one
    by its real view; ``None`` and non-floating tensors are skipped; an empty input has norm 0.

    Example:
        >>> total_norm([torch.tensor([3.0]), torch.tensor([4.0])])
        tensor(5.)
    """
    if _uniform(tensors):  # the usual case: one fused kernel, no grouping
        with _NoGrad():
            stacked = torch.stack(torch._foreach_norm(list(tensors)))  # type: ignore[arg-type]
            if stacked.dtype != torch.float32:
                stacked = stacked.float()
            return torch.linalg.vector_norm(stacked)
    parts: list[torch.Tensor] = []
    with torch.no_grad():
        for group in _group(tensors, "tensors", coalesce=True).values():
            parts.extend(torch._foreach_norm(group))
    if not parts:
        return torch.zeros(())
    device = parts[0].device
    return torch.linalg.vector_norm(torch.stack([to_device(n.float(), device) for n in parts]))


def found_non_finite(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """1.0 if any tensor holds an inf or a NaN, else 0.0: a 0-dim float32 tensor (no sync).

    The form the fused optimizers take as ``found_inf``; it lives where :func:`all_finite`
    puts its flag.

    Example:
        >>> found_non_finite([torch.tensor([1.0, float("inf")])])
        tensor(1.)
    """
    return (~all_finite(tensors)).float()
