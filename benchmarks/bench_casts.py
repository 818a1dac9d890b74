"""Casts per forward and relative error against float32, per level, next to torch.autocast.

Counts do not vary between runs: a cast is an ``aten._to_copy`` that changes dtype,
counted by a ``TorchDispatchMode`` during one forward (kernels' own internal casts
included, for every column alike). Relative error is ||out - out_fp32|| / ||out_fp32||.

Run: python benchmarks/bench_casts.py
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import mixprec as amp
from mixprec.cli.models import SmallCNN, TinyMLP, TinyTransformer
from mixprec.diagnose.calibrate import relative_error as rel_error
from mixprec.inspect import CastCounter

LEVELS = ("O1", "autocast", "O2", "O3")


def _models() -> list[tuple[str, nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    return [
        ("MLP 16-32-32-8", TinyMLP(), torch.randn(8, 16)),
        ("CNN + BatchNorm", SmallCNN().eval(), torch.randn(4, 3, 16, 16)),
        (
            "TransformerEncoderLayer",
            nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).eval(),
            torch.randn(4, 10, 32),
        ),
        ("Embedding + encoder", TinyTransformer().eval(), torch.randint(0, 50, (4, 10))),
    ]


def _run(
    fn: Callable[[Any], torch.Tensor], x: torch.Tensor, grad: bool
) -> tuple[torch.Tensor, int]:
    with torch.set_grad_enabled(grad), CastCounter() as counter:
        out = fn(x)
    return out.detach(), counter.total


def main() -> None:
    for dtype, grad in ((torch.bfloat16, True), (torch.bfloat16, False), (torch.float16, True)):
        name = str(dtype).removeprefix("torch.")
        mode = "training forward (grad on)" if grad else "inference (no_grad, second call)"
        print(f"\n{name}, {mode}: casts per forward (relative error vs float32)")
        print(
            f"{'model':26s} {'torch.autocast':>16s}" + "".join(f"{level:>16s}" for level in LEVELS)
        )
        for model_name, model, x in _models():
            reference = model(x).detach()
            with torch.autocast("cpu", dtype=dtype):
                out, casts = _run(model, x, grad)
            cells = [f"{casts:>4d} ({rel_error(out.float(), reference):.1e})"]
            for level in LEVELS:
                converted = amp.auto_mixed_precision(model, level, dtype)
                with torch.set_grad_enabled(grad):
                    converted(x)  # a first call (no cache: a second call casts as the first did)
                out, casts = _run(converted, x, grad)
                cells.append(f"{casts:>4d} ({rel_error(out.float(), reference):.1e})")
            print(f"{model_name:26s} " + "".join(f"{c:>16s}" for c in cells))
    print(
        "\nWith gradients off, O2/O3 still cast their weights on every call (no cache across "
        "calls: every write to a weight is what the next call computes with); torch.autocast's "
        "inference TransformerEncoderLayer takes PyTorch's fused fast path, which it does not cast "
        "(it runs in float32)."
    )


if __name__ == "__main__":
    main()
