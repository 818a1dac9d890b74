"""SyncBatchNorm under DDP at O2 (needs CUDA: one NCCL process per GPU, up to two)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import mixprec as amp
from spawn import run

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _sync_bn(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(512, 4)
    )
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda()
    # what the island's own code receives (a pre-hook sees the caller's input, low, as
    # under torch.autocast)
    seen: list[torch.dtype] = []
    norm = model[1]
    norm.forward = lambda x: (seen.append(x.dtype), type(norm).forward(norm, x))[1]
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    step = amp.build_train_network(
        ddp, torch.optim.SGD(model.parameters(), lr=0.05), nn.CrossEntropyLoss(), "O2", dtype="fp16"
    )
    generator = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(4, 3, 8, 8, generator=generator).cuda()
        y = torch.randint(0, 4, (4,), generator=generator).cuda()
        step(x, y)
    return {
        "seen": seen[0],
        "params": torch.cat([p.detach().flatten().cpu() for p in model.parameters()]),
        "running_mean": model[1].running_mean.cpu(),
        "scale": step.loss_scale,
    }


def test_sync_batchnorm_is_a_float32_island_and_replicas_agree(tmp_path: Any) -> None:
    world = min(2, torch.cuda.device_count())
    ranks = run(_sync_bn, tmp_path, world=world, backend="nccl", bound=120.0)
    assert all(r["seen"] == torch.float32 for r in ranks)  # the island computes in float32
    for r in ranks[1:]:
        assert torch.equal(r["params"], ranks[0]["params"])
        assert torch.equal(r["running_mean"], ranks[0]["running_mean"])  # synced statistics
        assert r["scale"] == ranks[0]["scale"]
