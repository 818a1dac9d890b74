"""Low-precision dtypes: parsing, device defaults and "is it native here?" probes.

Everything that turns a user's ``dtype=`` into a :class:`torch.dtype` lives here, so
every public function accepts the same spellings and raises the same error.
Hardware probes run lazily (on first call, never at import).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from mixprec._warn import warn
from mixprec.policy.hardware import cpu_features, is_native

__all__ = [
    "LOW_DTYPES",
    "default_low_dtype",
    "device_of",
    "dtype_name",
    "has_native_low_precision",
    "is_castable",
    "resolve_dtype",
    "to_dtype",
    "warn_if_slow",
]

#: The low-precision floating types mixprec computes in.
LOW_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)

_SPELLINGS: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}

_CHOICES = "torch.float16, torch.bfloat16, 'fp16', 'float16', 'half', 'bf16', 'bfloat16' or None"


def resolve_dtype(dtype: object, device: torch.device | str | None = None) -> torch.dtype:
    """Turn a user's ``dtype`` argument into a low-precision :class:`torch.dtype`.

    Args:
        dtype: ``torch.float16``, ``torch.bfloat16``, one of the strings ``"fp16"``,
            ``"float16"``, ``"half"``, ``"bf16"``, ``"bfloat16"``, or ``None`` for the
            device's usual low-precision type (see :func:`default_low_dtype`).
        device: where the model lives; only used when ``dtype`` is ``None``.

    Raises:
        ValueError: for anything else, listing the choices.

    Example:
        >>> resolve_dtype("bf16")
        torch.bfloat16
    """
    if dtype is None:
        return default_low_dtype(device)
    if isinstance(dtype, torch.dtype):
        if dtype in LOW_DTYPES:
            return dtype
    elif isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key in _SPELLINGS:
            return _SPELLINGS[key]
    raise ValueError(f"dtype must be one of {_CHOICES}; got {dtype!r}")


def default_low_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """The usual low-precision type of a device.

    bfloat16 on CPU; on CUDA bfloat16 where the GPU runs it natively, else float16.
    """
    dev = torch.device("cpu" if device is None else device)
    if dev.type == "cuda" and not is_native(torch.bfloat16, dev):
        return torch.float16
    return torch.bfloat16


def has_native_low_precision(device: torch.device | str | None = None) -> bool:
    """Whether ``device`` runs :func:`default_low_dtype` matmuls natively (fast).

    See :mod:`mixprec.policy.hardware` for what counts as native on each device.
    """
    return is_native(default_low_dtype(device), device)


def warn_if_slow(dtype: torch.dtype, device: torch.device | str | None = None) -> None:
    """Warn, once per process, device and dtype, when ``device`` runs ``dtype`` slowly.

    The warning names the slowdown and points at ``auto``; it is attributed to the
    user's line.
    """
    dev = torch.device("cpu" if device is None else device)
    if not is_native(dtype, dev):
        _warn_slow_once(dev, dtype)


@functools.cache
def _warn_slow_once(device: torch.device, dtype: torch.dtype) -> None:
    name = dtype_name(dtype)
    if device.type == "cpu":
        features = cpu_features()
        isa = "avx512_bf16/AMX" if dtype == torch.bfloat16 else "AMX-FP16"
        why = (
            f"this CPU ({features.capability}) has no native {name} matmul (no {isa} "
            "that oneDNN may use): PyTorch runs it far slower than float32 (bfloat16 on an "
            "AVX2-only CPU: about 250x)"
        )
    else:
        why = f"{device} has no native {name} matmul"
    warn(
        f"mixprec: computing in {name} on {device.type}, but {why}. "
        "Level 'auto' picks what this device runs fast; `mixprec doctor` measures it."
    )


def device_of(module: torch.nn.Module) -> torch.device:
    """The device of a module's first parameter or buffer (CPU for an empty module)."""
    for param in module.parameters():
        return param.device
    for buffer in module.buffers():
        return buffer.device
    return torch.device("cpu")


#: The dtypes mixprec may cast: every floating dtype but float64.
_CASTABLE = frozenset(
    value
    for value in vars(torch).values()
    if isinstance(value, torch.dtype) and value.is_floating_point and value != torch.float64
)


#: Tensor methods that cast to one dtype: the same kernel as ``Tensor.to(dtype)``, with
#: about a third less host time (no overload resolution among ``to``'s signatures).
_CAST_METHODS: dict[torch.dtype, Callable[[torch.Tensor], torch.Tensor]] = {
    torch.bfloat16: torch.Tensor.bfloat16,
    torch.float16: torch.Tensor.half,
    torch.float32: torch.Tensor.float,
}


def to_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)``, by the cheapest call that makes the same cast."""
    method = _CAST_METHODS.get(dtype)
    return tensor.to(dtype) if method is None else method(tensor)


def is_castable(x: object) -> bool:
    """True for tensors mixprec may cast: floating point, but never float64.

    (Tested on the dtype's own flag rather than membership of :data:`_CASTABLE`, which
    TorchDynamo would guard at every call site of a compiled model.)"""
    if not isinstance(x, torch.Tensor):
        return False
    dtype = x.dtype
    return dtype.is_floating_point and dtype is not torch.float64


def dtype_name(dtype: torch.dtype | None) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; None (no dtype) -> ``"-"``."""
    return "-" if dtype is None else str(dtype).removeprefix("torch.")
