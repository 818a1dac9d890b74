"""Host time per layer of a chain of small ``nn.Linear`` layers: every level vs torch.autocast.

The model is a ``Sequential`` holding a ``Sequential`` of ``--layers`` ``Linear(8, 8)``
(batch 2), so that nearly all of a forward is the per-layer path: the module call, the
weight reads and casts, the ``linear`` call (and at O1 the cast of each result back to
float32). Every column is timed in interleaved rounds (one forward of each per round, in an
order shuffled each round); printed are the median microseconds per layer and the ratio to
``torch.autocast("cpu", torch.bfloat16)`` on the original chain. One thread.

Run: python benchmarks/bench_chain.py [--layers 50] [--rounds 200] [--grad]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import mixprec as amp

LEVELS = ("O1", "autocast", "O2", "O3")


def chain(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--grad", action="store_true", help="forward and backward")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = chain(args.layers)
    x = torch.randn(2, 8)

    def autocast_call() -> torch.Tensor:
        with torch.autocast("cpu", torch.bfloat16):
            return model(x)

    calls: dict[str, Callable[[], torch.Tensor]] = {"torch.autocast": autocast_call}
    for level in LEVELS:
        converted = amp.auto_mixed_precision(chain(args.layers), level, torch.bfloat16)
        calls[level] = lambda converted=converted: converted(x)  # type: ignore[misc]

    def once(call: Callable[[], torch.Tensor]) -> float:
        start = time.perf_counter()
        with torch.set_grad_enabled(args.grad):
            out = call()
            if args.grad:
                out.float().sum().backward()
        return time.perf_counter() - start

    for call in calls.values():
        for _ in range(3):
            once(call)
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    shuffle = random.Random(0).shuffle
    for _ in range(args.rounds):
        shuffle(order)
        for name in order:
            times[name].append(once(calls[name]))
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    base = medians["torch.autocast"]
    what = "forward+backward" if args.grad else "forward (no grad)"
    print(f"host time per layer, {args.layers} x Linear(8, 8), {what}, median of {args.rounds}")
    for name, seconds in medians.items():
        print(f"{name:15s} {seconds / args.layers * 1e6:7.2f} us  {seconds / base:5.2f}x")


if __name__ == "__main__":
    main()
