"""fp8 recipes: how each operand of a linear layer's three GEMMs is scaled and cast.

A linear layer ``y = x @ w.T`` runs three GEMMs in training: ``output = x @ w.T``,
``grad_input = grad_output @ w`` and ``grad_weight = grad_output.T @ x``. Each GEMM takes two
operands, and each operand is cast to fp8 with its own *dynamic* scale (computed from the
operand's absolute maximum at every call), or left in high precision. The three recipes are
torchao's (``Float8LinearConfig.from_recipe_name``), field for field:

========================  ============================  ===============================
recipe                    output, grad_input             grad_weight
========================  ============================  ===============================
``tensorwise``            one scale per tensor; x, w     the same casts
                          e4m3, grad_output e5m2
``rowwise``               one scale per row, all e4m3,   one scale per column (the
                          scales rounded down to a       reduction dim), e4m3
                          power of two
``rowwise_with_gw_hp``    rowwise, but w for             high precision (no fp8)
                          grad_input is one e4m3 scale
========================  ============================  ===============================
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = ["E4M3", "E5M2", "CastSpec", "Fp8Config", "Fp8Recipe", "Gemm"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


class Fp8Recipe(str, enum.Enum):
    """A scaling recipe (parsed from the user's string at the edge)."""

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    ROWWISE_WITH_GW_HP = "rowwise_with_gw_hp"

    @classmethod
    def parse(cls, value: object, argument: str = "fp8") -> Fp8Recipe:
        """``"rowwise"``, ``Fp8Recipe.ROWWISE`` -> ``Fp8Recipe.ROWWISE``; else a ValueError."""
        if isinstance(value, Fp8Recipe):
            return value
        if isinstance(value, str):
            for recipe in cls:
                if value.strip().lower() == recipe.value:
                    return recipe
        choices = ", ".join(repr(recipe.value) for recipe in cls)
        raise ValueError(f"{argument} must be one of {choices} (or None); got {value!r}")

    def __str__(self) -> str:
        return self.value


class Gemm(str, enum.Enum):
    """The three GEMMs of a linear layer in training."""

    OUTPUT = "output"
    GRAD_INPUT = "grad_input"
    GRAD_WEIGHT = "grad_weight"


@dataclass(frozen=True)
class CastSpec:
    """How one operand of one GEMM is cast.

    Attributes:
        dtype: the fp8 dtype, or None to keep the operand in high precision.
        rowwise: one scale per row of the operand as the GEMM reads it (else per tensor).
    """

    dtype: torch.dtype | None
    rowwise: bool = False

    def short(self) -> str:
        """``"e4m3/row"``, ``"e5m2/tensor"`` or ``"hp"``."""
        if self.dtype is None:
            return "hp"
        name = "e4m3" if self.dtype == E4M3 else "e5m2"
        return f"{name}/{'row' if self.rowwise else 'tensor'}"


@dataclass(frozen=True)
class Fp8Config:
    """A recipe made concrete: the cast of every operand of the three GEMMs.

    Attributes:
        recipe: the recipe it was made from.
        input / weight: the operands of ``output``.
        grad_output / weight_for_grad_input: the operands of ``grad_input``.
        grad_output_for_grad_weight / input_for_grad_weight: the operands of ``grad_weight``.
        pow2_scales: round every scale down to a power of two.
    """

    recipe: Fp8Recipe
    input: CastSpec
    weight: CastSpec
    grad_output: CastSpec
    weight_for_grad_input: CastSpec
    grad_output_for_grad_weight: CastSpec
    input_for_grad_weight: CastSpec
    pow2_scales: bool

    @classmethod
    def from_recipe(cls, recipe: Fp8Recipe | str) -> Fp8Config:
        """The config of a recipe (torchao's ``Float8LinearConfig.from_recipe_name``).

        Example:
            >>> Fp8Config.from_recipe("rowwise").grad_output.short()
            'e4m3/row'
        """
        parsed = Fp8Recipe.parse(recipe, "recipe")
        if parsed is Fp8Recipe.TENSORWISE:
            e4, e5 = CastSpec(E4M3), CastSpec(E5M2)
            return cls(parsed, e4, e4, e5, e4, e5, e4, pow2_scales=False)
        row = CastSpec(E4M3, rowwise=True)
        if parsed is Fp8Recipe.ROWWISE:
            return cls(parsed, row, row, row, row, row, row, pow2_scales=True)
        hp = CastSpec(None)
        return cls(parsed, row, row, row, CastSpec(E4M3), hp, hp, pow2_scales=True)

    def operands(self, gemm: Gemm) -> tuple[CastSpec, CastSpec]:
        """The casts of ``gemm``'s two operands, in the order the GEMM takes them."""
        if gemm is Gemm.OUTPUT:
            return self.input, self.weight
        if gemm is Gemm.GRAD_INPUT:
            return self.grad_output, self.weight_for_grad_input
        return self.grad_output_for_grad_weight, self.input_for_grad_weight

    def describe(self) -> str:
        """One line for ``extra_repr`` and the plan: the recipe and each GEMM's casts."""
        parts = [
            f"{gemm.value}={'x'.join(spec.short() for spec in self.operands(gemm))}"
            for gemm in Gemm
        ]
        return f"fp8={self.recipe.value} ({', '.join(parts)})"
