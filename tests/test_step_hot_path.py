"""The training step's hot path does only what a step needs, and gives what it gave before:
the gradient norm computed when read (the same value as computed on every step), torch's
labelled profiler ranges while a profiler records, the skip ledger on the host or the device,
the fused loss-scale update (bit for bit the rule's), and the master weights' fast check."""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec as amp
from helpers import MLP
from mixprec.training.scale_state import LossScaleState


def _batches(n: int, poison: set[int] = frozenset()) -> list[tuple[torch.Tensor, torch.Tensor]]:  # type: ignore[assignment]
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        x = torch.randn(8, 16, generator=g)
        if i in poison:
            x[0, 0] = math.nan
        out.append((x, torch.randint(0, 8, (8,), generator=g)))
    return out


def _step(optimizer: Callable[[Any], torch.optim.Optimizer], **kwargs: Any) -> amp.TrainStep:
    torch.manual_seed(0)
    model = MLP()
    return amp.build_train_network(
        model, optimizer(model.parameters()), nn.CrossEntropyLoss(), **kwargs
    )


class _Ops(TorchDispatchMode):
    """Counts calls of the aten operators whose names are given."""

    def __init__(self, *names: str) -> None:
        super().__init__()
        self.names = names
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket.__name__ in self.names:
            self.count += 1
        return func(*args, **(kwargs or {}))


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),  # decided on the host
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),  # on the device
}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize(("level", "dtype"), [("O0", None), ("O2", "bf16"), ("O2", "fp16")])
def test_a_read_grad_norm_is_the_norm_every_step_computes(
    optimizer: str, level: str, dtype: str | None
) -> None:
    """A step that never read its norm computes none; the first read after a call gives that
    call's step's norm, exactly what a step computing it every time gives, and so does every
    read after it (through a skipped step, which keeps the last applied one's)."""
    lazy = _step(OPTIMIZERS[optimizer], level=level, dtype=dtype)
    eager = _step(OPTIMIZERS[optimizer], level=level, dtype=dtype)
    assert math.isnan(eager.grad_norm)  # a read: from now on every step computes it
    batches = _batches(8, poison={5})
    with _Ops("linalg_vector_norm") as ops:  # (fp16's first scale takes an inf-norm)
        for x, y in batches[:3]:
            lazy(x, y)
    assert ops.count == 0
    for i, (x, y) in enumerate(batches):
        eager(x, y)
        if i >= 3:
            lazy(x, y)
            assert lazy.overflow == eager.overflow == (i == 5)
            assert lazy.grad_norm == eager.grad_norm  # bit for bit
    assert math.isfinite(lazy.grad_norm)
    for a, b in zip(lazy.network.parameters(), eager.network.parameters(), strict=True):
        assert torch.equal(a, b)  # computing the norm or not changes no update


def test_a_norm_whose_gradients_went_unread_is_nan_until_the_next_step() -> None:
    step = _step(OPTIMIZERS["sgd"], level="O1", dtype="bf16")
    (x, y), (x2, y2) = _batches(2)
    step(x, y)
    step(x2, y2)  # the first step's gradients go, unread
    twin = _step(OPTIMIZERS["sgd"], level="O1", dtype="bf16")
    twin(x, y)
    twin(x2, y2)
    assert step.grad_norm == twin.grad_norm  # the last step's, still kept
    step(x, y)
    twin(x, y)
    assert step.grad_norm == twin.grad_norm > 0


def test_metrics_asked_for_before_the_next_call_give_a_norm_after_it() -> None:
    """A loop that logs without waiting asks for ``metrics()`` after a step and looks the
    values up later, after more calls have begun (here the next step's first micro-batch):
    the norm is known then (the last step's, computed when asked for), never NaN."""
    step = _step(OPTIMIZERS["sgd"], level="O2", dtype="bf16", accumulation_steps=2)
    twin = _step(OPTIMIZERS["sgd"], level="O2", dtype="bf16", accumulation_steps=2)
    (x, y), (x2, y2), (x3, y3) = _batches(3)
    step(x, y)
    step(x2, y2)  # the first applied step
    twin(x, y)
    twin(x2, y2)
    expected = twin.grad_norm
    metrics = step.metrics()
    step(x3, y3)  # the next step's first micro-batch: the last step's gradients go
    assert metrics["grad_norm"] == expected > 0


