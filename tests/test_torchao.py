"""mixprec on top of torchao's float8 training (``convert_to_float8_training``).

torchao swaps ``nn.Linear`` for ``Float8Linear`` (its GEMMs in float8, scales computed in
float32 from the float32 weights); mixprec's level then decides everything else. On a
CPU torchao runs its float8 GEMMs emulated (``Float8LinearConfig(emulate=True)``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

float8 = pytest.importorskip("torchao.float8", reason="torchao is not installed")

import mixprec  # noqa: E402

LEVELS = ["O0", "O1", "O2", "O3", "autocast"]


def float8_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 16))
    float8.convert_to_float8_training(model, config=float8.Float8LinearConfig(emulate=True))
    return model


def train_step(level: str, *, emulate: bool) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = float8_model()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    reference = model(x).detach()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bfloat16 is slow on this CPU: the tensors are tiny
        converted = mixprec.auto_mixed_precision(model, level, "bf16", emulate=emulate)
    out = converted(x)
    out.float().square().mean().backward()
    return model, out, reference


@pytest.mark.parametrize("level", LEVELS)
def test_float8_training_at_every_level(level: str) -> None:
    model, out, reference = train_step(level, emulate=False)
    assert type(model[0]).__name__ == "Float8Linear"
    expected = torch.bfloat16 if level == "autocast" else torch.float32
    assert out.dtype == expected
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    error = float((out.float() - reference).abs().max() / reference.abs().max())
    assert error < (1e-6 if level == "O0" else 0.05)  # bfloat16 rounding around float8 GEMMs


@pytest.mark.parametrize("level", [lvl for lvl in LEVELS if lvl != "O0"])
def test_float8_training_emulated(level: str) -> None:
    model, out, reference = train_step(level, emulate=True)
    assert all(p.grad is not None for p in model.parameters())
    assert float((out.float() - reference).abs().max() / reference.abs().max()) < 0.05


def test_o1_leaves_float8_scale_math_in_float32() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = mixprec.explain(mixprec.auto_mixed_precision(float8_model(), "O1", "bf16"))
    weight_casts = [
        cast for row in plan.to_dict()["rows"] for cast in row["casts_before"] if ".weight" in cast
    ]
    assert weight_casts == []  # Float8Linear scales its float32 weight itself
