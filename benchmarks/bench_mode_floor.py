"""The floor of each run-time mechanism O1 could use, on the tiny models of bench_overhead.

Host time per forward (no grad, one thread), medians of interleaved rounds, as ratios to
``torch.autocast("cpu", bf16)``: the model in float32 with no mechanism, a
``TorchFunctionMode`` that only calls through (the floor of any per-call mode), and one
that looks each call up in a table and casts the white-list calls (O1's work), with the
number of torch-function calls per forward.

Run: python benchmarks/bench_mode_floor.py [--models gpt2,bert] [--rounds 40]
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt2,bert")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in args.models.split(","):
        measure(name, args.rounds)


if __name__ == "__main__":
    main()
