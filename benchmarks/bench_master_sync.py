"""What the masters' check before every forward costs: ``MasterWeights.sync`` (it copies every
float32 master into its low copy, so a write that moves no version counter is seen) against
the whole O2 step and against the fused AdamW step of the same masters.

The model: an MLP ``width -> 4*width -> 4*width -> width``, bf16 at O2, batch ``--batch``.
Medians of ``--repeats`` runs of each, interleaved. On a CPU shared with other jobs, run it
with one thread: a copy this small otherwise times the wake-up of a descheduled worker.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/bench_master_sync.py [--width 256 512] [--batch 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

import mixprec


def _median_ms(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def measure(width: int, batch: int, repeats: int) -> dict[str, float]:
    """Median milliseconds of the O2 step, the sync, and the optimizer step alone."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(width, 4 * width),
        nn.ReLU(),
        nn.Linear(4 * width, 4 * width),
        nn.ReLU(),
        nn.Linear(4 * width, width),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    step = mixprec.build_train_network(
        model, optimizer, nn.MSELoss(), level="O2", dtype="bf16", loss_scale_manager=None
    )
    assert step.masters is not None
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    for _ in range(3):
        step(x, y)
    grads = [torch.randn_like(p) for p in model.parameters()]

    def optimizer_step() -> None:
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g
        optimizer.step()

    result = _median_ms(
        {"step": lambda: step(x, y), "sync": step.masters.sync, "optimizer": optimizer_step},
        repeats,
    )
    result["params"] = sum(p.numel() for p in model.parameters()) / 1e6
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    print("| params | O2 step ms | sync ms | sync / step | fused AdamW step ms | sync / AdamW |")
    print("|---|---|---|---|---|---|")
    for width in args.width:
        r = measure(width, args.batch, args.repeats)
        print(
            f"| {r['params']:.2f}M | {r['step']:.1f} | {r['sync']:.2f} | "
            f"{100 * r['sync'] / r['step']:.1f}% | {r['optimizer']:.2f} | "
            f"{100 * r['sync'] / r['optimizer']:.0f}% |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
