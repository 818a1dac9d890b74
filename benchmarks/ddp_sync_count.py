"""Host reads per optimizer step made by mixprec under DDP: 2 gloo ranks on the CPU.

Run: ``python benchmarks/ddp_sync_count.py``; prints each rank's reads per step for a
non-fused SGD and a fused AdamW (counted as ``tests/test_sync_budget.py`` counts them).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import mixprec as amp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from spawn import run

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.01),
    "adamw-fused": lambda p: torch.optim.AdamW(p, fused=True),
}


def _count(rank: int, world: int) -> dict[str, float]:
    del rank, world
    result = {}
    for name, make in OPTIMIZERS.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))
        step = amp.build_train_network(
            DistributedDataParallel(model),
            make(model.parameters()),
            nn.CrossEntropyLoss(),
            level="O1",
            dtype="bf16",
        )
        x, y = torch.randn(8, 16), torch.randint(0, 8, (8,))
        step(x, y)
        count = [0]
        originals = {n: getattr(torch.Tensor, n) for n in ("item", "__float__", "tolist")}
        for n, original in originals.items():

            def counted(
                self: torch.Tensor, *args: Any, _original: Any = original, _n: list[int] = count
            ) -> Any:
                if f"{os.sep}mixprec{os.sep}" in sys._getframe(1).f_code.co_filename:
                    _n[0] += 1
                return _original(self, *args)

            setattr(torch.Tensor, n, counted)
        try:
            for _ in range(4):
                step(x, y)
        finally:
            for n, original in originals.items():
                setattr(torch.Tensor, n, original)
        result[name] = count[0] / 4
    return result


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as out:
        print(run(_count, Path(out), bound=280.0))
