"""Defects of the training step, each pinned: sparse gradients, a failed optimizer step,
the boost optimizer choice, GroupLossScaleManager's checks, the overflow-limit message,
``loss_fn`` given as a class."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import mixprec as amp
from mixprec.boost import plan as boost_plan
from mixprec.boost.plan import has_fused_kernel
from mixprec.training.scaling import overflow_limit_message


class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(x).mean(1))


def _bag_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 10, (4, 5), generator=g), torch.randint(0, 3, (4,), generator=g)


@pytest.mark.parametrize(
    ("level", "dtype", "steps"),
    [("O2", "bfloat16", 1), ("O3", "bfloat16", 1), ("O2", "float16", 2), ("O1", "float16", 1)],
)
def test_sparse_gradients_train_at_every_level(level: str, dtype: str, steps: int) -> None:
    torch.manual_seed(0)
    model = _Bag()
    before = model.emb.weight.detach().clone()
    step = amp.build_train_network(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        nn.CrossEntropyLoss(),
        level=level,
        dtype=dtype,
        accumulation_steps=steps,
    )
    x, y = _bag_batch()
    losses = [float(step(x, y)) for _ in range(3 * steps)]
    assert step.skipped_steps == 0
    assert losses[-1] < losses[0]
    used = torch.unique(x)
    assert not torch.equal(model.emb.weight.detach()[used], before[used])
    unused = [i for i in range(10) if i not in used.tolist()]
    assert torch.equal(model.emb.weight.detach()[unused], before[unused])


class _Exploding(torch.optim.SGD):
    fail = True

    def step(self, closure: Any = None) -> Any:
        if self.fail:
            raise RuntimeError("optimizer failed")
        return super().step(closure)


def test_a_failed_optimizer_step_is_not_counted() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = _Exploding(model.parameters(), lr=0.1)
    step = amp.build_train_network(
        model, optimizer, nn.MSELoss(), level="O2", dtype="float16", loss_scale_manager=None
    )
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    with pytest.raises(RuntimeError, match="optimizer failed"):
        step(x, y)
    assert step.optimizer_steps == 0
    assert step.skipped_steps == 0
    optimizer.fail = False
    step(x, y)
    assert step.optimizer_steps == 1


class _TakesFused(torch.optim.RMSprop):
    """An optimizer that accepts ``fused`` and ignores it (no fused kernel)."""

    def __init__(self, params: Any, lr: float = 0.01, fused: bool | None = None) -> None:
        super().__init__(params, lr=lr)
        for group in self.param_groups:
            group["fused"] = fused
        self.defaults["fused"] = fused


@pytest.mark.parametrize("choice", ["auto", "fused"])
def test_boost_never_picks_a_fused_kernel_the_optimizer_lacks(
    monkeypatch: pytest.MonkeyPatch, choice: str
) -> None:
    monkeypatch.setattr(
        boost_plan,
        "time_optimizer_impls",
        lambda opt, impls: {"default": 1.0, "fused": 0.1, "foreach": 0.99},
    )
    model = nn.Linear(2, 2)
    optimizer = _TakesFused(model.parameters())
    assert not has_fused_kernel(optimizer)
    amp.build_train_network(
        model, optimizer, nn.MSELoss(), boost_level="O1", boost_config={"optimizer": choice}
    )
    assert not any(g["fused"] for g in optimizer.param_groups)
    assert not getattr(optimizer, "_step_supports_amp_scaling", False)


@pytest.mark.parametrize(
    ("make", "fused"),
    [
        (lambda p: torch.optim.Adam(p), True),
        (lambda p: torch.optim.AdamW(p), True),
        (lambda p: torch.optim.SGD(p, lr=0.1), True),
        (lambda p: torch.optim.RMSprop(p), False),
        (lambda p: torch.optim.NAdam(p), False),
        (lambda p: torch.optim.RAdam(p), False),
        (lambda p: torch.optim.Adamax(p), False),
        (lambda p: torch.optim.Adadelta(p), False),
        (lambda p: torch.optim.ASGD(p), False),
    ],
)
def test_which_optimizers_have_a_fused_kernel(make: Any, fused: bool) -> None:
    assert has_fused_kernel(make([nn.Parameter(torch.ones(2))])) is fused


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def test_group_loss_scale_groups_must_be_in_forward_order() -> None:
    model = _mlp()
    manager = amp.GroupLossScaleManager(8, [["2"], ["0"]])
    with pytest.raises(ValueError, match="forward order: '2' \\(group 0\\) runs after '0'"):
        amp.build_train_network(
            model, torch.optim.SGD(model.parameters(), lr=0.1), loss_scale_manager=manager
        )


def test_group_loss_scale_names_a_misspelt_module() -> None:
    model = _mlp()
    manager = amp.GroupLossScaleManager(8, [["0"], ["2x"]])
    with pytest.raises(ValueError, match="'2x', which is not a submodule.*did you mean"):
        amp.build_train_network(
            model, torch.optim.SGD(model.parameters(), lr=0.1), loss_scale_manager=manager
        )


def test_group_loss_scale_refuses_fractional_counters() -> None:
    manager = amp.GroupLossScaleManager(8, [["0"], ["2"]], scale_window=10)
    state = manager.state_dict()
    manager.load_state_dict(state | {"good_steps": torch.tensor([3.0, 1.0])})
    assert manager.state_dict()["good_steps"].tolist() == [3, 1]
    with pytest.raises(TypeError, match="good_steps"):
        manager.load_state_dict(state | {"good_steps": torch.tensor([2.5, 1.0])})
    with pytest.raises(TypeError, match="bad_steps"):
        manager.load_state_dict(state | {"bad_steps": [0, 1.5]})


def test_the_overflow_limit_blames_a_fixed_scale() -> None:
    assert "not the cause" in overflow_limit_message(1001, 1024.0)
    fixed = overflow_limit_message(1001, 1024.0, fixed=True)
    assert "fixed loss scale 1024: the scale is the likely cause" in fixed
    assert "not the cause" in overflow_limit_message(1001, 1.0, fixed=True)


def test_the_step_names_a_fixed_scale_after_too_many_overflows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(amp.TrainStep, "MAX_CONSECUTIVE_OVERFLOWS", 2)
    monkeypatch.setattr(amp.TrainStep, "OVERFLOW_WARNING_AFTER", 100)
    model = nn.Linear(2, 1)
    step = amp.build_train_network(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.MSELoss(),
        level="O0",
        loss_scale_manager=amp.FixedLossScaleManager(2.0**20),
    )
    x, y = torch.full((2, 2), math.inf), torch.zeros(2, 1)
    step(x, y)
    step(x, y)
    with pytest.raises(RuntimeError, match="fixed loss scale 1.04858e\\+06"):
        step(x, y)


def test_a_loss_class_instead_of_an_instance_is_a_clear_type_error() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="got the class CrossEntropyLoss itself: pass"):
        amp.build_train_network(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            nn.CrossEntropyLoss,  # type: ignore[arg-type]
        )
