"""The guard check of a compiled call, timed alone: the original vs every level.

Before each call of a compiled function TorchDynamo checks the guards of its graph. On a
tiny model that check is a large share of a compiled call (see ``bench_compile.py``). Here
it is timed by itself: each column is a function ``run(model, x)`` compiled with the
``eager`` backend (the guards do not depend on the backend), and the check of its one cache
entry is called directly on that call's arguments, in batches of 200, the columns
interleaved; the time per check of each column's fastest batch is printed (the least
disturbed by other jobs on a shared machine).

The column "bound forward" is the original with each module's ``forward`` an instance
attribute (a bound method of one shared function that calls the class's forward): the
least a per-module wrapper can be. It shows what an instance ``forward`` costs by itself:
TorchDynamo no longer inlines the class's ``forward`` straight away (guarding only that the
instance has none) but traces ``nn.Module.__call__`` into it, guarding each step, and it
reaches the module by two sources (``parent._modules[name]`` and
``module.forward.__self__``), a pair it guards as aliases, checked in Python after its C++
guard tree. (A level's wrappers read their module by a global key instead: see
``mixprec.convert.structure.owner``.)

The checks in a loop find everything they read in the CPU's caches; a real call's check
comes after the previous call's work has evicted much of it. ``--cold`` times each check
right after an (untimed) forward of the model instead.

Under each model's times, the row "python" counts the guards checked in Python (aliasing
guards, nearly all): the rest are checked in C++.

Run: python benchmarks/bench_guards.py [--models nested,bert] [--checks 200] [--cold]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

import mixprec as amp
from bench_overhead import LEVELS, build


def _nested() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """60 modules: twelve blocks of a Linear, a Sequential(Linear, GELU) and a Linear."""
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.GELU()), nn.Linear(4, 4))
        for _ in range(12)
    ]
    return nn.Sequential(*blocks), {"input": torch.randn(2, 4)}


def _bound_forwards(model: nn.Module) -> nn.Module:
    """``model`` with each module's ``forward`` an instance attribute: a bound method of
    one function, which calls the class's own forward."""

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return type(self).forward(self, *args, **kwargs)

    for module in model.modules():
        module.__dict__["forward"] = types.MethodType(forward, module)
    return model


def _run(model: nn.Module, inputs: dict[str, torch.Tensor]) -> Any:
    return model(**inputs)


def _run_autocast(model: nn.Module, inputs: dict[str, torch.Tensor]) -> Any:
    with torch.autocast("cpu", torch.bfloat16):
        return model(**inputs)


def guard_check(
    run: Callable[..., Any], model: nn.Module, inputs: dict[str, torch.Tensor]
) -> Callable[[], Any]:
    """The guard check of ``run(model, inputs)`` compiled, as a call with no arguments.

    Each call compiles a copy of ``run`` with a code object of its own, so the guards of
    every column stay live side by side (a reset would leave the earlier ones empty)."""
    run = types.FunctionType(run.__code__.replace(), run.__globals__, run.__name__)
    compiled = torch.compile(run, backend="eager")
    with torch.no_grad():
        compiled(model, inputs)
    entries = _debug_get_cache_entry_list(run.__code__)
    if len(entries) != 1:
        raise RuntimeError(f"expected one compiled graph, found {len(entries)}")
    guards = entries[0].guard_manager
    frame = {"model": model, "inputs": inputs}
    with torch.no_grad():
        if not guards.check(frame):
            raise RuntimeError("the guards reject the call they were made for")
    check = functools.partial(guards.check, frame)
    #: guards TorchDynamo checks in Python (nearly all of them aliasing guards: one object
    #: reached by two paths), read from the printed guard tree
    check.lambdas = str(guards).count("LAMBDA_GUARD")  # type: ignore[attr-defined]
    return check


def check_times(checks: list[Callable[[], Any]], per_batch: int, rounds: int) -> list[float]:
    """Seconds of one call of each of ``checks``: batches of ``per_batch`` calls, the
    columns interleaved for ``rounds`` rounds, the fastest batch of each (on a shared
    machine the least disturbed; interleaving gives every column the same disturbances)."""
    best = [float("inf")] * len(checks)
    with torch.no_grad():  # (the grad mode is one of the guards)
        for _ in range(rounds):
            for i, check in enumerate(checks):
                start = time.perf_counter()
                for _ in range(per_batch):
                    check()
                best[i] = min(best[i], (time.perf_counter() - start) / per_batch)
    return best


def cold_check_times(
    checks: list[Callable[[], Any]], between: Callable[[], Any], rounds: int
) -> list[float]:
    """Seconds of one call of each of ``checks`` made right after ``between()`` (a forward
    of the model, untimed: what a real call's check finds in the caches), the median of
    ``rounds`` interleaved rounds of 20 such checks each."""
    times: list[list[float]] = [[] for _ in checks]
    with torch.no_grad():
        for _ in range(rounds):
            for i, check in enumerate(checks):
                for _ in range(20):
                    between()
                    start = time.perf_counter()
                    check()
                    times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="nested,bert")
    parser.add_argument("--checks", type=int, default=200, help="checks per batch")
    parser.add_argument("--rounds", type=int, default=15, help="batches of each column")
    parser.add_argument(
        "--cold", action="store_true", help="each check right after a forward of the model"
    )
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    names = ("original", "bound forward", *LEVELS)
    how = (
        f"median of {args.rounds} interleaved rounds, each check after a forward"
        if args.cold
        else f"fastest of {args.rounds} interleaved batches"
    )
    print(f"guard check per compiled call, us ({how}); the original's under autocast")
    print(f"{'model':8s}" + "".join(f"{n:>15s}" for n in names))
    for model_name in args.models.split(","):
        model, inputs = _nested() if model_name == "nested" else build(model_name)
        checks = [
            guard_check(_run_autocast, model, inputs),
            guard_check(_run_autocast, _bound_forwards(build_again(model_name)), inputs),
        ]
        converted = [amp.auto_mixed_precision(model, level, torch.bfloat16) for level in LEVELS]
        checks += [guard_check(_run, c, inputs) for c in converted]
        if args.cold:
            times = cold_check_times(checks, functools.partial(model, **inputs), args.rounds)
        else:
            times = check_times(checks, args.checks, args.rounds)
        print(f"{model_name:8s}" + "".join(f"{t * 1e6:15.1f}" for t in times), flush=True)
        lambdas = [check.lambdas for check in checks]  # type: ignore[attr-defined]
        print(f"{'  python':8s}" + "".join(f"{n:15d}" for n in lambdas), flush=True)


def build_again(model_name: str) -> nn.Module:
    """A fresh copy of the model (same seed), for the column that edits it."""
    return _nested()[0] if model_name == "nested" else build(model_name)[0]


if __name__ == "__main__":
    main()
