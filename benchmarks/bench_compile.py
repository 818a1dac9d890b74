"""Compiled host time: each level compiled vs torch.autocast around the compiled original.

Tiny transformers BERT (4 layers, width 16, 8 tokens, random weights; compute negligible):
``torch.compile`` (inductor on CPU) of the converted model against
``torch.autocast("cpu", bf16)`` around ``torch.compile`` of the original, graph breaks
from ``torch._dynamo.explain``; medians of interleaved rounds, printed as ratios.

Run: python benchmarks/bench_compile.py [--rounds 20] [--levels O1,autocast]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import mixprec as amp
from bench_overhead import build


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--levels", default="O1,autocast")
    parser.add_argument("--model", default="bert")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # bf16 is slow on an AVX2 CPU: the model is tiny
    torch.set_num_threads(1)  # host time, not thread contention
    torch.manual_seed(0)
    model, inputs = build(args.model)
    model.eval()
    compiled_original = torch.compile(model)

    def theirs() -> object:
        with torch.autocast("cpu", torch.bfloat16):
            return compiled_original(**inputs)

    calls = {"torch.autocast+compile": theirs}
    breaks = {"original": torch._dynamo.explain(model)(**inputs).graph_break_count}
    for level in args.levels.split(","):
        converted = amp.auto_mixed_precision(model, level, torch.bfloat16)
        breaks[level] = torch._dynamo.explain(converted)(**inputs).graph_break_count
        compiled = torch.compile(converted)
        calls[f"{level} level+compile"] = lambda c=compiled: c(**inputs)
    times: dict[str, list[float]] = {name: [] for name in calls}
    with torch.no_grad():
        for call in calls.values():
            call()
            call()
        for _ in range(args.rounds):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["torch.autocast+compile"])
    print(f"{args.model}: graph breaks {breaks}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:20s} {median * 1e3:8.3f} ms  {median / base:5.2f}x")


if __name__ == "__main__":
    main()
