"""GroupLossScaleManager: per-group traces in closed form, rescaled gradients, skips."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import mixprec as amp
from mixprec.boost import GroupLossScaleManager


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_trace_per_group_in_closed_form() -> None:
    manager = GroupLossScaleManager(1024, [["a"], ["b"], ["c"]], scale_factor=2, scale_window=2)
    flags = [
        [False, False, False],
        [False, False, False],  # every group's window is full: all grow
        [False, True, False],  # group 1 backs off alone
        [True, True, False],  # the inf reached group 0 from group 1: only group 1 backs off
        [True, False, False],
        [False, False, True],
    ]
    expected = [
        [1024, 1024, 1024],
        [2048, 2048, 2048],
        [2048, 1024, 2048],
        [4096, 512, 4096],
        [2048, 512, 4096],
        [2048, 1024, 2048],
    ]
    trace = []
    for overflow in flags:
        manager.update_loss_scale(overflow)
        trace.append(manager.get_loss_scales())
    assert trace == expected


def test_lower_groups_back_off_below_one_the_last_stays_at_one() -> None:
    manager = GroupLossScaleManager(2, [["a"], ["b"]], scale_window=100)
    for _ in range(3):
        manager.update_loss_scale([True, False])
    assert manager.get_loss_scales() == [0.25, 2.0]
    for _ in range(3):
        manager.update_loss_scale([False, True])
    assert manager.get_loss_scales() == [0.25, 1.0]


def test_each_group_is_unscaled_by_its_own_scale() -> None:
    model = _mlp()
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    nn.CrossEntropyLoss()(model(x), y).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    manager = GroupLossScaleManager(1, [["0"], ["2"]])
    seen: list[torch.Tensor] = []
    step = amp.build_train_network(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        nn.CrossEntropyLoss(),
        loss_scale_manager=manager,
        after_unscale=lambda s, params: seen.extend(p.grad.clone() for p in params),
    )
    manager.load_state_dict(manager.state_dict() | {"loss_scales": torch.tensor([8.0, 4096.0])})
    step(x, y)
    assert not step.overflow
    assert step.loss_scale == 4096.0
    for got, want in zip(seen, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_only_the_overflowing_group_backs_off_and_the_step_is_skipped() -> None:
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    manager = GroupLossScaleManager(2.0**24, [["0"], ["2"]], scale_window=100)
    step = amp.build_train_network(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        "O2",
        dtype="fp16",
        loss_scale_manager=manager,
    )
    step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
    assert step.overflow
    assert step.skipped_steps == 1
    assert manager.last_overflows() == [True, True]  # the inf flows down into group 0
    assert manager.get_loss_scales() == [2.0**24, 2.0**23]
    for p, old in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), old)


def _large_input_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        model[0].weight.mul_(1e-3)  # small activations into the last layer
        model[2].weight.mul_(20)  # large gradients flowing back into the first
    return model


@pytest.mark.parametrize("grouped", [False, True], ids=["single-scale", "group-scales"])
def test_groups_skip_fewer_steps_when_one_layer_overflows_unscaled(grouped: bool) -> None:
    """Inputs of magnitude 1000 and a sum loss over 512 samples make the first layer's
    float16 weight gradient ~6e5 > 65504 even at scale 1; the last layer's are ~200."""
    model = _large_input_model()
    manager: amp.LossScaleManager = (
        GroupLossScaleManager(1, [["0"], ["2"]], scale_window=1000)
        if grouped
        else amp.DynamicLossScaleManager(1, scale_window=1000)
    )
    step = amp.build_train_network(
        model,
        torch.optim.SGD(model.parameters(), lr=1e-7),
        nn.CrossEntropyLoss(reduction="sum"),
        "O2",
        dtype="fp16",
        loss_scale_manager=manager,
    )
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(512, 8, generator=generator) * 1000
    y = torch.randint(0, 4, (512,), generator=generator)
    control = _large_input_model()
    nn.CrossEntropyLoss(reduction="sum")(control(x), y).backward()
    amax = control[0].weight.grad.abs().max().item()
    halvings = math.ceil(math.log2(amax / torch.finfo(torch.float16).max))  # 4
    assert halvings >= 2
    for _ in range(12):
        step(x, y)
    if grouped:
        assert step.skipped_steps == halvings  # group 0 backs off until it fits, then trains
        assert manager.get_loss_scales() == [2.0**-halvings, 1.0]  # type: ignore[attr-defined]
    else:
        assert step.skipped_steps == 12  # no scale >= 1 fits: nothing ever trains


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.c(self.b(h) + h)


def test_a_skip_connection_across_a_boundary_is_refused_by_name() -> None:
    model = _Residual()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"'a' \(computed in group 0, \['a'\]\) is used by 'add'"):
        amp.build_train_network(
            model, optimizer, loss_scale_manager=GroupLossScaleManager(8, [["a"], ["b", "c"]])
        )
    # the skip inside one group is fine
    amp.build_train_network(
        model, optimizer, loss_scale_manager=GroupLossScaleManager(8, [["a", "b"], ["c"]])
    )


def test_bad_groups_are_refused() -> None:
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="loss_scale_groups must be a list of groups"):
        GroupLossScaleManager(8, "0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="names module '0' twice"):
        GroupLossScaleManager(8, [["0"], ["0"]])
    with pytest.raises(ValueError, match="'3', which is not a submodule"):
        amp.build_train_network(
            model, optimizer, loss_scale_manager=GroupLossScaleManager(8, [["0"], ["3"]])
        )
    with pytest.raises(ValueError, match="covers no module holding parameter '2.weight'"):
        amp.build_train_network(
            model, optimizer, loss_scale_manager=GroupLossScaleManager(8, [["0"], ["1"]])
        )


def test_checkpoint_round_trip() -> None:
    def build() -> tuple[amp.TrainStep, GroupLossScaleManager]:
        model = _mlp()
        manager = GroupLossScaleManager(64, [["0"], ["2"]], scale_window=2)
        step = amp.build_train_network(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            nn.CrossEntropyLoss(),
            loss_scale_manager=manager,
        )
        return step, manager

    step, manager = build()
    manager.update_loss_scale([True, False])
    for _ in range(3):
        step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
    state = step.state_dict()
    fresh, fresh_manager = build()
    fresh.load_state_dict(state)
    assert fresh_manager.state_dict().keys() == manager.state_dict().keys()
    for key, value in manager.state_dict().items():
        got = fresh_manager.state_dict()[key]
        assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value
    other = GroupLossScaleManager(64, [["0", "2"]])
    with pytest.raises(ValueError, match="the checkpoint's groups"):
        other.load_state_dict(manager.state_dict())
