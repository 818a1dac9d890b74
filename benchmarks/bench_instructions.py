"""Host work per forward as CPU instructions: every level vs torch.autocast, free of noise.

Timings on a shared machine move by 10% from run to run; the instructions a forward
executes do not. Each column runs in a process of its own under valgrind's callgrind, which
counts the instructions of a loop of forwards only (collection is switched on around the
loop, after warm-up calls): interpreter, dispatcher, allocator and kernels together. On these
tiny models the kernels are a small share, so the ratio is the host work's.

The default model is the small ResNet-like CNN of ``bench_overhead.py`` (no transformers
import, whose start-up under valgrind takes minutes); ``--models gpt2`` works too, slowly.
Needs valgrind (``valgrind --version``); takes a few minutes per column.

``--python-calls`` prints instead, with no valgrind, the Python-level calls (functions and
builtins, counted by ``cProfile``) one forward of each column makes.

``--grad`` counts training forwards (grad on: each cast also records its backward) instead
of ``no_grad`` ones.

Run: python benchmarks/bench_instructions.py [--models resnet] [--calls 10]
[--columns ac,bf16,O1,autocast,O2,O3] [--python-calls] [--grad]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

NAMES = {"ac": "torch.autocast", "bf16": "bf16 model"}


def forward_of(model_name: str, column: str) -> Callable[[], Any]:
    """One no-argument forward of ``column`` on a fresh ``model_name``."""
    import torch

    import mixprec as amp
    from bench_overhead import _call, _first_tensor, build

    model, inputs = build(model_name)
    if column == "ac":

        def call() -> torch.Tensor:
            with torch.autocast("cpu", torch.bfloat16):
                return _first_tensor(model(**inputs))

    elif column == "bf16":
        low = model.to(torch.bfloat16)
        low_inputs = {k: v.bfloat16() if v.is_floating_point() else v for k, v in inputs.items()}

        def call() -> torch.Tensor:
            return _first_tensor(low(**low_inputs))

    else:
        converted = amp.auto_mixed_precision(model, column, torch.bfloat16)

        def call() -> torch.Tensor:
            return _call(converted, inputs)

    return call


def child(model_name: str, column: str, calls: int, grad: bool) -> None:
    """Run inside valgrind: warm up, then ``calls`` forwards with collection on."""
    import torch

    torch.set_num_threads(1)
    call = forward_of(model_name, column)
    with torch.enable_grad() if grad else torch.no_grad():
        for _ in range(3):
            call()
        torch._C._valgrind_toggle()
        for _ in range(calls):
            call()
        torch._C._valgrind_toggle()


def callgrind(script: str, child_args: list[str], label: str) -> int:
    """Instructions ``script --child *child_args`` collects (it toggles collection itself
    with ``torch._C._valgrind_toggle()``), counted by valgrind's callgrind."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        done = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--collect-atstart=no",
                f"--callgrind-out-file={out}",
                sys.executable,
                script,
                "--child",
                *child_args,
            ],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise RuntimeError(f"callgrind reported no count for {label}:\n{done.stderr[-2000:]}")
    return int(found.group(1))


def count(model_name: str, column: str, calls: int, grad: bool = False) -> int:
    """Instructions of ``calls`` forwards of one column, counted by callgrind."""
    args = [model_name, column, str(calls), "grad" if grad else "nograd"]
    return callgrind(__file__, args, column)


def python_calls(models: list[str], columns: list[str], calls: int) -> None:
    """Print the Python-level calls per forward of each column (``cProfile``)."""
    import cProfile
    import pstats

    import torch

    print("Python-level calls per forward (functions and builtins, cProfile; no grad)")
    print(f"{'model':8s}" + "".join(f"{NAMES.get(c, c):>16s}" for c in columns))
    for model_name in models:
        cells = []
        for column in columns:
            call = forward_of(model_name, column)
            with torch.no_grad():
                for _ in range(3):
                    call()
                profile = cProfile.Profile()
                profile.enable()
                for _ in range(calls):
                    call()
                profile.disable()
            made = sum(row[1] for row in pstats.Stats(profile).stats.values())  # type: ignore[attr-defined]
            cells.append(f"{made / calls:.0f}")
        print(f"{model_name:8s}" + "".join(f"{cell:>16s}" for cell in cells))


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "grad")
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--columns", default="ac,bf16,O1,autocast,O2,O3")
    parser.add_argument("--python-calls", action="store_true", help="cProfile call counts")
    parser.add_argument(
        "--grad", action="store_true", help="training forwards (grad on), not no_grad"
    )
    args = parser.parse_args()
    columns = args.columns.split(",")
    if args.python_calls:
        python_calls(args.models.split(","), columns, args.calls)
        return
    mode = "grad on" if args.grad else "no grad"
    print(f"instructions per forward ({mode}, callgrind), ratio to torch.autocast")
    print(f"{'model':8s}" + "".join(f"{NAMES.get(c, c):>16s}" for c in columns))
    for model_name in args.models.split(","):
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            counts = dict(
                zip(
                    columns,
                    pool.map(lambda c, m=model_name: count(m, c, args.calls, args.grad), columns),
                    strict=True,
                )
            )
        base = counts.get("ac")
        cells = []
        for column in columns:
            per_call = counts[column] / args.calls
            ratio = f" ({counts[column] / base:.2f}x)" if base else ""
            cells.append(f"{per_call / 1e3:9.0f}k{ratio}")
        print(f"{model_name:8s}" + "".join(f"{cell:>16s}" for cell in cells))


if __name__ == "__main__":
    main()
