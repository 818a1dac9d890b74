"""fp16 warm-up: skipped steps in the first 100 and final loss vs float32, on a 2-layer GPT-2.

A tiny ``GPT2LMHeadModel`` (random weights, built from a config: no download) learns a
fixed random token stream at O0 (float32), and at O2 float16 with the default manager (the
first scale chosen from the first gradients) and with ``DynamicLossScaleManager()``
(MindSpore's 2**24). Needs ``transformers``. float16 is slow on most CPUs: ~1-2 minutes.

Usage::

    python benchmarks/bench_fp16_warmup.py [--steps 100]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

import mixprec


def run(variant: str, steps: int, seed: int = 0) -> tuple[int, float, float]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=256,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    options: dict[str, Any] = {}
    if variant == "O0 float32":
        options = {"level": "O0"}
    elif variant == "O2 fp16, default manager":
        options = {"level": "O2", "dtype": "fp16"}
    else:
        options = {
            "level": "O2",
            "dtype": "fp16",
            "loss_scale_manager": mixprec.DynamicLossScaleManager(),
        }
    step = mixprec.build_train_network(model, optimizer, **options)
    data = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (16, 8, 32), generator=data)
    losses = []
    for i in range(steps):
        ids = tokens[i % len(tokens)]
        losses.append(float(step(input_ids=ids, labels=ids)))
    final = sum(losses[-10:]) / 10
    return step.skipped_steps, final, step.loss_scale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    rows = {}
    for variant in ("O0 float32", "O2 fp16, default manager", "O2 fp16, DynamicLossScaleManager()"):
        rows[variant] = run(variant, args.steps)
    base = rows["O0 float32"][1]
    print(
        f"| variant | skipped in first {args.steps} | final loss (mean of last 10) | vs fp32 | final scale |"
    )
    print("|---|---|---|---|---|")
    for variant, (skipped, final, scale) in rows.items():
        print(
            f"| {variant} | {skipped} | {final:.4f} | {100 * (final / base - 1):+.1f}% | {scale:g} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
