"""Models with one planted precision problem each, for the diagnostics.

The tests of :func:`mixprec.find_overflow`, :func:`mixprec.lint` and
:func:`mixprec.calibrate` and ``benchmarks/diagnose_report.py`` run them. Each lower-case
function is a model factory, so it can be named on the command line too, e.g.
``mixprec find-overflow mixprec.cli.planted:div_zero --input 3,4``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DivZero",
    "HandRMSNorm",
    "Log",
    "LogNeg",
    "MaskedAttention",
    "Offset",
    "div_zero",
    "log_neg",
    "sensitive_model",
    "tiny_bert",
]


class DivZero(nn.Module):
    """Divides by a zero-initialised buffer in its own code: inf in any precision."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 2)
        self.register_buffer("scale", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x) / self.scale)


class Log(nn.Module):
    """``torch.log`` as a module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class LogNeg(nn.Module):
    """Takes the log of a Linear's (partly negative) output: NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(4, 4), Log(), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class MaskedAttention(nn.Module):
    """A causal mask stored as -1e9 (buffer) and a -1e9 fill value (attribute)."""

    def __init__(self, dim: int = 8, size: int = 4) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.register_buffer("mask", torch.triu(torch.full((size, size), -1e9), 1))
        self.fill = -1e9

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ x.transpose(-1, -2) + self.mask
        return scores.softmax(-1) @ x


class HandRMSNorm(nn.Module):
    """An RMS norm written out in the dtype it runs in (no float32 inside)."""

    def __init__(self, dim: int, eps: float = 1e-8) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Offset(nn.Module):
    """x -> W(x + 3000) - 3000 W 1: exact in float32, ruined by rounding x + 3000 in low
    precision (float16 steps of 2 there)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) / dim**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x + 3000.0, self.weight) - 3000.0 * self.weight.sum(1)


def div_zero() -> nn.Module:
    """:class:`DivZero` (inputs ``(batch, 4)``)."""
    return DivZero()


def log_neg() -> nn.Module:
    """:class:`LogNeg` (inputs ``(batch, 4)``)."""
    return LogNeg()


def sensitive_model() -> nn.Module:
    """An MLP (inputs ``(batch, 8)``) whose one :class:`Offset` layer, ``"2"``, needs float32."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), Offset(16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    )


def tiny_bert() -> nn.Module:
    """A random 2-layer BERT, hidden 32, vocabulary 64, in eval mode (needs transformers)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
    )
    return transformers.BertModel(config).eval()
