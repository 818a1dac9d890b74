"""Shared test helpers: counting casts, relative error, small models (the tiny ones are
the library's own sample models in :mod:`mixprec.cli.models`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec.cli.models import SmallCNN, TinyMLP, TinyTransformer
from mixprec.inspect import CastCounter

__all__ = [
    "COMPILE_MIN",
    "MLP",
    "CastCounter",
    "ConvBranch",
    "SmallCNN",
    "TinyTransformer",
    "count_casts",
    "needs_compile",
    "rel_error",
]

MLP = TinyMLP

#: The oldest torch whose TorchDynamo compiles a converted model as the tests pin (no
#: graph break, no recompile); older ones run it eagerly only (docs/compile.md).
COMPILE_MIN = "2.13"
needs_compile = pytest.mark.skipif(
    torch.torch_version.TorchVersion(torch.__version__) < COMPILE_MIN,
    reason=f"torch.compile of a converted model needs torch {COMPILE_MIN} or later",
)


def compiled_in_one_graph(model: nn.Module, *args: Any) -> Any:
    """``model(*args)`` compiled (TorchDynamo, eager backend), after checking that
    TorchDynamo traces the call without a graph break (from a reset cache)."""
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(*args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    return torch.compile(model, backend="eager")(*args)


def count_casts(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, CastCounter]:
    with CastCounter() as counter:
        out = fn(*args, **kwargs)
    return out, counter


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-12))


class ConvBranch(nn.Module):
    """MindSpore's O1 example: a conv whose output feeds a relu->conv branch and a bn branch."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv1(x)
        return self.conv2(F.relu(y)) + self.bn(y)
