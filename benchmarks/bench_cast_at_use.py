"""O2 bfloat16: conversion time and time per forward, next to the float32 model.

Medians of many calls, one intra-op thread (tiny models: threads only add noise). Run it
on two checkouts to compare designs; ratios within one run are what to read.

Run: python benchmarks/bench_cast_at_use.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import mixprec as amp
from mixprec.cli.models import TinyMLP, TinyTransformer


def _median_ms(fn: Callable[[], Any], calls: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _bert() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    import transformers

    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    return transformers.BertModel(config).eval(), {"input_ids": torch.randint(0, 64, (2, 16))}


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    models: list[tuple[str, nn.Module, dict[str, Any] | tuple[Any, ...]]] = [
        ("MLP 16-32-32-8", TinyMLP(), (torch.randn(8, 16),)),
        ("Embedding + encoder", TinyTransformer().eval(), (torch.randint(0, 50, (4, 10)),)),
        ("BERT 2x32 (transformers)", *_bert()),
    ]
    print(
        f"{'model':26s} {'convert':>9s} {'fp32':>8s} {'O2 grad':>9s} "
        f"{'O2 no_grad':>11s}   (ms, medians)"
    )
    for name, model, inputs in models:
        converted = amp.auto_mixed_precision(model, "O2", "bf16")

        def call(m: nn.Module, inputs: Any = inputs) -> Any:
            return m(**inputs) if isinstance(inputs, dict) else m(*inputs)

        def convert(model: nn.Module = model) -> nn.Module:
            return amp.auto_mixed_precision(model, "O2", "bf16")

        def run(m: nn.Module = converted) -> Any:
            return call(m)

        def run_fp32(m: nn.Module = model) -> Any:
            return call(m)

        convert_ms = _median_ms(convert, 20)
        grad = _median_ms(run)
        with torch.no_grad():
            fp32 = _median_ms(run_fp32)
            plain = _median_ms(run)
        print(f"{name:26s} {convert_ms:9.2f} {fp32:8.3f} {grad:9.3f} {plain:11.3f}")


if __name__ == "__main__":
    main()
