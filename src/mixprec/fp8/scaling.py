"""Dynamic fp8 scaling, emulated: amax, scale, cast and dequantize, in one pass per step.

For an operand ``x`` and an fp8 dtype with largest finite value ``M``:

1. ``amax = max |x|`` (over the whole tensor, or over each row for rowwise scaling);
2. ``scale = float32(M / max(float64(amax), 1e-12))``, rounded down to a power of two when
   the recipe says so;
3. ``bits = fp8(x * scale)`` (saturating at ``M``), and the GEMM reads ``float32(bits) / scale``.

That is torchao's arithmetic, operation for operation, so an emulated layer is bit-identical
to torchao's ``emulate=True``. Fewer passes, same bits: ``amax`` is one reduction
(``vector_norm(x, inf)``, no ``|x|`` temporary); torchao's clamp to ``[-M, M]`` before the cast
is left out because ``|x * scale| <= M`` up to one rounding of the scale, which the cast
rounds to ``M`` exactly as the clamp would (and non-finite inputs give NaN either way); the
product is written straight into the fp8 tensor (``torch.mul(..., out=)``: one pass, the
same float32 product and rounding as ``(x * scale).to(fp8)``); the dequantization divides
in place. Four passes over the operand in all, against torchao's seven.

Statistics (:class:`CastStats`) count, for one cast, the values the cast *saturates*
(``|x * scale| > M``: clipped to ``M``) and the non-zero values it *flushes to zero*.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CastStats", "amax_of", "cast_stats", "quantize", "scale_of"]

#: The smallest amax torchao divides by.
EPS = 1e-12


def amax_of(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    """``max |x|`` over the tensor (``dim=None``) or along ``dim`` (kept), in ``x``'s dtype."""
    if dim is None:
        return torch.linalg.vector_norm(x, float("inf"))
    return torch.linalg.vector_norm(x, float("inf"), dim=dim, keepdim=True)


def scale_of(amax: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """The float32 scale that maps ``amax`` to ``dtype``'s largest finite value."""
    scale = (torch.finfo(dtype).max / amax.to(torch.float64).clamp(min=EPS)).to(torch.float32)
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


@dataclass(frozen=True)
class CastStats:
    """What one cast did (0-dim tensors, so that recording never waits for the device).

    Attributes:
        amax: the largest ``|x|`` (over all rows for rowwise scaling).
        scale: the smallest scale used (the one scale for tensorwise scaling).
        saturated: how many values were clipped to the fp8 maximum.
        flushed: how many non-zero values became zero.
        numel: how many values were cast.
    """

    amax: torch.Tensor
    scale: torch.Tensor
    saturated: torch.Tensor
    flushed: torch.Tensor
    numel: int


def cast_stats(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> CastStats:
    """Count what casting ``x * scale`` to ``dtype`` saturates and flushes to zero.

    Example:
        >>> s = cast_stats(torch.tensor([500.0, 1e-4, 1.0]), torch.tensor(1.0), torch.float8_e4m3fn)
        >>> int(s.saturated), int(s.flushed)
        (1, 1)
    """
    scaled = x.to(torch.float32) * scale
    bits = scaled.to(dtype)
    return CastStats(
        amax=amax_of(x, None).to(torch.float32),
        scale=scale.min(),
        saturated=(scaled.abs() > torch.finfo(dtype).max).sum(),
        flushed=((bits == 0) & (x != 0)).sum(),
        numel=x.numel(),
    )


def quantize(
    x: torch.Tensor, dtype: torch.dtype, dim: int | None, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` cast to ``dtype`` with a dynamic scale and read back: ``(dequantized, scale)``.

    The dequantized tensor is float32 with ``x``'s layout (what torchao's emulated GEMM
    reads); ``dim`` is the dimension the rowwise amax reduces (None: one scale).
    """
    scale = scale_of(amax_of(x, dim), dtype, pow2)
    wide = x.to(torch.float32)  # the product is a float32 one, as torchao's
    bits = torch.empty_like(wide, dtype=dtype)
    torch.mul(wide, scale, out=bits)  # multiply and cast in one pass
    return bits.to(torch.float32).div_(scale), scale
