"""Emulated low precision: its speed against float32 and its numerics against native bf16.

    PYTHONPATH=src python benchmarks/bench_emulate.py

Speed: one ``build_train_network`` step (SGD with momentum), fp32 (O0) against O2 and O1
bf16 emulated, on the benchmark MLP (batch 256) and LeNet-5 (batch 32); medians of steps
interleaved round by round. Numerics: O2 bf16, one forward and backward, relative L2
difference of outputs and gradients, emulated against native and native against fp32.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.cli.models import cnn, lenet5, mlp, transformer
from mixprec.policy.hardware import cpu_name

LEVELS = {
    "fp32": {"level": "O0"},
    "O2 emulated": {"level": "O2", "dtype": "bf16", "emulate": True},
    "O1 emulated": {"level": "O1", "dtype": "bf16", "emulate": True},
}


def speed(make: Callable[[], nn.Module], x: torch.Tensor, y: torch.Tensor, rounds: int) -> str:
    base = make()
    steps = {}
    for name, options in LEVELS.items():
        model = copy.deepcopy(base)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        steps[name] = mixprec.build_train_network(
            model, optimizer, nn.CrossEntropyLoss(), **options
        )
    for step in steps.values():
        for _ in range(2):
            step(x, y)
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for round_ in range(rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            start = time.perf_counter()
            steps[name](x, y)
            times[name].append(time.perf_counter() - start)
    ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    return ", ".join(
        f"{name} {value:.2f} ms ({value / ms['fp32']:.2f}x)" for name, value in ms.items()
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _run(net: nn.Module, owner: nn.Module, x: torch.Tensor, y: torch.Tensor):  # type: ignore[no-untyped-def]
    owner.zero_grad(set_to_none=True)
    out = net(x)
    F.cross_entropy(out.float(), y).backward()
    grads = [p.grad.flatten() for p in owner.parameters() if p.grad is not None]
    return out.detach().float(), torch.cat(grads)


def numerics() -> None:
    torch.manual_seed(0)
    cases = {
        "LeNet-5 (32x1x32x32)": (lenet5(), torch.randn(32, 1, 32, 32), 10),
        "CNN+BatchNorm (8x3x32x32)": (cnn(), torch.randn(8, 3, 32, 32), 10),
        "transformer (4x64 tokens)": (transformer(), torch.randint(0, 1000, (4, 64)), 10),
    }
    print(
        f"{'model':28} {'out emu-nat':>12} {'out nat-fp32':>12} {'grad emu-nat':>12} {'grad nat-fp32':>13}"
    )
    for name, (model, x, classes) in cases.items():
        y = torch.randint(0, classes, (x.shape[0],))
        ref = _run(model, model, x, y)
        nat = _run(mixprec.auto_mixed_precision(model, "O2", "bf16"), model, x, y)
        emu = _run(mixprec.auto_mixed_precision(model, "O2", "bf16", emulate=True), model, x, y)
        print(
            f"{name:28} {_rel(emu[0], nat[0]):12.2e} {_rel(nat[0], ref[0]):12.2e} "
            f"{_rel(emu[1], nat[1]):12.2e} {_rel(nat[1], ref[1]):13.2e}"
        )


def main() -> None:
    torch.manual_seed(0)
    print(f"{cpu_name()}, {torch.get_num_threads()} torch threads")
    mlp_batch = (torch.randn(256, 1024), torch.randint(0, 1024, (256,)))
    print("mlp:", speed(mlp, *mlp_batch, rounds=15))
    lenet_batch = (torch.randn(32, 1, 32, 32), torch.randint(0, 10, (32,)))
    print("lenet5:", speed(lenet5, *lenet_batch, rounds=200))
    numerics()


if __name__ == "__main__":
    main()