def test_an_unread_norm_before_a_skip_is_nan() -> None:
    step = _step(OPTIMIZERS["sgd"], level="O0")
    (x, y), (bad, y2) = _batches(2, poison={1})
    step(x, y)
    step(bad, y2)  # skipped: the applied step's gradients went unread
    assert step.overflow
    assert math.isnan(step.grad_norm)
    step(x, y)
    assert step.grad_norm > 0


def test_clipping_computes_the_norm_on_every_step() -> None:
    step = _step(OPTIMIZERS["sgd"], level="O1", dtype="bf16", clip_grad_norm=1e-3)
    with _Ops("_foreach_norm") as ops:
        for x, y in _batches(3):
            step(x, y)
    assert ops.count == 3


def test_an_optimizer_from_outside_torch_optim_gets_the_norm_computed_every_step() -> None:
    class Outside(torch.optim.SGD):  # (may write the gradients in place)
        pass

    step = _step(lambda p: Outside(p, lr=0.1), level="O0")
    with _Ops("_foreach_norm") as ops:
        for x, y in _batches(2):
            step(x, y)
    assert ops.count == 2


def test_a_gradient_written_after_its_step_gives_nan_not_a_wrong_norm() -> None:
    step = _step(OPTIMIZERS["sgd"], level="O0")
    x, y = _batches(1)[0]
    step(x, y)
    grads, _, _, _ = step._norms._pending  # type: ignore[misc]
    grads[0].mul_(2.0)  # (only an optimizer writing in place could reach them)
    assert math.isnan(step.grad_norm)


@pytest.mark.parametrize("accumulation", [1, 3])
def test_the_gradients_kept_for_the_norm_go_when_the_next_call_begins(accumulation: int) -> None:
    step = _step(OPTIMIZERS["sgd"], level="O0", accumulation_steps=accumulation)
    batches = _batches(accumulation + 1)
    for x, y in batches[:accumulation]:
        step(x, y)
    assert all(p.grad is None for p in step.network.parameters())
    pending = step._norms._pending
    assert pending is not None
    kept = [weakref.ref(g) for g in pending[0]]
    del pending
    step(*batches[-1])
    assert all(ref() is None for ref in kept)  # freed before the next backward


# ---------------------------------------------------------------------- profiler ranges
def test_a_profiler_sees_the_optimizers_labelled_ranges() -> None:
    step = _step(OPTIMIZERS["sgd"], level="O1", dtype="bf16")
    x, y = _batches(1)[0]
    step(x, y)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(x, y)
    names = {event.name for event in prof.events()}
    assert "Optimizer.step#SGD.step" in names
    assert "Optimizer.zero_grad#SGD.zero_grad" in names


def test_without_a_profiler_the_step_clears_gradients_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    called: list[int] = []
    original = torch.optim.Optimizer.zero_grad
    monkeypatch.setattr(
        torch.optim.Optimizer,
        "zero_grad",
        lambda self, *a, **k: called.append(1) or original(self, *a, **k),
    )
    step = _step(OPTIMIZERS["sgd"], level="O0")
    step(*_batches(1)[0])
    assert called  # a zero_grad that is not torch's own (here: the patch) is called
    monkeypatch.undo()
    called.clear()
    step(*_batches(1)[0])
    assert all(p.grad is None for p in step.optimizer.param_groups[0]["params"])


def test_an_optimizers_own_zero_grad_is_called() -> None:
    calls: list[bool] = []

    class Own(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = True) -> None:
            calls.append(set_to_none)
            super().zero_grad(set_to_none)

    step = _step(lambda p: Own(p, lr=0.1), level="O0")
    for x, y in _batches(2):
        step(x, y)
    assert calls == [True, True]


