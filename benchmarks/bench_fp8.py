"""Emulated fp8 training speed: one training step against the float32 step, as ratios.

    PYTHONPATH=src python benchmarks/bench_fp8.py [--rounds 15] [--threads N] [--cpu-time]

One ``build_train_network`` step (SGD with momentum) at O0: float32, and float32 with each
fp8 recipe emulated (the default layer choice: every linear but the first and last). Models:
the benchmark MLP (1024-4096-4096-1024, batch 256) and a tiny Llama (transformers'
``LlamaConfig``, random weights: 4 layers, width 256, batch 8 x 128 tokens). Medians of
steps interleaved round by round (each round starts at another variant), in one run.

``--cpu-time`` times each step by the process's CPU time instead of the wall clock; with
``--threads 1`` that is the work a step does, which other jobs on a shared machine barely
move (with more threads, a thread waiting on a descheduled one is counted too).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import mixprec
from mixprec.cli.models import mlp
from mixprec.policy.hardware import cpu_name

VARIANTS: dict[str, str | None] = {
    "fp32": None,
    "tensorwise": "tensorwise",
    "rowwise": "rowwise",
    "rowwise_with_gw_hp": "rowwise_with_gw_hp",
}


def tiny_llama() -> nn.Module:
    """A 4-layer Llama (width 256, MLP 704, vocab 1024) with random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def llama_for_check() -> tuple[nn.Module, Callable[[int], dict[str, torch.Tensor]]]:
    """``mixprec fp8-check benchmarks/bench_fp8.py:llama_for_check``: the tiny Llama and
    its batches (8 fixed batches of 4 x 64 random tokens, cycled; the model's own loss)."""
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 1024, (4, 64), generator=generator) for _ in range(8)]
    return tiny_llama(), lambda step: {
        "input_ids": batches[step % 8],
        "labels": batches[step % 8],
    }


def ratios(
    make: Callable[[], nn.Module],
    loss_fn: nn.Module | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    rounds: int,
    clock: Callable[[], float] = time.perf_counter,
) -> str:
    """Median step time of every variant (by ``clock``), and its ratio to float32."""
    base = make()
    steps = {}
    for name, recipe in VARIANTS.items():
        model = copy.deepcopy(base)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        steps[name] = mixprec.build_train_network(model, optimizer, loss_fn, "O0", fp8=recipe)
    for step in steps.values():
        for _ in range(2):
            step(*args, **kwargs)
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for round_ in range(rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            start = clock()
            steps[name](*args, **kwargs)
            times[name].append(clock() - start)
    ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    return ", ".join(
        f"{name} {value:.1f} ms ({value / ms['fp32']:.2f}x)" for name, value in ms.items()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: as is)")
    parser.add_argument("--cpu-time", action="store_true", help="time by CPU time, not wall")
    options = parser.parse_args()
    rounds = options.rounds
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    clock = time.process_time if options.cpu_time else time.perf_counter
    print(
        f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"{'CPU time' if options.cpu_time else 'wall clock'}"
    )
    torch.manual_seed(0)
    x, y = torch.randn(256, 1024), torch.randint(0, 1024, (256,))
    print(
        "MLP 1024-4096-4096-1024, batch 256:",
        ratios(mlp, nn.CrossEntropyLoss(), (x, y), {}, rounds, clock),
    )
    tokens = torch.randint(0, 1024, (8, 128))
    kwargs = {"input_ids": tokens, "labels": tokens}
    print("tiny Llama, 8x128 tokens:", ratios(tiny_llama, None, (), kwargs, rounds, clock))


if __name__ == "__main__":
    main()
