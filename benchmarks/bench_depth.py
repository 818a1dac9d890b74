"""How deep a chain of nested modules can be before Python's recursion limit, at each level.

A chain of ``Wrap`` modules (each calls its child and adds 1) around an ``nn.Linear``, run
unconverted and converted at every level under the default recursion limit (1000); the
conversion itself runs with a higher limit, so only the forward is measured.

Run: python benchmarks/bench_depth.py
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch import nn

import mixprec as amp


class Wrap(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + 1


def _chain(depth: int) -> nn.Module:
    module: nn.Module = nn.Linear(2, 2)
    for _ in range(depth):
        module = Wrap(module)
    return module


def _runs(depth: int, level: str | None) -> bool:
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20 * limit)
    try:
        model = _chain(depth)
        if level is not None:
            model = amp.auto_mixed_precision(model, level, torch.bfloat16)
    finally:
        sys.setrecursionlimit(limit)
    try:
        with torch.no_grad():
            model(torch.randn(1, 2))
    except RecursionError:
        return False
    return True


def deepest(level: str | None) -> int:
    """The deepest chain that runs (binary search)."""
    low, high = 1, 2000
    while low < high:
        middle = (low + high + 1) // 2
        if _runs(middle, level):
            low = middle
        else:
            high = middle - 1
    return low


def main() -> None:
    warnings.filterwarnings("ignore")
    print(f"recursion limit {sys.getrecursionlimit()}: deepest chain of nested modules that runs")
    for level in (None, "autocast", "O1", "O2", "O3"):
        print(f"  {level or 'unconverted':12s} {deepest(level)}")


if __name__ == "__main__":
    main()
