"""Conversion time at every level: real-size configs and the tiny transformers zoo.

``auto_mixed_precision(model, level, "bf16")`` timed on GPT-2 small (124M parameters),
BERT-base and T5-small built from their configs with random weights, and on each
architecture of ``benchmarks/zoo_check.py`` (tiny configs); the best of ``--repeats``
conversions of the same float32 model. The last row is the slowest zoo model per level.
A conversion walks the module tree once and runs no user code, so its time grows with the
number of modules and parameters, not with what a forward does.

Run: python benchmarks/bench_convert.py [--levels O1,autocast,O2,O3] [--repeats 3] [--no-zoo]
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable

import torch
import transformers as tf
from torch import nn

import mixprec as amp

LEVELS = ("O1", "autocast", "O2", "O3")

REAL: dict[str, Callable[[], nn.Module]] = {
    "gpt2-small": lambda: tf.GPT2LMHeadModel(tf.GPT2Config()),
    "bert-base": lambda: tf.BertModel(tf.BertConfig()),
    "t5-small": lambda: tf.T5ForConditionalGeneration(tf.T5Config()),
}


def best_ms(model: nn.Module, level: str, repeats: int) -> float:
    """The fastest of ``repeats`` conversions of ``model`` at ``level``, in milliseconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        amp.auto_mixed_precision(model, level, "bf16")
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def row(name: str, model: nn.Module, levels: list[str], repeats: int) -> dict[str, float]:
    """Print and return one model's conversion time per level."""
    found = {level: best_ms(model, level, repeats) for level in levels}
    params = sum(p.numel() for p in model.parameters()) / 1e6
    cells = "".join(f"{found[level]:10.1f}" for level in levels)
    print(f"{name:14s}{params:9.2f}M{cells}", flush=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default=",".join(LEVELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-zoo", action="store_true", help="only the real-size configs")
    args = parser.parse_args()
    levels = args.levels.split(",")
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    print(f"conversion time, ms (best of {args.repeats}), bf16")
    print(f"{'model':14s}{'params':>10s}" + "".join(f"{level:>10s}" for level in levels))
    for name, build in REAL.items():
        row(name, build().eval(), levels, args.repeats)
    if args.no_zoo:
        return
    from zoo_check import cfgs  # (beside this file: the same tiny configs)

    slowest = dict.fromkeys(levels, (0.0, ""))
    for name, (cfg, cls) in cfgs.items():
        found = row(name, cls(cfg).eval(), levels, args.repeats)
        for level, ms in found.items():
            slowest[level] = max(slowest[level], (ms, name))
    print(f"{'slowest zoo':24s}" + "".join(f"{slowest[lv][0]:10.1f}" for lv in levels))
    print(f"{'':24s}" + "".join(f"{slowest[lv][1]:>10s}" for lv in levels))


if __name__ == "__main__":
    main()
