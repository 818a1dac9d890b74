"""The sync budget: host syncs per optimizer step, counted by patching every Tensor ->
Python conversion called from mixprec's code, row by row as the README's table states it.

(torch's non-fused Adam reads its step counters with ``.item()``; they live on the CPU, so
those reads are no device sync, and they are not mixprec's: only calls made from mixprec's
source files count.)"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import mixprec as amp
from helpers import MLP


class SyncCounter:
    def __init__(self) -> None:
        self.count = 0


@contextlib.contextmanager
def count_syncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[SyncCounter]:
    """Count Tensor.item / __bool__ / __float__ / __int__ / tolist calls made by mixprec or
    by this test module (each a host read)."""
    counter = SyncCounter()
    with monkeypatch.context() as patch:
        for name in ("item", "__bool__", "__float__", "__int__", "tolist"):
            original = getattr(torch.Tensor, name)

            def counted(self: torch.Tensor, *args: Any, _original: Any = original) -> Any:
                caller = sys._getframe(1).f_code.co_filename
                if f"{os.sep}mixprec{os.sep}" in caller or caller == __file__:
                    counter.count += 1
                return _original(self, *args)

            patch.setattr(torch.Tensor, name, counted)
        bool(torch.tensor(True))
        assert counter.count == 1  # the patch bites, so the counts below can fail
        counter.count = 0
        yield counter


def _data(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 16, generator=g), torch.randint(0, 8, (n,), generator=g)


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.01),
    "adam-foreach": lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True),
    "sgd-fused": lambda p: torch.optim.SGD(p, lr=0.01, fused=True),
    "sgd-momentum-fused": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, fused=True),
    "adam-fused": lambda p: torch.optim.Adam(p, lr=1e-3, fused=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
}

# (level, dtype, loss scaling, optimizer) -> host syncs per optimizer step (after the first)
BUDGET = [
    ("O0", None, "none", "sgd", 1),
    ("O0", None, "none", "adamw-fused", 0),
    ("O1", "bf16", "none", "adam-foreach", 1),
    ("O1", "bf16", "none", "sgd-fused", 0),
    ("O2", "bf16", "none", "adam-foreach", 1),
    ("O2", "bf16", "none", "adamw-fused", 0),
    ("O2", "bf16", "none", "sgd-momentum-fused", 0),
    ("O2", "fp16", "dynamic", "adam-foreach", 1),
    ("O2", "fp16", "dynamic", "adam-fused", 0),
    ("O3", "bf16", "dynamic", "sgd-fused", 0),
    ("O2", "bf16", "fixed-no-drop", "sgd", 0),
    ("autocast", "bf16", "fixed", "adam-foreach", 1),
]


def _manager(kind: str) -> Any:
    return {
        "none": None,
        "dynamic": amp.DynamicLossScaleManager(2.0**10, 2, 1000),
        "fixed": amp.FixedLossScaleManager(64.0),
        "fixed-no-drop": amp.FixedLossScaleManager(64.0, drop_overflow_update=False),
    }[kind]


@pytest.mark.parametrize(
    ("level", "dtype", "scaling", "optimizer", "syncs"),
    BUDGET,
    ids=[f"{b[0]}-{b[1] or 'fp32'}-{b[2]}-{b[3]}" for b in BUDGET],
)
def test_syncs_per_step(
    monkeypatch: pytest.MonkeyPatch,
    level: str,
    dtype: str | None,
    scaling: str,
    optimizer: str,
    syncs: int,
) -> None:
    torch.manual_seed(0)
    model = MLP()
    step = amp.build_train_network(
        model,
        OPTIMIZERS[optimizer](model.parameters()),
        nn.CrossEntropyLoss(),
        level=level,
        dtype=dtype,
        loss_scale_manager=_manager(scaling),
        clip_grad_norm=1.0,
    )
    x, y = _data()
    step(x, y)  # the first step may decide on the host (fused SGD momentum buffers)
    with count_syncs(monkeypatch) as counter:
        for _ in range(4):
            step(x, y)
    assert counter.count == 4 * syncs
    assert step.skipped_steps == 0
    assert step.optimizer_steps == 5


def test_fused_steps_still_skip_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    manager = amp.DynamicLossScaleManager(1024, 2, 3)
    step = amp.build_train_network(
        model,
        optimizer,
        nn.CrossEntropyLoss(),
        level="O2",
        dtype="bf16",
        loss_scale_manager=manager,
    )
    x, y = _data()
    bad = x.clone()
    bad[0, 0] = float("inf")
    step(x, y)
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: v["step"].clone() for k, v in optimizer.state.items()}
    with count_syncs(monkeypatch) as counter:
        step(bad, y)
    assert counter.count == 0
    assert step.overflow  # read lazily, after the step
    assert step.skipped_steps == 1
    assert step.loss_scale == 512
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b)
    for key, value in optimizer.state.items():
        assert torch.equal(value["step"], state[key])  # rolled back by the fused kernel
    step(x, y)
    assert not step.overflow


def test_fused_sgd_momentum_with_a_skipped_first_step_matches_plain_sgd() -> None:
    """torch's fused SGD makes its momentum buffers with empty_like on the first step, even
    a skipped one; the step decides on the host until the buffers exist."""
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = MLP()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=fused)
        step = amp.build_train_network(
            model,
            optimizer,
            nn.CrossEntropyLoss(),
            level="O2",
            dtype="fp16",
            loss_scale_manager=amp.DynamicLossScaleManager(2.0**24, 2, 1000),
        )
        x, y = _data()
        bad = x.clone()
        bad[0, 0] = float("inf")
        step(bad, y)  # skipped first step
        assert step.overflow
        for _ in range(3):
            step(x, y)
        results.append([p.detach().clone() for p in model.parameters()])
        assert all(torch.isfinite(p).all() for p in model.parameters())
    for plain, fused_p in zip(*results, strict=True):
        torch.testing.assert_close(plain, fused_p, rtol=1e-5, atol=1e-6)


def test_overflow_limits_are_checked_lazily_without_syncs(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = MLP()
    step = amp.build_train_network(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
        nn.CrossEntropyLoss(),
        level="O2",
        dtype="bf16",
    )
    monkeypatch.setattr(step, "LIMIT_CHECK_INTERVAL", 4)
    monkeypatch.setattr(step, "OVERFLOW_WARNING_AFTER", 2)
    monkeypatch.setattr(step, "MAX_CONSECUTIVE_OVERFLOWS", 5)
    x, y = _data()
    x[0, 0] = float("nan")
    with count_syncs(monkeypatch) as counter:
        for _ in range(3):
            step(x, y)
    assert counter.count == 0
    with pytest.warns(RuntimeWarning, match="4 optimizer steps in a row were skipped"):
        step(x, y)  # the 4th step checks
    for _ in range(3):
        step(x, y)
    with pytest.raises(RuntimeError, match="8 consecutive steps"):
        step(x, y)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_no_sync_on_cuda_with_a_fused_optimizer(dtype: str) -> None:
    """torch.cuda.set_sync_debug_mode("error") raises on any synchronizing call, including
    the copy of a Python float to the device."""
    torch.manual_seed(0)
    model = MLP().cuda()
    step = amp.build_train_network(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
        nn.CrossEntropyLoss(),
        level="O2",
        dtype=dtype,
        loss_scale_manager=amp.DynamicLossScaleManager(2.0**10, 2, 1000),
        clip_grad_norm=1.0,
    )
    x, y = (t.cuda() for t in _data())
    step(x, y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step(x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert step.skipped_steps == 0
