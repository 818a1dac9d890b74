"""Boost levels O0/O1/O2 side by side: step time, build + first-call time, final accuracy.

Every model trains on scikit-learn's digits (32x32): LeNet-5 as in ``mixprec demo``, the
benchmark MLP on the flattened image (1024 inputs, labels 0-9 among its 1024 outputs),
the benchmark CNN on the image repeated to 3 channels. Level O2 in bfloat16 where the CPU
has it natively, else O0 (float32). Per model, the boost levels run interleaved in lockstep,
batch by batch (so a burst of machine load hits all alike); step times are medians over the steps
after a warm-up, ratios against boost O0 of the same seed, then the median over seeds.
With ``--compile`` each model also runs (first seed) at O1 with ``torch.compile`` forced
(inductor), to measure what the CPU rule leaves off.

Usage::

    python benchmarks/bench_boost.py                  # all three models, 3 seeds
    python benchmarks/bench_boost.py --models lenet5 --epochs 2 --compile
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import mixprec as amp
from mixprec.cli.data import batch_order, load_digits
from mixprec.cli.models import cnn, lenet5, mlp
from mixprec.policy.dtypes import has_native_low_precision

Adapt = Callable[[torch.Tensor], torch.Tensor]
MODELS: dict[str, tuple[Callable[[], nn.Module], Adapt, float]] = {
    "lenet5": (lenet5, lambda x: x, 1e-3),
    "mlp": (mlp, lambda x: x.flatten(1), 1e-4),
    "cnn": (cnn, lambda x: x.expand(-1, 3, -1, -1), 1e-3),
}


def train(
    name: str, boosts: dict[str, dict[str, Any] | None], seed: int, epochs: int, batch: int
) -> dict[str, dict[str, Any]]:
    """Train one model per boost setting in lockstep: batch i goes through every step
    before batch i + 1, so a burst of machine load hits every setting alike."""
    factory, adapt, lr = MODELS[name]
    data = load_digits(seed=seed)
    level, dtype = ("O2", "bf16") if has_native_low_precision("cpu") else ("O0", None)
    steps: dict[str, amp.TrainStep] = {}
    setup: dict[str, float] = {}
    for label, config in boosts.items():
        torch.manual_seed(seed)
        model = factory()
        start = time.perf_counter()
        steps[label] = amp.build_train_network(
            model,
            torch.optim.Adam(model.parameters(), lr=lr),
            nn.CrossEntropyLoss(),
            level,
            label.split("+")[0],
            dtype=dtype,
            boost_config=config,
        )
        setup[label] = time.perf_counter() - start
    x_train = adapt(data.x_train).contiguous()
    times: dict[str, list[float]] = {label: [] for label in boosts}
    for i, index in enumerate(batch_order(len(data.y_train), batch, epochs, seed)):
        for label, step in steps.items():
            t0 = time.perf_counter()
            step(x_train[index], data.y_train[index])
            elapsed = time.perf_counter() - t0
            if i == 0:
                setup[label] += elapsed
            elif i >= 3:
                times[label].append(elapsed)
    results = {}
    for label, step in steps.items():
        network = step.network
        network.eval()
        with torch.no_grad():
            predictions = network(adapt(data.x_test).contiguous()).argmax(1)
        results[label] = {
            "step_ms": statistics.median(times[label]) * 1e3,
            "setup_s": setup[label],
            "accuracy": (predictions == data.y_test).float().mean().item(),
            "summary": step.boost.summary() if step.boost is not None else "O0",
        }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="lenet5,mlp,cnn")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--compile", action="store_true", help="also O1 with inductor forced")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        "| model | boost | step ms (median) | speedup vs O0 | build + first call s | accuracy (mean ± sd over seeds) |"
    )
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        boosts: dict[str, dict[str, Any] | None] = {"O0": None, "O1": None, "O2": None}
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label in boosts}
        for seed in range(args.seeds):
            if args.compile and seed == 0:
                boosts["O1+compile"] = {"compile": True}
                runs["O1+compile"] = []
            elif "O1+compile" in boosts:
                del boosts["O1+compile"]
            for label, result in train(name, boosts, seed, args.epochs, args.batch).items():
                runs[label].append(result)
        for boost, results in runs.items():
            speedups = [
                base["step_ms"] / r["step_ms"] for base, r in zip(runs["O0"], results, strict=False)
            ]
            accuracy = [r["accuracy"] for r in results]
            spread = statistics.stdev(accuracy) if len(accuracy) > 1 else 0.0
            print(
                f"| {name} | {boost} | {statistics.median(r['step_ms'] for r in results):.2f} | "
                f"{statistics.median(speedups):.2f}x | "
                f"{statistics.median(r['setup_s'] for r in results):.2f} | "
                f"{statistics.mean(accuracy):.4f} ± {spread:.4f} |"
            )
        for boost in runs:
            if boost != "O0":
                print(f"  {name} {boost}: {runs[boost][0]['summary']}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
