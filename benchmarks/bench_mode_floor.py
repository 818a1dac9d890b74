"""The floor of each run-time mechanism O1 could use, on the tiny models of bench_overhead.

Host time per forward (no grad, one thread), medians of interleaved rounds, as ratios to
``torch.autocast("cpu", bf16)``: the model in float32 with no mechanism, a
``TorchFunctionMode`` that only calls through (the floor of any per-call mode), and one
that looks each call up in a table and casts the white-list calls (O1's work), with the
number of torch-function calls per forward.

``--unit`` also prints the cost of each mechanism for one unit of work, in microseconds: an
op under no mode, a call-through mode and ``torch.autocast``; a ``nn.Linear`` call plain,
with an instance ``forward`` object that calls through (what O2/O3's ``ModuleCall`` costs a
submodule), and with a forward pre-hook and hook (what casting by hooks costs).

Run: python benchmarks/bench_mode_floor.py [--models gpt2,bert] [--rounds 40] [--unit]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from bench_overhead import build

WHITE = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.addmm}


class CallThrough(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class LookUpAndCast(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in WHITE:
            low = tuple(
                a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a in args
            )
            return func(*low, **(kwargs or {})).float()
        return func(*args, **(kwargs or {}))


class Count(TorchFunctionMode):
    calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def measure(name: str, rounds: int) -> None:
    """Print the ratios for one model."""
    torch.manual_seed(0)
    model, inputs = build(name)
    model.eval()

    def under(mode: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            with mode():
                return model(**inputs)

        return call

    calls = {
        "torch.autocast": under(lambda: torch.autocast("cpu", torch.bfloat16)),
        "float32, nothing": lambda: model(**inputs),
        "mode: call through": under(CallThrough),
        "mode: look up + cast": under(LookUpAndCast),
    }
    times: dict[str, list[float]] = {key: [] for key in calls}
    counter = Count()
    with torch.no_grad():
        with counter:
            model(**inputs)
        for call in calls.values():
            call()
        for _ in range(rounds):
            for key, call in calls.items():
                start = time.perf_counter()
                call()
                times[key].append(time.perf_counter() - start)
    base = statistics.median(times["torch.autocast"])
    print(f"{name}: {counter.calls} torch-function calls per forward")
    for key, values in times.items():
        print(f"  {key:22s} {statistics.median(values) / base:5.2f}x")


class _Through:
    """An instance ``forward`` that calls the class's, as a nested ``ModuleCall`` does."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return type(self.module).forward(self.module, *args, **kwargs)


def _median_us(work: Callable[[], Any], per: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        work()
        times.append((time.perf_counter() - start) / per * 1e6)
    return statistics.median(times)


def measure_units(rounds: int) -> None:
    """Microseconds per op under each mechanism, and per module call."""
    x = torch.randn(4, 4, dtype=torch.bfloat16)

    def ops() -> None:
        for _ in range(300):
            (x + x).view(16)

    def under(context: Callable[[], Any]) -> Callable[[], None]:
        def work() -> None:
            with context():
                ops()

        return work

    print("per op (an add and a view, 600 per round):")
    for key, work in {
        "no mode": ops,
        "call-through mode": under(CallThrough),
        "torch.autocast": under(lambda: torch.autocast("cpu", torch.bfloat16)),
    }.items():
        print(f"  {key:22s} {_median_us(work, 600, rounds):6.2f} us")
    inputs = torch.randn(1, 4)
    plain, through, hooked = (torch.nn.Linear(4, 4) for _ in range(3))
    through.forward = _Through(through)  # type: ignore[method-assign]
    hooked.register_forward_pre_hook(lambda module, args: None)
    hooked.register_forward_hook(lambda module, args, out: None)
    print("per nn.Linear(4, 4) call (1000 per round):")
    with torch.no_grad():
        for key, layer in {
            "plain": plain,
            "instance forward": through,
            "pre-hook + hook": hooked,
        }.items():

            def calls(layer: torch.nn.Module = layer) -> None:
                for _ in range(1000):
                    layer(inputs)

            print(f"  {key:22s} {_median_us(calls, 1000, rounds):6.2f} us")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt2,bert")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--unit", action="store_true", help="per-op and per-module costs too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.unit:
        measure_units(args.rounds)
    for name in args.models.split(","):
        measure(name, args.rounds)


if __name__ == "__main__":
    main()
