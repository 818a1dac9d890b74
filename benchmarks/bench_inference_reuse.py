"""O2 inference on the benchmark MLP: the default (weights cast on every call, every write
seen) against the opt-in cross-call cache (``reuse_weight_casts``), torch.autocast and pure
bf16; medians of interleaved calls.

Run: python benchmarks/bench_inference_reuse.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

import mixprec
from mixprec.cli.models import mlp
from mixprec.convert.cast_at_use import reuse_weight_casts


def main() -> None:
    torch.manual_seed(0)
    model = mlp().eval()
    x = torch.randn(256, 1024)
    default = mixprec.auto_mixed_precision(model, "O2", "bf16")
    reused = mixprec.auto_mixed_precision(model, "O2", "bf16")
    pure = mlp().eval().to(torch.bfloat16)

    def autocast() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)

    runs: dict[str, Callable[[], torch.Tensor]] = {
        "torch.autocast": autocast,
        "O2 (default)": lambda: default(x),
        "O2 reuse_weight_casts": lambda: reused(x),
        "pure bf16": lambda: pure(x.bfloat16()),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.no_grad(), reuse_weight_casts(reused):
        for _ in range(3):
            for run in runs.values():
                run()
        for _ in range(15):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["torch.autocast"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:24s} {median * 1e3:7.2f} ms   speed vs torch.autocast {base / median:.2f}x")


if __name__ == "__main__":
    main()
