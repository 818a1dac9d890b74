"""Compiled host time: every level compiled vs torch.autocast around the compiled original.

Tiny transformers BERT and GPT-2 (4 layers, width 16, batch 1, 8 tokens, random weights,
dropout off; compute negligible, so what is timed is host time): ``torch.compile``
(inductor on CPU) of each converted model against ``torch.autocast("cpu", bf16)`` around
``torch.compile`` of the original, and the pure bf16 model compiled. Forward (no grad) and
forward+backward, one thread, medians of interleaved rounds, printed as ratios to
``torch.autocast`` + compile. Per level, from ``torch._dynamo.explain``: graph breaks and
the number of guards of the captured graphs (TorchDynamo checks every guard before each
call, in C++; on these tiny models that check is a large share of a compiled call).

``--guard-cost`` also times every column's forward with guard evaluation skipped
(``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``; unsafe, a diagnostic only):
the difference is what the guard check costs per call.

``--device cuda`` (with ``--dtype bf16|fp16``) times on the GPU as ``bench_overhead.py``
does: host time per call, each call starting on an idle GPU.

Run: python benchmarks/bench_compile.py [--rounds 20] [--models bert,gpt2] [--guard-cost]
[--device cuda] [--dtype bf16|fp16]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import mixprec as amp
from bench_overhead import LEVELS, _first_tensor, build, on_device, time_rounds

BASE = "autocast+compile"


def _explain(
    model: nn.Module, inputs: dict[str, torch.Tensor], autocast: torch.dtype | None
) -> tuple[int, int]:
    """(graph breaks, guards) of ``model`` under ``torch._dynamo.explain`` (inside
    ``torch.autocast`` of dtype ``autocast`` on the model's device, if given)."""
    device = next(model.parameters()).device.type
    region = torch.autocast(device, autocast) if autocast else contextlib.nullcontext()
    with region, torch.no_grad():
        found = torch._dynamo.explain(model)(**inputs)
    return found.graph_break_count, len(found.out_guards or ())


def _run(model: nn.Module, inputs: dict[str, torch.Tensor]) -> Any:
    return model(**inputs)


def compiled_call(model: nn.Module, inputs: dict[str, torch.Tensor]) -> Callable[[], Any]:
    """``model(**inputs)`` compiled, as a call with no arguments.

    Compiled through a copy of one function with a code object of its own: every
    ``torch.compile(module)`` compiles the one frame ``nn.Module.__call__``, so the columns'
    graphs would all be cache entries of one code object, and each call would check the
    guards of the other columns' entries before its own (and the columns of a second
    model would pass the recompile limit). One entry per column is what a program with
    one model compiled meets."""
    run = types.FunctionType(_run.__code__.replace(), _run.__globals__, _run.__name__)
    compiled = torch.compile(run)
    return lambda: _first_tensor(compiled(model, inputs))


def columns(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[dict[str, Callable[[], torch.Tensor]], dict[str, tuple[int, int]]]:
    """One zero-argument compiled call per column, and (graph breaks, guards) of each."""
    original = compiled_call(model, inputs)
    device = next(model.parameters()).device.type

    def theirs() -> torch.Tensor:
        with torch.autocast(device, dtype):
            return original()

    low = copy.deepcopy(model).to(dtype)
    calls: dict[str, Callable[[], torch.Tensor]] = {
        BASE: theirs,
        "low model": compiled_call(low, inputs),
    }
    explained = {BASE: _explain(model, inputs, dtype), "low model": _explain(low, inputs, None)}
    for level in LEVELS:
        converted = amp.auto_mixed_precision(model, level, dtype)
        explained[level] = _explain(converted, inputs, None)
        calls[level] = compiled_call(converted, inputs)
    return calls, explained


def _skipping_guards() -> contextlib.AbstractContextManager[Any]:
    """Guard evaluation skipped (unsafe: a diagnostic of what the guard check costs)."""
    return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--models", default="bert,gpt2")
    parser.add_argument("--guard-cost", action="store_true", help="also time with guards skipped")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # bf16 is slow on an AVX2 CPU: the models are tiny
    torch.set_num_threads(1)  # host time, not thread contention
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    idle = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    low_name = f"{args.dtype} model"
    names = (BASE, low_name, *LEVELS)
    print("compiled (inductor) host time per call, ratio to torch.autocast around the compiled")
    print(f"original, on {args.device}, {args.dtype} (median of {args.rounds} interleaved rounds)")
    print(f"{'model':6s} {'pass':8s} {BASE:>18s}" + "".join(f"{n:>11s}" for n in names[1:]))
    for model_name in args.models.split(","):
        model, inputs = on_device(*build(model_name), args.device)
        calls, explained = columns(model, inputs, dtype)
        calls[low_name] = calls.pop("low model")
        explained[low_name] = explained.pop("low model")
        for backward in (False, True):
            for skip in (False, True) if args.guard_cost and not backward else (False,):
                timed = _skipping_guards if skip else contextlib.nullcontext
                med = time_rounds(calls, args.rounds, backward, timed, idle)
                base = med[BASE]
                label = ("fwd+bwd" if backward else "fwd") + (" -g" if skip else "")
                row = f"{model_name:6s} {label:8s} {base * 1e3:15.3f} ms"
                row += "".join(f"{med[n] / base:10.2f}x" for n in names[1:])
                print(row, flush=True)
        for what, index in (("graph breaks", 0), ("guards", 1)):
            row = f"{model_name:6s} {what:12s} {explained[BASE][index]:14d}"
            print(row + "".join(f"{explained[n][index]:11d}" for n in names[1:]), flush=True)
    if args.guard_cost:
        print("-g: guard evaluation skipped (unsafe; shows what the guard check costs)")


if __name__ == "__main__":
    main()