# ---------------------------------------------------------------------- the skip ledger
def test_the_ledger_moves_between_host_and_device_decisions() -> None:
    """Fused SGD with momentum decides on the host until its buffers exist, then on the
    device; a checkpoint taken on either side carries the counts."""
    step = _step(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True), level="O0")
    batches = _batches(7, poison={0, 3, 4})
    outcomes = []
    for x, y in batches:
        step(x, y)
        outcomes.append((step.overflow, step.skipped_steps, step.consecutive_overflows))
    assert outcomes == [
        (True, 1, 1),
        (False, 1, 0),
        (False, 1, 0),
        (True, 2, 1),
        (True, 3, 2),
        (False, 3, 0),
        (False, 3, 0),
    ]
    state = step.state_dict()
    fresh = _step(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), level="O0")
    fresh.load_state_dict(state)
    assert (fresh.overflow, fresh.skipped_steps, fresh.consecutive_overflows) == (False, 3, 0)
    fresh(*batches[0])
    assert (fresh.overflow, fresh.skipped_steps, fresh.consecutive_overflows) == (True, 4, 1)


# ---------------------------------------------------------------------- the scale update
@pytest.mark.parametrize("factor", [2.0, 4.0, 3.0, None])
def test_the_fused_scale_update_is_the_rule_bit_for_bit(factor: float | None) -> None:
    g = torch.Generator().manual_seed(0)
    flags = (torch.rand(400, generator=g) < 0.2).float()
    flags[100:140] = 1.0  # a run of overflows down to the floor of 1
    flags[200:330] = 0.0  # clean windows up to the float32 ceiling
    start = 3.0e38 if factor is None else 2.0**100
    fused = LossScaleState.create(start, factor, window=3)
    rule = copy.deepcopy(fused)
    for found in flags:
        fused.update_(found.reshape(()))
        rule.assign(rule.adjust(found == 0))
        for a, b in ((fused.scale, rule.scale), (fused.good_steps, rule.good_steps)):
            assert torch.equal(a, b)
        assert torch.equal(fused.bad_steps, rule.bad_steps)
    assert fused.scale.dtype == torch.float32
    assert fused.good_steps.dtype == fused.bad_steps.dtype == torch.int32


# ---------------------------------------------------------------------- master weights
def test_a_layer_frozen_on_both_copies_then_unfrozen_on_one_trains_again() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))
    step = amp.build_train_network(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        nn.CrossEntropyLoss(),
        "O2",
        dtype="bf16",
    )
    x, y = _batches(1)[0]
    model[0].requires_grad_(False)
    step.network[0].requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    step(x, y)
    assert torch.equal(model[0].weight, frozen)
    model[0].requires_grad_(True)
    step(x, y)
    assert step.network[0].weight.requires_grad
    assert not torch.equal(model[0].weight, frozen)


def test_plain_state_is_set_without_registering_anything() -> None:
    step = _step(OPTIMIZERS["sgd"], level="O0")
    step(*_batches(1)[0])
    assert step.optimizer_steps == 1
    step.found_inf = torch.ones(())  # a tensor attribute stays a plain attribute
    assert "found_inf" not in dict(step.named_buffers())
    assert set(step.state_dict()) == {
        *("network." + k for k in step.network.state_dict()),
        "_extra_state",
    }


# ---------------------------------------------------------------------- on a GPU
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_no_sync_on_cuda_with_the_norm_left_unread_and_the_ledger_moving(dtype: str) -> None:
    """Fused SGD with momentum: the first step decides on the host, then the ledger moves to
    the device (no copy from host memory), the norm is kept unread, the scale updates fused:
    torch.cuda.set_sync_debug_mode("error") raises on any synchronizing call."""

    def build() -> amp.TrainStep:
        torch.manual_seed(0)
        model = MLP().cuda()
        return amp.build_train_network(
            model,
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True),
            nn.CrossEntropyLoss(),
            level="O2",
            dtype=dtype,
            loss_scale_manager=amp.DynamicLossScaleManager(2.0**10, 2, 2),
        )

    step, twin = build(), build()
    assert math.isnan(twin.grad_norm)  # the twin computes its norm on every step
    batches = [(x.cuda(), y.cuda()) for x, y in _batches(5, poison={3})]
    step(*batches[0])
    twin(*batches[0])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in batches[1:]:
            step(x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for x, y in batches[1:]:
        twin(x, y)
    assert step.skipped_steps == twin.skipped_steps == 1
    assert step.loss_scale == twin.loss_scale
    assert step.grad_norm == twin.grad_norm
