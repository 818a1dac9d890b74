"""A ``forward`` set on a module's instance before conversion (a monkeypatch; accelerate's
hooks set a ``functools.partial`` of the module and keep the class's as ``_old_forward``)
runs in the converted model at every level, on the converted model's children."""

from __future__ import annotations

import functools
import types
from typing import Any

import pytest
import torch
from torch import nn

import mixprec as amp

LEVELS = ["O1", "autocast", "O2", "O3"]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU()))


@pytest.mark.parametrize("level", LEVELS)
def test_a_patched_instance_forward_runs_on_the_converted_children(level: str) -> None:
    model = _model()
    seen: list[torch.dtype] = []

    def patched(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        inner = self[0](x)  # a child of the module the method is bound to
        seen.append(inner.dtype)
        return inner * 0 + 7.0

    block = model[1]
    block.forward = types.MethodType(patched, block)
    x = torch.randn(2, 4)
    expected = model(x)
    assert seen == [torch.float32]
    out = amp.auto_mixed_precision(model, level, torch.bfloat16)(x)
    torch.testing.assert_close(out.float(), expected, rtol=0, atol=0)
    # the child ran converted: a white-list Linear's result is low (O1 casts it back)
    assert seen[1] == (torch.float32 if level == "O1" else torch.bfloat16)
    assert model(x).dtype == torch.float32  # the original keeps its own forward
    assert seen[2] == torch.float32


@pytest.mark.parametrize("level", LEVELS)
def test_an_accelerate_style_hooked_forward_runs(level: str) -> None:
    """The hook pattern of ``accelerate.hooks.add_hook_to_module``: the class's forward kept
    as ``_old_forward`` and a partial of the module set as ``forward``."""
    model = _model()
    layer = model[0]
    calls: list[str] = []

    def new_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        calls.append("hook")
        return module._old_forward(*args, **kwargs) * 2.0

    layer._old_forward = layer.forward
    layer.forward = functools.partial(new_forward, layer)
    x = torch.randn(2, 4)
    expected = model(x)
    converted = amp.auto_mixed_precision(model, level, torch.bfloat16)
    calls.clear()
    out = converted(x)
    assert calls == ["hook"]
    torch.testing.assert_close(out.float(), expected, rtol=0.05, atol=0.05)
    twice = converted[0](x)  # the hooked layer called directly
    torch.testing.assert_close(twice.float(), layer._old_forward(x) * 2.0, rtol=0.05, atol=0.05)
