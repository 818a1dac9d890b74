"""Planned / measured / static casts per forward for the models of tests/test_explain_exact.py.

Planned is ``explain(model, *inputs)`` (a forward on fake tensors), measured is
``mixprec.inspect.CastCounter`` around a real call, static is ``explain(model)``; bf16,
gradients on, eval mode.

Run: PYTHONPATH=src:tests python benchmarks/explain_table.py
"""

from __future__ import annotations

import warnings

import torch

import mixprec as amp
from mixprec.inspect import CastCounter
from test_explain_exact import MODELS

LEVELS = ("O1", "autocast", "O2", "O3")


def main() -> None:
    warnings.simplefilter("ignore")  # bf16 is slow on an AVX2 CPU: the models are tiny
    print("| model | " + " | ".join(LEVELS) + " |")
    print("|---" * (len(LEVELS) + 1) + "|")
    for name, make in MODELS.items():
        cells = []
        for level in LEVELS:
            torch.manual_seed(0)
            model, inputs = make()
            converted = amp.auto_mixed_precision(model.eval(), level, "bf16")
            planned = amp.explain(converted, *inputs).num_casts
            with CastCounter() as counter:
                converted(*inputs)
            cells.append(f"{planned}/{counter.total} ({amp.explain(converted).num_casts})")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
