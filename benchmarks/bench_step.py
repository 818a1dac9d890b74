"""Host time per training step: mixprec's step at every level vs the hand-written loop.

The hand-written loop is what a PyTorch user writes without mixprec::

    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()      # GradScaler: enabled for float16 only
    scaler.step(optimizer)
    scaler.update()

and each mixprec column is ``step(x, y)`` of ``mixprec.build_train_network(model, optimizer,
loss_fn, level=..., dtype=...)`` on a copy of the same model (its defaults: float16 gets a
dynamic loss scale, bfloat16 none; O2/O3 keep float32 master weights). The models are tiny
(an MLP 16-32-32-8 at batch 4, a one-layer transformer encoder on 4x8 tokens), so compute is
negligible and what is timed is the host (Python and dispatcher) time of a step: the time a
launch-bound GPU waits on. SGD with momentum, one thread. Every column is timed in
interleaved rounds (one step of each per round, in turn) and reported as the median, as a
ratio to the hand-written loop.

The ``ops`` rows count the aten operators one step dispatches (views, other metadata-only
operators and the profiler's range markers left out; counted with a ``TorchDispatchMode`` on
a step after the warm-up): a figure that does not vary from run to run, unlike the times.

``--device cuda`` runs the columns on the GPU: each timed step starts on an idle GPU (a
synchronize before it, outside the time) and is timed until it returns.

``--instructions`` adds, for each row, the CPU instructions per step (each column in a
process of its own under valgrind's callgrind, counting 20 steps after five warm-up ones):
free of the noise of a shared machine, and slow (a minute or more per column).

Run: python benchmarks/bench_step.py [--quick] [--rounds N] [--models mlp,transformer]
[--dtypes bf16,fp16] [--device cuda] [--instructions]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec as amp
from mixprec.cli.models import TinyMLP, TinyTransformer

LEVELS = ("O1", "O2", "O3", "autocast")
BASE = "torch.autocast"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

Step = Callable[[], Any]


def build(name: str, device: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A tiny model (random weights, seed 0), a batch and its labels, on ``device``."""
    torch.manual_seed(0)
    if name == "mlp":
        model: nn.Module = TinyMLP()
        x = torch.randn(4, 16)
        y = torch.randint(0, 8, (4,))
    elif name == "transformer":
        model = TinyTransformer()
        x = torch.randint(0, 50, (4, 8))
        y = torch.randint(0, 5, (4,))
    else:
        raise ValueError(f"unknown model {name!r}; choose mlp or transformer")
    return model.to(device), x.to(device), y.to(device)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def hand_written(model: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> Step:
    """The ``torch.autocast`` (+ ``GradScaler`` for float16) loop, one step per call."""
    model = copy.deepcopy(model)
    optimizer = _optimizer(model)
    device = x.device.type
    scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss.detach()

    return step


def mixprec_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype, level: str
) -> Step:
    """mixprec's training step at ``level``, one step per call."""
    model = copy.deepcopy(model)
    step = amp.build_train_network(
        model, _optimizer(model), nn.CrossEntropyLoss(), level=level, dtype=dtype
    )
    return lambda: step(x, y)


def columns(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype
) -> dict[str, Step]:
    found = {BASE: hand_written(model, x, y, dtype)}
    for level in LEVELS:
        found[level] = mixprec_step(model, x, y, dtype, level)
    return found


def time_rounds(steps: dict[str, Step], rounds: int, idle: Callable[[], None]) -> dict[str, float]:
    """Median seconds per step of each column, in interleaved rounds (after five warm-up
    steps each; ``idle()`` runs before each timed step, outside its time)."""
    for step in steps.values():
        for _ in range(5):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            idle()
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


#: operators that only make a view or look at metadata (no kernel on any device); the
#: profiler's range markers (``profiler::``) are left out too
_NO_KERNEL = {
    "aten::detach",
    "aten::alias",
    "aten::lift_fresh",
    "aten::empty",
    "aten::empty_strided",
    "aten::empty_like",
}


class OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched inside it (views and metadata-only ones left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        name = func._schema.name
        if not (func.is_view or name in _NO_KERNEL or name.startswith("profiler::")):
            self.count += 1
        return func(*args, **(kwargs or {}))


def count_ops(steps: dict[str, Step]) -> dict[str, int]:
    """Operators of one step of each column (run after the warm-up steps)."""
    counted = {}
    for name, step in steps.items():
        with OpCounter() as counter:
            step()
        counted[name] = counter.count
    return counted


def _child(model_name: str, dtype_name: str, column: str, steps: int) -> None:
    """Run inside valgrind: five warm-up steps, then ``steps`` with collection on."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    model, x, y = build(model_name, "cpu")
    dtype = DTYPES[dtype_name]
    if column == BASE:
        step = hand_written(model, x, y, dtype)
    else:
        step = mixprec_step(model, x, y, dtype, column)
    for _ in range(5):
        step()
    torch._C._valgrind_toggle()
    for _ in range(steps):
        step()
    torch._C._valgrind_toggle()


def instructions(model_name: str, dtype_name: str, column: str, steps: int = 20) -> float:
    """CPU instructions per step of one column, counted by callgrind."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_instructions import callgrind

    return callgrind(__file__, [model_name, dtype_name, column, str(steps)], column) / steps


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds (a smoke run)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="add a row per model and dtype: CPU instructions per step (callgrind; slow)",
    )
    args = parser.parse_args()
    rounds = args.rounds or (10 if args.quick else 300)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # (a tiny model's advisories, e.g. fp16 on CPU)
    idle = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    print(
        f"host time per training step on {args.device} (SGD momentum, one thread; median of "
        f"{rounds} interleaved rounds), ratio to the hand-written torch.autocast loop"
    )
    print(f"{'model':12s} {'dtype':6s} {BASE:>14s}" + "".join(f"{n:>10s}" for n in LEVELS))
    for model_name in args.models.split(","):
        for dtype_name in args.dtypes.split(","):
            model, x, y = build(model_name, args.device)
            steps = columns(model, x, y, DTYPES[dtype_name])
            med = time_rounds(steps, rounds, idle)
            base = med[BASE]
            row = f"{model_name:12s} {dtype_name:6s} {base * 1e6:11.1f} us"
            print(row + "".join(f"{med[n] / base:9.2f}x" for n in LEVELS), flush=True)
            ops = count_ops(steps)
            row = f"{model_name:12s} {'ops':6s} {ops[BASE]:14d}"
            print(row + "".join(f"{ops[n]:10d}" for n in LEVELS), flush=True)
            if args.instructions:
                with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                    counts = dict(
                        zip(
                            (BASE, *LEVELS),
                            pool.map(
                                lambda c: instructions(model_name, dtype_name, c),  # noqa: B023
                                (BASE, *LEVELS),
                            ),
                            strict=True,
                        )
                    )
                base_count = counts[BASE]
                row = f"{model_name:12s} {'instr':6s} {base_count / 1e6:11.2f} M "
                print(row + "".join(f"{counts[n] / base_count:9.2f}x" for n in LEVELS), flush=True)


if __name__ == "__main__":
    main()
