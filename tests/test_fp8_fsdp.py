"""FSDP2 with emulated fp8: two gloo processes train as one process does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from mixprec.distributed import fully_shard
from mixprec.fp8 import Fp8Linear, apply_fp8
from spawn import run

pytestmark = pytest.mark.distributed

STEPS = 3


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.Linear(32, 4),
    )


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator))
        for _ in range(STEPS)
    ]


def _train(model: nn.Module) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in _batches():  # the same batch on every rank: the mean gradient is the local one
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _sharded(rank: int, world: int, recipe: str) -> dict[str, Any]:
    model = fully_shard(_model(), "O0", fp8=recipe)
    names = [name for name, m in model.named_modules() if isinstance(m, Fp8Linear)]
    losses = _train(model)
    full = {name: p.full_tensor().detach() for name, p in model.named_parameters()}  # type: ignore[operator]
    return {"names": names, "losses": losses, "params": full}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fsdp2_fp8_trains_as_one_process(recipe: str, tmp_path: Path) -> None:
    ranks = run(_sharded, tmp_path, recipe, bound=300.0)
    local = apply_fp8(_model(), recipe, emulate=True)
    losses = _train(local)
    for result in ranks:
        assert result["names"] == ["2", "4"]  # the default layers, swapped in place
        assert result["losses"] == losses  # the same fp8 numerics, step after step
        for name, param in local.named_parameters():
            assert torch.equal(result["params"][name], param.detach()), name
