"""Boost levels: O1 keeps the numbers, O2 freezes what its schedule says, decisions and errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import mixprec as amp
from helpers import needs_compile
from mixprec.boost import plan as boost_plan
from mixprec.boost.freeze import freeze_schedule, split_groups

NO_TIMING = {"optimizer": "off", "channels_last": False, "compile": False}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, bias=False),  # a bias before a norm has no gradient
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 16),
        nn.ReLU(),
        nn.Linear(16, 3),
    )


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 1, 8, 8, generator=generator), torch.randint(
        0, 3, (8,), generator=generator
    )


def _train(boost: str, config: dict[str, Any] | None, steps: int = 4, **kw: Any) -> nn.Module:
    model = _net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = amp.build_train_network(
        model, optimizer, nn.CrossEntropyLoss(), "O0", boost, boost_config=config, **kw
    )
    x, y = _data()
    for _ in range(steps):
        step(x, y)
    return model


def test_boost_o1_trains_to_the_same_parameters_as_o0() -> None:
    reference = _train("O0", None)
    config = {
        "optimizer": "fused",
        "channels_last": True,
        "compile": True,
        "compile_backend": "eager",  # the graph capture, not inductor's 25 s compile
    }
    boosted = _train("O1", config)
    for (name, want), got in zip(reference.named_parameters(), boosted.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    assert boosted[0].weight.is_contiguous(memory_format=torch.channels_last)


def test_repr_says_what_was_switched_on_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        boost_plan,
        "time_optimizer_impls",
        lambda opt, impls: {"default": 1.0, "fused": 0.5, "foreach": 0.8},
    )
    monkeypatch.setattr(boost_plan, "time_layouts", lambda net, args: (1.0, 1.0))
    model = _net()
    optimizer = torch.optim.Adam(model.parameters())
    step = amp.build_train_network(model, optimizer, nn.CrossEntropyLoss(), boost_level="o1")
    assert all(g["fused"] for g in optimizer.param_groups)
    assert "optimizer=on (fused: fused measured 2.00x faster per step)" in repr(step)
    assert "channels_last=pending (timed on the first batch)" in repr(step)
    assert "compile=off (rule: off on CPU" in repr(step)
    assert "freeze=off (level O1)" in repr(step)
    step(*_data())
    assert "channels_last=off (measured 1.00x on the first batch)" in repr(step)
    assert model[0].weight.is_contiguous()


def test_no_faster_kernel_leaves_the_optimizer_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        boost_plan,
        "time_optimizer_impls",
        lambda opt, impls: {"default": 1.0, "fused": 0.99, "foreach": "RuntimeError: no"},
    )
    model = nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters())
    step = amp.build_train_network(model, optimizer, nn.MSELoss(), boost_level="O1")
    assert not any(g["fused"] for g in optimizer.param_groups)
    assert "optimizer=off (no kernel faster: fused 1.01x)" in repr(step)
    assert "channels_last=off (no 2-d convolutions)" in repr(step)


def test_an_unavailable_kernel_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        boost_plan, "time_optimizer_impls", lambda opt, impls: {"fused": "RuntimeError: no"}
    )
    model = nn.Linear(2, 2)
    with pytest.warns(UserWarning, match="cannot run fused here"):
        step = amp.build_train_network(
            model,
            torch.optim.Adam(model.parameters()),
            boost_level="O1",
            boost_config={"optimizer": "fused"},
        )
    assert "optimizer=off (fused unavailable)" in repr(step)


def test_freeze_schedules_in_closed_form() -> None:
    # continuous: zeros = round(p (G-1) / (1-p)) = 3, then 1..G-1, repeated
    assert freeze_schedule(4, 0, 0.5, 9, seed=0) == [0, 0, 0, 1, 2, 3, 0, 0, 0]
    interval = freeze_schedule(4, 1, 0.7, 1000, seed=3)
    assert interval == freeze_schedule(4, 1, 0.7, 1000, seed=3)
    assert interval != freeze_schedule(4, 1, 0.7, 1000, seed=4)
    frozen = [k for k in interval if k]
    assert abs(len(frozen) / 1000 - 0.3) < 0.01  # the share of freezing steps is 1 - freeze_p
    assert frozen.count(1) > frozen.count(2) > frozen.count(3) > 0  # weights 3 : 2 : 1
    assert freeze_schedule(1, 1, 0.7, 5, seed=0) == [0] * 5


def test_groups_keep_a_layer_with_its_bias_and_norm() -> None:
    model = _net()
    names = {id(p): n for n, p in model.named_parameters()}
    groups = split_groups(model, 3)
    assert [[names[id(p)] for p in g] for g in groups] == [
        ["0.weight", "1.weight", "1.bias"],
        ["4.weight", "4.bias"],
        ["6.weight", "6.bias"],
    ]


def test_o2_freezes_exactly_the_scheduled_groups_and_still_trains() -> None:
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with_grad: list[set[int]] = []
    step = amp.build_train_network(
        model,
        optimizer,
        nn.CrossEntropyLoss(),
        "O0",
        "O2",
        boost_config={**NO_TIMING, "param_groups": 3, "freeze_p": 0.5, "seed": 0},
        after_unscale=lambda s, params: with_grad.append({id(p) for p in params}),
    )
    assert step.boost is not None
    assert step.boost.freeze is not None
    groups = step.boost.freeze.groups
    x, y = _data()
    first = float(step(x, y))
    for _ in range(15):
        before = [p.detach().clone() for p in model.parameters()]
        index = step.boost.freeze.index(step.optimizer_steps)
        loss = float(step(x, y))
        trained = {id(p) for g in groups[index:] for p in g}
        assert with_grad[-1] == trained
        for p, old in zip(model.parameters(), before, strict=True):
            assert torch.equal(p.detach(), old) == (id(p) not in trained)
        assert all(p.requires_grad for p in model.parameters())  # restored after backward
    schedule = [step.boost.freeze.index(i) for i in range(16)]
    assert {0, 1, 2} <= set(schedule)
    assert loss < 0.5 * first
    # the same seed trains to the same parameters
    again = _net()
    rerun = amp.build_train_network(
        again,
        torch.optim.SGD(again.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        "O0",
        "O2",
        boost_config={**NO_TIMING, "param_groups": 3, "freeze_p": 0.5, "seed": 0},
    )
    for _ in range(16):
        rerun(x, y)
    for p, q in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q)


def test_boost_config_errors() -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def build(config: Any, level: str = "O2") -> None:
        amp.build_train_network(model, optimizer, nn.MSELoss(), "O0", level, boost_config=config)

    with pytest.raises(ValueError, match=r"unknown key 'freeze_prob'; did you mean 'freeze_p'"):
        build({"freeze_prob": 0.5})
    with pytest.raises(ValueError, match=r"freeze_p'\] .* must be a number in \[0, 1\]; got 1.5"):
        build({"freeze_p": 1.5})
    with pytest.raises(ValueError, match=r"freeze_type'\] must be one of 0, 1; got 2"):
        build({"freeze_type": 2})
    with pytest.raises(
        ValueError, match=r"compile'\] must be one of 'auto', True, False; got 'yes'"
    ):
        build({"compile": "yes"})
    with pytest.raises(ValueError, match=r"param_groups'\] must be an int >= 1; got 0"):
        build({"param_groups": 0})
    with pytest.raises(TypeError, match="boost_config must be a dict or None; got 3"):
        build(3)


@needs_compile
def test_freezing_under_compile_beyond_the_recompile_limit_is_refused() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(12)))
    with pytest.raises(ValueError, match=r"12 different sets of groups.*recompile limit of 8"):
        amp.build_train_network(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            nn.MSELoss(),
            "O0",
            "O2",
            boost_config={
                "optimizer": "off",
                "compile": True,
                "compile_backend": "eager",
                "param_groups": 12,
                "freeze_type": 0,
            },
        )


@needs_compile
def test_compile_with_master_weights_captures_one_graph() -> None:
    """The hooks (the master weights' check of outside writes) stay out of the graph."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    step = amp.build_train_network(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        "O2",
        "O1",
        dtype="bf16",
        boost_config={"optimizer": "off", "compile": True, "compile_backend": "eager"},
    )
    before = counters["stats"]["unique_graphs"]
    for _ in range(10):
        step(torch.randn(4, 4), torch.randint(0, 2, (4,)))
    assert counters["stats"]["unique_graphs"] - before == 1
    assert "compile=on (boost_config, backend 'eager'; first call incl. compile" in repr(step)
