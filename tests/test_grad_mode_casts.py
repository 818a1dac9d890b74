"""A weight cast under one grad mode is not handed to a use under another, in one forward:
a cast made under ``torch.no_grad()`` has no gradient path and one made under
``inference_mode`` cannot be saved for backward. Each case compares the converted model's
weight gradient with the float32 original's (bfloat16 tolerance)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import mixprec as amp

LEVELS = ["O1", "autocast", "O2", "O3"]


class _Twice(nn.Module):
    """Uses ``fc`` once inside ``first`` (a grad-mode context or a checkpoint), then plainly."""

    def __init__(self, first: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.first = first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        target = self.first(self.fc, x)
        return ((self.fc(x) - target.detach().float() + 1.0) ** 2).sum()


def _no_grad(fc: nn.Module, x: torch.Tensor) -> Any:
    with torch.no_grad():
        return fc(x)


def _inference(fc: nn.Module, x: torch.Tensor) -> Any:
    with torch.inference_mode():
        return fc(x).clone()


def _reentrant(fc: nn.Module, x: torch.Tensor) -> Any:
    return checkpoint(fc, x, use_reentrant=True)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("first", [_no_grad, _inference, _reentrant], ids=lambda f: f.__name__)
def test_a_use_with_gradients_after_a_no_grad_use_gets_its_gradient(
    level: str, first: Callable[[nn.Module, torch.Tensor], torch.Tensor]
) -> None:
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    model = _Twice(first)
    model(x).backward()
    expected = model.fc[0].weight.grad.clone()
    model.zero_grad()
    converted = amp.auto_mixed_precision(model, level, torch.bfloat16)
    loss = converted(x)
    assert loss.requires_grad
    loss.backward()
    got = model.fc[0].weight.grad
    assert got is not None
    torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("level", LEVELS)
def test_a_frozen_weight_cast_under_inference_mode_is_not_saved_for_backward(level: str) -> None:
    """A frozen layer (no gradient of its own) used under inference_mode, then on an input
    that needs a gradient: its weight is saved for that input's gradient."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.frozen = nn.Linear(4, 4).requires_grad_(False)
            self.head = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.inference_mode():
                self.frozen(x)  # a statistic, thrown away
            return self.frozen(self.head(x).expand(-1, 4)).sum()

    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    model = Net()
    model(x).backward()
    expected = model.head.weight.grad.clone()
    model.zero_grad()
    amp.auto_mixed_precision(model, level, torch.bfloat16)(x).backward()
    torch.testing.assert_close(model.head.weight.grad, expected, rtol=0.05, atol=0.05)
