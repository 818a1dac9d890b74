"""A candidate O1 mechanism, measured: Python kernels at the AutocastCPU dispatch key.

O1 runs every white-list op in the low dtype and casts its result back to float32; every
other op follows its inputs. Today a ``TorchFunctionMode`` applies that rule, so every op
(and every tensor method and property) pays a Python call. The candidate here registers a
Python kernel for the white-list ops only (``torch.library``, at ``AutocastCPU``) and runs
the model under ``torch.autocast``: the white-list ops pay one Python call each (cast their
floating inputs down, compute, cast the result up), the rest run in C++ as under autocast.

It is a measurement, not a mechanism mixprec uses: the kernels replace ``torch.autocast``'s
own for those ops in the whole process (every ``torch.autocast`` region then pays them and
loses autocast's weight-cast cache), which is why it runs in its own process and last.

Prints host time per forward (no grad) as ratios to ``torch.autocast`` with PyTorch's own
kernels (measured first, before the kernels are registered), and checks the candidate's
outputs against mixprec's O1 (they are bit-identical on GPT-2 and BERT).

Run: python benchmarks/bench_o1_autocast_kernels.py [--models gpt2,bert] [--rounds 40]
"""

from __future__ import annotations

import argparse
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

import mixprec as amp
from bench_overhead import _call, _first_tensor, build, time_rounds

#: The white-list ops the tiny transformers reach (aten names).
OPS = ("addmm", "linear", "matmul", "bmm", "baddbmm", "mm", "scaled_dot_product_attention")
_STATE = threading.local()
_BELOW = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def install() -> torch.library.Library:
    """Register the candidate's kernels (process-wide, for as long as the library lives)."""
    library = torch.library.Library("aten", "IMPL")
    for name in OPS:
        op = getattr(torch.ops.aten, name).default

        def kernel(*args: Any, op: Any = op, **kwargs: Any) -> Any:
            low = torch.get_autocast_dtype("cpu")
            args = tuple(
                a.to(low) if isinstance(a, torch.Tensor) and a.dtype is torch.float32 else a
                for a in args
            )
            with torch._C._ExcludeDispatchKeyGuard(_BELOW):
                out = op(*args, **kwargs)
            return out.float() if getattr(_STATE, "o1", False) else out

        library.impl(name, kernel, "AutocastCPU", allow_override=True)
    return library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,bert")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    models = {name: build(name) for name in args.models.split(",")}
    before: dict[str, dict[str, float]] = {}
    for name, (model, inputs) in models.items():

        def autocast(model: torch.nn.Module = model, inputs: Any = inputs) -> torch.Tensor:
            with torch.autocast("cpu", torch.bfloat16):
                return _first_tensor(model(**inputs))

        o1 = amp.auto_mixed_precision(model, "O1", torch.bfloat16)
        calls: dict[str, Callable[[], torch.Tensor]] = {
            "torch.autocast": autocast,
            "O1": lambda o1=o1, inputs=inputs: _call(o1, inputs),
        }
        before[name] = time_rounds(calls, args.rounds, backward=False)
    library = install()
    print("host time per forward, ratio to torch.autocast with PyTorch's kernels")
    print(
        f"{'model':8s} {'torch.autocast':>15s} {'O1 (mode)':>10s} {'candidate':>10s}  equal to O1"
    )
    for name, (model, inputs) in models.items():
        o1 = amp.auto_mixed_precision(model, "O1", torch.bfloat16)

        def candidate(model: torch.nn.Module = model, inputs: Any = inputs) -> torch.Tensor:
            _STATE.o1 = True
            try:
                with torch.autocast("cpu", torch.bfloat16):
                    return _first_tensor(model(**inputs))
            finally:
                _STATE.o1 = False

        after = time_rounds(
            {"O1": lambda o1=o1, inputs=inputs: _call(o1, inputs), "candidate": candidate},
            args.rounds,
            backward=False,
        )
        # the two runs are tied through O1, timed in both
        base = before[name]["torch.autocast"]
        scale = before[name]["O1"] / after["O1"]
        with torch.no_grad():
            same = torch.equal(_call(o1, inputs).float(), candidate().float())
        print(
            f"{name:8s} {base * 1e3:12.2f} ms {before[name]['O1'] / base:9.2f}x "
            f"{after['candidate'] * scale / base:9.2f}x  {same}"
        )
    del library


if __name__ == "__main__":
    main()
