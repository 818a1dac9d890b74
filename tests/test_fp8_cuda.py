"""fp8 on a CUDA GPU with fp8: torchao's native path against the emulation.

Skipped without such a GPU (or without torchao); ``benchmarks/gpu_check.sh`` runs every
test marked ``cuda``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from mixprec.fp8 import Fp8Linear, apply_fp8, fp8_layers
from mixprec.fp8.swap import native_fp8_missing


def _fp8_gpu() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return native_fp8_missing(torch.device("cuda"))


pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(_fp8_gpu() is not None, reason=str(_fp8_gpu())),
]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 64)
    ).cuda()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_native_fp8_close_to_emulated(recipe: str) -> None:
    base = model()
    native = apply_fp8(base, recipe)  # native on a GPU with fp8
    emulated = apply_fp8(base, recipe, emulate=True)
    assert type(fp8_layers(native)["2"]).__name__ == "Float8Linear"
    assert isinstance(emulated[2], Fp8Linear)
    x = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
    outs, grads = [], []
    for net in (native, emulated):
        net = net.to(torch.bfloat16)
        xi = x.clone().requires_grad_()
        out = net(xi)
        out.float().square().mean().backward()
        outs.append(out.float())
        grads.append(xi.grad.float())
        for p in base.parameters():
            p.grad = None
    for a, b in ((outs[0], outs[1]), (grads[0], grads[1])):
        assert float((a - b).norm() / b.norm()) < 2e-2


def test_every_entry_point_trains_native_fp8() -> None:
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    step = mixprec.build_train_network(
        net, optimizer, nn.MSELoss(), "O2", dtype="bf16", fp8="rowwise"
    )
    assert type(fp8_layers(step.network)["2"]).__name__ == "Float8Linear"
    x = torch.randn(256, 64, device="cuda")
    losses = [float(step(x, x)) for _ in range(30)]
    assert losses[-1] < losses[0]
