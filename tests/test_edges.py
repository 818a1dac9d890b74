"""Edges a user meets first: a model already in low precision, the CPU the tests fake."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from conftest import AVX512_NO_BF16, fake_cpu


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("level", ["O1", "O2", "O3", "autocast"])
def test_a_model_in_low_precision_is_refused_at_conversion(level: str, dtype: torch.dtype) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).to(dtype)
    with pytest.raises(ValueError, match=rf"network holds {dtype} parameters \(e.g. '0.weight'\)"):
        mixprec.auto_mixed_precision(model, level, "bf16")
    with pytest.raises(ValueError, match="model.float()"):
        mixprec.custom_mixed_precision(model, white_list=[nn.Linear])
    assert mixprec.auto_mixed_precision(model, "O0") is model  # O0 runs it as it is


def test_a_float64_model_still_converts_and_runs_in_float64() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).double()
    out = mixprec.auto_mixed_precision(model, "O2", "bf16")(torch.randn(2, 4, dtype=torch.float64))
    assert out.dtype == torch.float64


def test_the_slow_dtype_warning_describes_the_faked_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpu(monkeypatch, AVX512_NO_BF16)
    with pytest.warns(UserWarning, match=r"this CPU \(AVX512\) has no native bfloat16 matmul"):
        mixprec.auto_mixed_precision(nn.Linear(4, 4), "O2", "bf16")
