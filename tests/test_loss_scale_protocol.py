"""The loss-scale protocol the training step drives, exercised by every manager: Dynamic,
Fixed, Group and none (no manager). The step asks nothing else of a manager."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import mixprec as amp
from mixprec.training.grads import _inverse_scale

MANAGERS: dict[str, Callable[[], Any]] = {
    "dynamic": lambda: amp.DynamicLossScaleManager(2.0**10, 2, 100),
    "fixed": lambda: amp.FixedLossScaleManager(2.0**10),
    "group": lambda: amp.GroupLossScaleManager(2.0**10, [["0"], ["2"]], scale_window=100),
    "none": lambda: None,
}
#: the scale after one clean step and then one overflowing step
AFTER_OVERFLOW = {"dynamic": 2.0**9, "fixed": 2.0**10, "group": 2.0**9, "none": 1.0}


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def _batch(poison: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
    if poison:
        x[0, 0] = math.inf
    return x, y


@pytest.mark.parametrize("name", list(MANAGERS))
def test_every_manager_drives_the_same_step(name: str) -> None:
    model = _mlp()
    manager = MANAGERS[name]()
    step = amp.build_train_network(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        level="O0",
        loss_scale_manager=manager,
    )
    before = [p.detach().clone() for p in model.parameters()]
    step(*_batch())
    assert not step.overflow
    assert step.loss_scale == (1.0 if manager is None else 2.0**10)
    moved = [p.detach().clone() for p in model.parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(before, moved, strict=True))
    step(*_batch(poison=True))
    assert step.overflow
    assert step.skipped_steps == 1
    assert step.loss_scale == AFTER_OVERFLOW[name]
    assert all(torch.equal(a, b) for a, b in zip(moved, model.parameters(), strict=True))
    step(*_batch())  # trains again
    assert not step.overflow
    assert step.optimizer_steps == 3


@pytest.mark.parametrize("name", [n for n in MANAGERS if n != "none"])
def test_the_protocol_methods_directly(name: str) -> None:
    model = _mlp()
    manager = MANAGERS[name]()
    manager.check_network(model)
    manager.attach(model)
    scale = manager.device_state().scale
    (nn.CrossEntropyLoss()(model(_batch()[0]), _batch()[1]) * scale).backward()
    params = list(model.parameters())
    expected = [p.grad / scale for p in params]
    found = manager.unscale_step(
        params, [p.grad for p in params], _inverse_scale(scale), agree=None
    )
    assert found.dtype == torch.float32
    assert found.dim() == 0
    assert float(found) == 0.0
    for p, want in zip(params, expected, strict=True):
        torch.testing.assert_close(p.grad, want)
    manager.abandon()
    manager.update_on_device(found, None)
    assert manager.get_loss_scale() == 2.0**10  # one clean step of a 100-step window


@pytest.mark.parametrize("name", list(MANAGERS))
def test_the_step_holds_a_policy_object_for_every_manager(name: str) -> None:
    model = _mlp()
    manager = MANAGERS[name]()
    step = amp.build_train_network(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), "O0",
        loss_scale_manager=manager,
    )  # fmt: skip
    assert isinstance(step.scaling, amp.LossScaleManager)
    assert step.loss_scale_manager is manager  # None stays None for the user
    scale = step.scaling.scale_on(torch.device("cpu"))
    assert (scale is None) == (manager is None)
    assert step.scaling.is_fixed() == (name == "fixed")


def test_no_loss_scale_scales_nothing_checks_and_never_changes() -> None:
    from mixprec.training.scaling import NoLossScale

    none = NoLossScale()
    grads = [torch.tensor([1.0, math.inf])]
    found = none.unscale_step(grads, grads, torch.ones(()), agree=None)
    assert float(found) == 1.0
    assert none.get_drop_overflow_update()
    none.after_step(found, None, overflow=lambda: pytest.fail("no host read"))
    assert none.scale_on(torch.device("cpu")) is None
    assert none.device_state() is None
    assert none.decides_on_device()
    assert none.get_loss_scale() == 1.0
    assert repr(none) == "NoLossScale()"


def test_one_seam_mechanism_plugs_every_part_in() -> None:
    from mixprec.training.step import StepSeam

    calls: list[str] = []

    class Recorder(StepSeam):
        def before_forward(self, step: Any, inputs: Any, kwargs: Any, label: Any) -> None:
            calls.append(f"before_forward {tuple(inputs[0].shape)} {tuple(label.shape)}")

        def after_backward(self, step: Any) -> None:
            calls.append("after_backward")

        def after_unscale(self, step: Any, params: Any) -> None:
            calls.append(f"after_unscale {float(step.found_inf)}")

        def after_step(self, step: Any, applied: Any, scale: Any) -> None:
            calls.append(f"after_step {applied} {None if scale is None else float(scale)}")

    model = _mlp()
    step = amp.build_train_network(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), "O0",
        loss_scale_manager=amp.FixedLossScaleManager(8.0), debug_overflow=True,
    )  # fmt: skip
    step.seams.append(Recorder())
    assert [type(s).__name__ for s in step.seams] == ["_OverflowSeam", "_UserSeam", "Recorder"]
    step(*_batch())
    step(*_batch(poison=True))
    assert calls == [
        "before_forward (6, 8) (6,)", "after_backward", "after_unscale 0.0", "after_step True 8.0",
        "before_forward (6, 8) (6,)", "after_backward", "after_unscale 1.0", "after_step False 8.0",
    ]  # fmt: skip
    assert step.last_overflow_report is not None  # the debugger is a seam too
