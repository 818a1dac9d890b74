"""Dynamic fp8 scaling, emulated: amax, scale, and the round trip to fp8 and back in float32.

For an operand ``x`` and an fp8 dtype with largest finite value ``M``:

1. ``amax = max |x|`` (over the whole tensor, or over each row for rowwise scaling);
2. ``scale = float32(M / max(float64(amax), 1e-12))``, rounded down to a power of two when
   the recipe says so;
3. ``bits = fp8(x * scale)`` (saturating at ``M``), and the GEMM reads ``float32(bits) / scale``.

That is torchao's arithmetic, so an emulated layer is bit-identical to torchao's
``emulate=True``; only the way to the same bits is faster:

* ``amax`` is ``max(max(x), -min(x))``: plain reductions, exact, NaN-propagating, without
  an ``|x|`` temporary (one ``aminmax`` pass for one scale);
* the product ``v = float32(x) * scale`` is rounded to the fp8 grid *in float32*, without the
  fp8 tensor (CPU casts to and from fp8 are scalar loops): with ``e`` the exponent of ``|v|``
  clamped to the fp8's smallest normal exponent and ``m`` its mantissa bits,
  ``c = 1.5 * 2**(e + 23 - m)`` puts ``v + c`` in a binade whose spacing is the fp8 spacing
  at ``v``, so ``(v + c) - c`` is ``v`` rounded to nearest, ties to even, exactly as the
  cast (checked against torch's cast for every float32 with ``|v| <= M``). torchao's clamp
  to ``[-M, M]`` is left out: ``|v| <= M`` up to one rounding of the scale, which rounds to
  ``M`` as the clamp would; non-finite values give NaN either way. Zeros come back as
  ``+0.0`` where the cast keeps ``-0.0``: equal values, the same GEMM results;
* each pass is one whole-tensor op (seven in all, each vectorized): cutting a large operand
  into cache-sized blocks does a little less work, but on a CPU shared with other jobs its
  many short parallel regions wait for descheduled threads, and run several times slower.

Statistics (:class:`CastStats`) count, for one cast, the values the cast *saturates*
(clipped to ``M``: beyond the midpoint between ``M`` and the next value the grid would have,
so not the amax itself when the rounded scale puts it a hair above ``M``) and the non-zero
values it *flushes to zero*.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["CastStats", "amax_of", "cast_stats", "quantize", "round_to_fp8", "scale_of"]

#: The smallest amax torchao divides by.
EPS = 1e-12

#: Per fp8 dtype: the float32 exponent field of its smallest normal value, its mantissa bits.
_GRID = {torch.float8_e4m3fn: (127 - 6, 3), torch.float8_e5m2: (127 - 14, 2)}


def amax_of(x: torch.Tensor, dim: int | None) -> torch.Tensor:
    """``max |x|`` over the tensor (``dim=None``) or along ``dim`` (kept), in ``x``'s dtype."""
    if dim is None:
        low, high = torch.aminmax(x)
        return torch.maximum(high, low.neg_())
    return torch.maximum(x.amax(dim, keepdim=True), x.amin(dim, keepdim=True).neg_())


def scale_of(amax: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """The float32 scale that maps ``amax`` to ``dtype``'s largest finite value."""
    scale = (torch.finfo(dtype).max / amax.to(torch.float64).clamp(min=EPS)).to(torch.float32)
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def round_to_fp8(v: torch.Tensor, dtype: torch.dtype, work: torch.Tensor | None = None) -> None:
    """Round the float32 ``v`` in place to ``dtype``'s grid (``|v| <= dtype``'s maximum).

    ``work``: an int32 tensor of ``v``'s shape to use as scratch (default: a new one).

    Example:
        >>> v = torch.tensor([1.0625, 1.1875, 2.0**-10, 300.0])
        >>> round_to_fp8(v, torch.float8_e4m3fn)
        >>> v.tolist()  # ties to even; 2**-10 is half of e4m3's smallest subnormal
        [1.0, 1.25, 0.0, 288.0]
    """
    min_exponent, mantissa_bits = _GRID[dtype]
    c = torch.bitwise_and(v.view(torch.int32), 0x7F800000, out=work)
    c.clamp_(min=min_exponent << 23).add_(((23 - mantissa_bits) << 23) | 0x400000)
    offset = c.view(torch.float32)
    v.add_(offset).sub_(offset)


def quantize(
    x: torch.Tensor, dtype: torch.dtype, dim: int | None, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` cast to ``dtype`` with a dynamic scale and read back: ``(dequantized, scale)``.

    The dequantized tensor is float32 with ``x``'s layout (what torchao's emulated GEMM
    reads); ``dim`` is the dimension the rowwise amax reduces (None: one scale).

    Example:
        >>> dq, scale = quantize(torch.tensor([[896.0, 1.0]]), torch.float8_e4m3fn, None, False)
        >>> float(scale), dq.tolist()
        (0.5, [[896.0, 1.0]])
    """
    scale = scale_of(amax_of(x, dim), dtype, pow2)
    out = torch.empty_like(x, dtype=torch.float32)
    if x.dtype == torch.float32:
        torch.mul(x, scale, out=out)
    else:  # the product is a float32 one, as torchao's
        out.copy_(x).mul_(scale)
    round_to_fp8(out, dtype, torch.empty_like(out, dtype=torch.int32))
    return out.div_(scale), scale


def _saturation_limit(dtype: torch.dtype) -> float:
    """The smallest magnitude ``dtype``'s cast clips: its largest value plus half a spacing."""
    largest = torch.finfo(dtype).max
    return largest + 2.0 ** (math.floor(math.log2(largest)) - _GRID[dtype][1] - 1)


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
        saturated=(scaled.abs() > _saturation_limit(dtype)).sum(),
        flushed=((bits == 0) & (x != 0)).sum(),
        numel=x.numel(),
    )
