"""AdaSum: the closed form, and the DDP hook on two gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec as amp
from mixprec.boost.adasum import adasum_pair
from spawn import run


def test_adasum_pair_closed_form() -> None:
    a, b = torch.tensor([3.0, 1.0]), torch.tensor([1.0, 2.0])
    dot = 5.0
    want = (1 - dot / (2 * 10)) * a + (1 - dot / (2 * 5)) * b
    torch.testing.assert_close(adasum_pair(a, b), want)
    torch.testing.assert_close(adasum_pair(a, a), a)  # agreeing gradients: their average
    torch.testing.assert_close(adasum_pair(a, torch.zeros(2)), a)  # a zero adds nothing


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def _worker(rank: int, world: int) -> dict[str, object]:
    generator = torch.Generator().manual_seed(10 + rank)
    x, y = (
        torch.randn(8, 4, generator=generator),
        torch.randint(0, 2, (8,), generator=generator),
    )
    local = _model()
    nn.CrossEntropyLoss()(local(x), y).backward()
    model = _model()
    refused = ""
    try:
        other = _model()
        amp.build_train_network(
            nn.parallel.DistributedDataParallel(other),
            torch.optim.SGD(other.parameters(), lr=0.0),
            nn.CrossEntropyLoss(),
            "O0",
            "O2",
        )
    except ValueError as error:
        refused = str(error)
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    seen: list[torch.Tensor] = []
    step = amp.build_train_network(
        ddp,
        torch.optim.SGD(model.parameters(), lr=0.0),
        nn.CrossEntropyLoss(),
        "O0",
        "O2",
        boost_config={"freeze": False, "optimizer": "off"},
        after_unscale=lambda s, params: seen.extend(p.grad.clone() for p in params),
    )
    step(x, y)
    return {
        "local": [p.grad for p in local.parameters()],
        "combined": seen,
        "refused": refused,
        "repr": repr(step),
    }


@pytest.mark.distributed
def test_adasum_hook_matches_the_closed_form_on_two_ranks(tmp_path: Path) -> None:
    ranks = run(_worker, tmp_path)
    for g0, g1, got0, got1 in zip(
        ranks[0]["local"],
        ranks[1]["local"],
        ranks[0]["combined"],
        ranks[1]["combined"],
        strict=True,
    ):
        want = adasum_pair(g0, g1)  # per parameter tensor
        torch.testing.assert_close(got0, want, rtol=1e-5, atol=1e-7)
        assert torch.equal(got0, got1)  # every rank holds the same gradient
    assert "adasum=on (2 ranks)" in ranks[0]["repr"]
    assert "find_unused_parameters=True" in ranks[0]["refused"]
