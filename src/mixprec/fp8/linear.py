"""``Fp8Linear``: a linear layer whose three GEMMs run in emulated fp8.

The forward and backward follow torchao's ``matmul_with_hp_or_float8_args`` step for step
(the same reshapes, transposes and operand layouts, so that the float32 GEMMs see the very
same tensors), with each cast done by :func:`mixprec.fp8.scaling.quantize`. Where the recipe
casts an operand the same way for two GEMMs (tensorwise: the input for ``output`` and
``grad_weight``, the weight for ``output`` and ``grad_input``, the output gradient for both
backward GEMMs), it is cast once and the dequantized tensor reused: the same bits, half the
work. High-precision GEMMs (``rowwise_with_gw_hp``'s ``grad_weight``) of float16/bfloat16
operands run as a float32 GEMM rounded once to the operands' dtype. The layer does its own
precision: the torch-function modes of a level (O1's lists, the low-precision emulation)
stand aside inside it.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from mixprec.fp8.recipes import CastSpec, Fp8Config, Gemm
from mixprec.fp8.scaling import CastStats, cast_stats, quantize

__all__ = ["Fp8Linear"]


class Recorder(Protocol):
    """Where an ``Fp8Linear`` reports its casts while statistics are collected."""

    def record(self, layer: str, gemm: Gemm, operand: str, stats: CastStats | None) -> None:
        """Take the statistics of one cast (None: the operand stayed in high precision)."""


def _cast(
    x: torch.Tensor, spec: CastSpec, dim: int, pow2: bool, stats: bool
) -> tuple[torch.Tensor, CastStats | None]:
    """One operand as its GEMM reads it (dequantized fp8, or ``x`` in high precision),
    with the cast's statistics when asked."""
    if spec.dtype is None:
        return x, None
    dequantized, scale = quantize(x, spec.dtype, dim if spec.rowwise else None, pow2)
    return dequantized, cast_stats(x, scale, spec.dtype) if stats else None


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """A GEMM on dequantized (float32) or high-precision operands, in ``out_dtype``."""
    if a.dtype in (torch.float16, torch.bfloat16):
        a, b = a.float(), b.float()
    return torch.mm(a, b).to(out_dtype)


def _reused(first: CastSpec, second: CastSpec) -> bool:
    """Whether an operand's second cast is its first one (one scale, same dtype)."""
    return first == second and not first.rowwise and first.dtype is not None


class _Fp8Matmul(torch.autograd.Function):
    """``input @ weight_t`` with fp8 operands in all three GEMMs (torchao's order)."""

    @staticmethod
    def forward(
        ctx: Any,
        input_hp: torch.Tensor,
        weight_t: torch.Tensor,
        layer: Fp8Linear,
    ) -> torch.Tensor:
        with torch._C.DisableTorchFunction():  # the level's modes stand aside
            return _Fp8Matmul._forward(ctx, input_hp, weight_t, layer)

    @staticmethod
    def _forward(
        ctx: Any, input_hp: torch.Tensor, weight_t: torch.Tensor, layer: Fp8Linear
    ) -> torch.Tensor:
        # The layer, not its attributes: a traced graph reads the recorder at run time.
        config, recorder, name = layer.fp8_config, layer._fp8_recorder, layer.fp8_name
        c, pow2, want = config, config.pow2_scales, recorder is not None
        x = input_hp.reshape(-1, input_hp.shape[-1])
        x_q, x_stats = _cast(x, c.input, -1, pow2, want)
        w_q, w_stats = _cast(weight_t, c.weight, 0, pow2, want)
        out = _mm(x_q, w_q, input_hp.dtype)
        if recorder is not None:
            recorder.record(name, Gemm.OUTPUT, "input", x_stats)
            recorder.record(name, Gemm.OUTPUT, "weight", w_stats)
        same_x = _reused(c.input, c.input_for_grad_weight)
        same_w = _reused(c.weight, c.weight_for_grad_input)
        ctx.save_for_backward(x_q if same_x else x, w_q if same_w else weight_t)
        ctx.same_x, ctx.same_w, ctx.x_stats, ctx.w_stats = same_x, same_w, x_stats, w_stats
        ctx.config, ctx.recorder, ctx.name = config, recorder, name
        return out.reshape(*input_hp.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with torch._C.DisableTorchFunction():
            return _Fp8Matmul._backward(ctx, grad_output)

    @staticmethod
    def _backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight_t = ctx.saved_tensors
        c: Fp8Config = ctx.config
        pow2, recorder = c.pow2_scales, ctx.recorder
        want = recorder is not None
        go = grad_output.reshape(-1, grad_output.shape[-1])

        go_gi, go_stats = _cast(go, c.grad_output, -1, pow2, want)
        if ctx.same_w:
            w_q, w_stats = weight_t, ctx.w_stats
        else:
            w_q, w_stats = _cast(weight_t, c.weight_for_grad_input, -1, pow2, want)
        grad_input = _mm(go_gi, w_q.t(), grad_output.dtype)
        grad_input = grad_input.reshape(*grad_output.shape[:-1], grad_input.shape[-1])

        if _reused(c.grad_output, c.grad_output_for_grad_weight):
            go_gw, go_gw_stats = go_gi, go_stats
        else:
            go_gw, go_gw_stats = _cast(go, c.grad_output_for_grad_weight, 0, pow2, want)
        if ctx.same_x:
            x_q, x_stats = x, ctx.x_stats
        else:
            x_q, x_stats = _cast(x, c.input_for_grad_weight, 0, pow2, want)
        grad_weight = _mm(go_gw.t(), x_q, grad_output.dtype)
        if recorder is not None:
            for gemm, operand, stats in (
                (Gemm.GRAD_INPUT, "grad_output", go_stats),
                (Gemm.GRAD_INPUT, "weight", w_stats),
                (Gemm.GRAD_WEIGHT, "grad_output", go_gw_stats),
                (Gemm.GRAD_WEIGHT, "input", x_stats),
            ):
                recorder.record(ctx.name, gemm, operand, stats)
        return grad_input, grad_weight.t(), None


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs run in emulated fp8 (see :mod:`mixprec.fp8`).

    Made by :func:`mixprec.fp8.apply_fp8` from an ``nn.Linear``, sharing its Parameters.
    The output (and every gradient) has the input's dtype; the bias is added in it.

    Attributes:
        fp8_config: the :class:`~mixprec.fp8.recipes.Fp8Config` of the recipe.
        fp8_name: the layer's qualified name in the model (the statistics' key).
    """

    fp8_config: Fp8Config
    fp8_name: str
    _fp8_recorder: Recorder | None

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: Fp8Config, name: str) -> Fp8Linear:
        """An ``Fp8Linear`` computing with ``linear``'s very Parameters."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        new.fp8_config = config
        new.fp8_name = name
        new._fp8_recorder = None
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output = _Fp8Matmul.apply(input, self.weight.t(), self)
        if self.bias is not None:
            output = output + self.bias.to(output.dtype)
        return output

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.fp8_config.describe()}"
