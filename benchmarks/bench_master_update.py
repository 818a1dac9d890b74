"""O2 training step vs torch.autocast + GradScaler-free bf16 and pure bf16, per optimizer.

The benchmark MLP (1024-4096-4096-1024, batch 256, bf16): the step time of mixprec O2
(float32 masters) against ``torch.autocast`` and a pure bf16 model, with a fused AdamW and
a foreach SGD with momentum. Variants run interleaved, one repeat each in turn; medians;
ratios within this one run.

Usage::

    python benchmarks/bench_master_update.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

import mixprec

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "AdamW(fused=True)": lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True),
    "SGD(momentum, foreach)": lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9, foreach=True),
}


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 1024)
    )


def variants(make_opt: Callable[..., torch.optim.Optimizer]) -> dict[str, Callable[[], object]]:
    torch.manual_seed(0)
    base = mlp()
    x, y = torch.randn(256, 1024), torch.randn(256, 1024)
    loss_fn = nn.MSELoss()

    auto = copy.deepcopy(base)
    auto_opt = make_opt(auto.parameters())

    def autocast_step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = auto(x)
        loss_fn(out.float(), y).backward()
        auto_opt.step()
        auto_opt.zero_grad(set_to_none=True)

    pure = copy.deepcopy(base).bfloat16()
    pure_opt = make_opt(pure.parameters())
    xb = x.bfloat16()

    def pure_step() -> None:
        loss_fn(pure(xb).float(), y).backward()
        pure_opt.step()
        pure_opt.zero_grad(set_to_none=True)

    o2 = copy.deepcopy(base)
    step = mixprec.build_train_network(
        o2, make_opt(o2.parameters()), loss_fn, level="O2", dtype="bf16"
    )
    return {
        "torch.autocast": autocast_step,
        "pure bf16": pure_step,
        "mixprec O2": lambda: step(x, y),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    print(
        "| optimizer | O2 speed vs torch.autocast | O2 time vs pure bf16 | O2 ms | autocast ms | pure bf16 ms |"
    )
    print("|---|---|---|---|---|---|")
    for name, make_opt in OPTIMIZERS.items():
        runs = variants(make_opt)
        times: dict[str, list[float]] = {k: [] for k in runs}
        for i in range(args.warmup + args.repeats):
            for key, run in runs.items():
                start = time.perf_counter()
                run()
                if i >= args.warmup:
                    times[key].append(time.perf_counter() - start)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(
            f"| {name} | {med['torch.autocast'] / med['mixprec O2']:.2f}x | "
            f"{med['mixprec O2'] / med['pure bf16']:.2f}x | {med['mixprec O2']:.0f} | "
            f"{med['torch.autocast']:.0f} | {med['pure bf16']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
