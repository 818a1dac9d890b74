"""Host time per layer of a chain of small layers: every level vs torch.autocast.

The model is a ``Sequential`` holding a ``Sequential`` of ``--layers`` layers (by default
``Linear(8, 8)``, batch 2), so that nearly all of a forward is the per-layer path: the
module call, the weight reads and casts, the layer's call (and at O1 the cast of each
result back to float32). Every column is timed in interleaved rounds (one forward of each
per round, in an order shuffled each round); printed are the median microseconds per layer
and the ratio to ``torch.autocast("cpu", torch.bfloat16)`` on the original chain. One
thread.

``--layer relu`` chains ``nn.ReLU()`` on a (1, 4, 8, 8) input: no weight, nothing for
autocast to cast, so what a level adds is its module call alone. ``--split`` separates a
forward's two costs: it times a chain of one layer too, and prints that time (the root's
entry and exit, once per forward) and the time each further layer adds (the slope between
the two chains).

Run: python benchmarks/bench_chain.py [--layers 50] [--rounds 200] [--grad]
[--layer linear|relu] [--split]
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


LAYERS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "linear": (lambda: nn.Linear(8, 8), (2, 8)),
    "relu": (nn.ReLU, (1, 4, 8, 8)),
}


def chain(layers: int, layer: str = "linear") -> nn.Module:
    torch.manual_seed(0)
    make = LAYERS[layer][0]
    return nn.Sequential(nn.Sequential(*[make() for _ in range(layers)]))


def columns(layers: int, layer: str, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """One zero-argument forward per column: torch.autocast on the chain, then each level."""
    model = chain(layers, layer)

    def autocast_call() -> torch.Tensor:
        with torch.autocast("cpu", torch.bfloat16):
            return model(x)

    calls: dict[str, Callable[[], torch.Tensor]] = {"torch.autocast": autocast_call}
    for level in LEVELS:
        converted = amp.auto_mixed_precision(chain(layers, layer), level, torch.bfloat16)
        calls[level] = lambda converted=converted: converted(x)  # type: ignore[misc]
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--grad", action="store_true", help="forward and backward")
    parser.add_argument("--layer", choices=sorted(LAYERS), default="linear")
    parser.add_argument(
        "--split", action="store_true", help="also a one-layer chain: fixed and per-layer cost"
    )
    args = parser.parse_args()
    if args.split and args.layers < 2:
        parser.error(f"--split needs --layers of 2 or more, got {args.layers}")
    torch.set_num_threads(1)
    x = torch.randn(*LAYERS[args.layer][1])
    if args.grad and not any(p.requires_grad for p in chain(1, args.layer).parameters()):
        x.requires_grad_()  # (a chain with no weights: its input carries the gradient)
    calls = columns(args.layers, args.layer, x)
    if args.split:  # (the one-layer chain's columns, timed in the same rounds)
        calls.update({f"{n} /1": c for n, c in columns(1, args.layer, x).items()})

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
    layer = f"{args.layers} x {chain(1, args.layer)[0][0]}"
    print(f"host time per layer, {layer}, {what}, median of {args.rounds}")
    for name in ("torch.autocast", *LEVELS):
        seconds = medians[name]
        print(f"{name:15s} {seconds / args.layers * 1e6:7.2f} us  {seconds / base:5.2f}x")
    if args.split:
        print("split: the one-layer chain's time (entry and exit), and each further layer's")
        for name in ("torch.autocast", *LEVELS):
            one = medians[f"{name} /1"]
            step = (medians[name] - one) / (args.layers - 1)
            print(f"{name:15s} one layer {one * 1e6:7.2f} us   each further {step * 1e6:6.2f} us")


if __name__ == "__main__":
    main()
