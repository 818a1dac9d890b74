"""O2/O3 and the old reparametrization hooks.

The old hooks (``torch.nn.utils.spectral_norm`` and ``torch.nn.utils.weight_norm``, forward pre-hooks, not ``parametrizations``) compute
``module.weight`` before each call from Parameters of their own (``weight_orig``;
``weight_g`` and ``weight_v``) and float32 buffers (``weight_u``, ``weight_v``). Read as
low casts, spectral norm's power iteration mixes them with its float32 buffers (a dtype
error) and weight norm divides by a norm taken in 16 bits. Here those Parameters stay
float32, so the hook (power iteration, norm, division) runs in float32 on the stored
originals, as a parametrization does at O2/O3 (a float32 island), and its float32
buffers are updated exactly as on the original; the weight it computes is then cast to
the module's dtype, so the layer's matmul runs in low precision like any other layer's
(the same as a parametrized layer, whose weight leaves its island cast down).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from mixprec.policy import lists

__all__ = ["adopt", "computed_weights", "prepare"]


def prepare(module: nn.Module, dtype: torch.dtype) -> frozenset[str]:
    """Fit ``module`` (computing in ``dtype``) for an O2/O3 conversion, before its
    Parameters and ``forward`` are converted (parents before children).

    Returns:
        The names of its Parameters that must stay float32 (an old hook's originals).
    """
    hooks = _weight_hooks(module)
    if hooks and dtype != torch.float32 and not isinstance(module, lists.FP32_STATE_MODULES):
        _cast_after(module, hooks, dtype)
    return _originals(hooks)


def adopt(module: nn.Module, dtype: torch.dtype, kept: frozenset[str]) -> frozenset[str]:
    """Fit the old hooks registered on ``module`` (computing in ``dtype``, its originals
    ``kept`` so far) since its conversion, as :func:`prepare` fits those it finds.

    Returns:
        The names of its Parameters that must stay float32 now (``kept`` when no hook
        was registered since).
    """
    hooks = [hook for hook in _weight_hooks(module) if not _originals([hook]) <= kept]
    if not hooks:
        return kept
    _cast_after(module, hooks, dtype)
    return kept | _originals(hooks)


def _originals(hooks: list[SpectralNorm | WeightNorm]) -> frozenset[str]:
    return frozenset(
        hook.name + suffix
        for hook in hooks
        for suffix in (("_orig",) if isinstance(hook, SpectralNorm) else ("_g", "_v"))
    )


def _cast_after(
    module: nn.Module, hooks: list[SpectralNorm | WeightNorm], dtype: torch.dtype
) -> None:
    """A pre-hook, after ``hooks``, casting the weights they compute to ``dtype``."""
    names = tuple(hook.name for hook in hooks)
    module.register_forward_pre_hook(functools.partial(_cast_computed, names, dtype))


def _weight_hooks(module: nn.Module) -> list[SpectralNorm | WeightNorm]:
    return [
        hook
        for hook in module._forward_pre_hooks.values()
        if isinstance(hook, (SpectralNorm, WeightNorm))
    ]


def computed_weights(module: nn.Module) -> list[str]:
    """The weights of ``module`` an old hook computes before each call (cast to the low
    dtype after it, when the module computes in low precision)."""
    return [hook.name for hook in _weight_hooks(module)]


def _cast_computed(
    names: tuple[str, ...], dtype: torch.dtype, module: nn.Module, args: tuple[Any, ...]
) -> None:
    """After the old hooks: the float32 weights they computed, cast to ``dtype``."""
    with torch._C.DisableTorchFunction():  # mixprec's casts are not the model's ops
        for name in names:
            value = module.__dict__.get(name)  # absent once the hook was removed
            if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                module.__dict__[name] = value.to(dtype)
