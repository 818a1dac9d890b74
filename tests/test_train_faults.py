"""No silent failure: each fault and bad input gets a clear error or correct behaviour."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import mixprec as amp
from helpers import MLP
from mixprec.training.scaling import DynamicLossScaler

INF, NAN = float("inf"), float("nan")


def _data(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 16, generator=g), torch.randint(0, 8, (n,), generator=g)


def _poisoned(x: torch.Tensor) -> torch.Tensor:
    bad = x.clone()
    bad[0, 0] = INF
    return bad


def _step(level: str = "O2", dtype: str | None = "bf16", **options: object) -> amp.TrainStep:
    torch.manual_seed(0)
    model = MLP()
    return amp.build_train_network(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        level=level,
        dtype=dtype,
        **options,
    )


# ------------------------------------------------------------------ bad input at build


@pytest.mark.parametrize("clip", [NAN, INF, 0.0, -1.0], ids=["nan", "inf", "zero", "negative"])
def test_clip_grad_norm_must_be_positive_and_finite(clip: float) -> None:
    with pytest.raises(ValueError, match=r"clip_grad_norm must be a positive finite number"):
        _step(clip_grad_norm=clip)


@pytest.mark.parametrize("clip", ["1.0", True, [1.0]], ids=["str", "bool", "list"])
def test_clip_grad_norm_of_another_type_is_a_type_error(clip: object) -> None:
    with pytest.raises(TypeError, match=r"clip_grad_norm must be a positive finite number"):
        _step(clip_grad_norm=clip)


def test_optimizer_over_another_models_parameters_is_refused() -> None:
    model, other = MLP(), MLP()
    with pytest.raises(ValueError, match="optimizer holds none of network's parameters"):
        amp.build_train_network(model, torch.optim.SGD(other.parameters(), lr=0.1))
    extra = nn.Parameter(torch.zeros(3))
    with pytest.warns(UserWarning, match="1 of the optimizer's 7 parameters belong neither"):
        amp.build_train_network(model, torch.optim.SGD([*model.parameters(), extra], lr=0.1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_module_levels_refuse_a_model_that_is_not_float32(level: str, dtype: torch.dtype) -> None:
    model = MLP().to(dtype)
    with pytest.raises(ValueError, match=rf"needs a float32 model .*holds {dtype} parameters"):
        amp.build_train_network(model, torch.optim.SGD(model.parameters(), lr=0.1), level=level)


def test_unknown_keyword_is_a_type_error_with_close_matches() -> None:
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        TypeError, match=r"Unsupported arg 'loss_scale'.*did you mean 'loss_scale_manager'"
    ):
        amp.build_train_network(model, optimizer, loss_scale=2)
    with pytest.raises(ValueError, match=r"did you mean 'clip_grad_norm'"):  # also a ValueError
        amp.build_train_network(model, optimizer, clip_grad=1.0)


def test_boost_level_is_validated_like_level() -> None:
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"boost_level must be one of 'O0', 'O1', 'O2'; got 'O5'"):
        amp.build_train_network(model, optimizer, boost_level="O5")
    with pytest.raises(TypeError, match=r"boost_level must be one of .*got 1"):
        amp.build_train_network(model, optimizer, boost_level=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"boost_level must be one of 'O0', 'O1', 'O2'; got 'O3'"):
        amp.build_train_network(model, optimizer, boost_level="O3")


def test_pins_reach_the_training_path() -> None:
    step = _step(fp32_modules=["net.2"])
    rows = {row.path: row for row in amp.explain(step.network).rows}
    assert rows["net.2"].dtype == "float32"
    assert step.network.net[2].weight.dtype == torch.float32
    assert step.network.net[0].weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="fp32_modules names 'net.9'"):
        _step(fp32_modules=["net.9"])


def test_a_converted_network_is_refused() -> None:
    converted = amp.auto_mixed_precision(MLP(), "O2", "bf16")
    with pytest.raises(ValueError, match="already converted by mixprec"):
        amp.build_train_network(converted, torch.optim.SGD(converted.parameters(), lr=0.1))


# ------------------------------------------------------------------ bad values in the step


@pytest.mark.parametrize("value", [0.5, None], ids=["float", "none"])
def test_loss_fn_returning_a_non_tensor_is_a_clear_error(value: object) -> None:
    model = MLP()
    step = amp.build_train_network(
        model, torch.optim.SGD(model.parameters(), lr=0.1), lambda out, y: value
    )
    with pytest.raises(
        TypeError, match=r"loss_fn must return the loss as a floating scalar tensor"
    ):
        step(*_data())
    assert all(p.grad is None for p in model.parameters())


def test_all_finite_sees_complex_inf_and_nan() -> None:
    assert amp.all_finite([torch.tensor([1 + 1j, complex(INF, 0)])]).item() is False
    assert amp.all_finite([torch.tensor([complex(0, NAN)])]).item() is False
    assert amp.all_finite([torch.tensor([1 + 2j])]).item() is True


def test_adjust_on_a_two_element_tensor_says_what_to_pass() -> None:
    scaler = DynamicLossScaler(1024, 2, 3)
    with pytest.raises(
        ValueError, match=r"finite must be a single flag .*shape \(2,\).*all_finite"
    ):
        scaler.adjust(torch.tensor([True, False]))
    scaler.adjust(torch.tensor([False]))  # one element is fine
    assert scaler.scale_value.item() == 512


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: amp.DynamicLossScaleManager(1e300), "init_loss_scale must be at most 3.40282e"),
        (lambda: amp.FixedLossScaleManager(1e39), "loss_scale must be at most"),
    ],
)
def test_scales_beyond_float32_are_refused(make: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()  # type: ignore[operator]


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("loss_scale", 0.0, "loss_scale must be a finite number >= 1; got 0.0"),
        ("loss_scale", torch.tensor(NAN), "loss_scale must be a finite number >= 1; got nan"),
        ("loss_scale", torch.tensor(INF), "loss_scale must be a finite number >= 1; got inf"),
        ("bad_steps", -1, "bad_steps must be an int >= 0; got -1"),
        ("good_steps", 5, "good_steps must be below scale_window=3; got 5"),
        ("loss_scale", torch.ones(2), r"loss_scale must be a number or a one-element tensor"),
    ],
)
def test_manager_state_is_validated_before_anything_is_written(
    key: str, value: object, match: str
) -> None:
    manager = amp.DynamicLossScaleManager(1024, 2, 3)
    state = {**manager.state_dict(), key: value}
    with pytest.raises(ValueError, match=match):
        manager.load_state_dict(state)
    assert manager.get_loss_scale() == 1024.0
    assert (manager.good_steps, manager.bad_steps) == (0, 0)


def test_scaler_state_accepts_numbers_and_tensors() -> None:
    scaler = DynamicLossScaler(8, 2, 3)
    scaler.load_state_dict(
        {"scale_value": 64, "counter": 2, "scale_factor": 2.0, "scale_window": 3}
    )
    assert scaler.scale_value.item() == 64.0
    assert scaler.counter.dtype == torch.int32
    with pytest.raises(ValueError, match="counter must be an int >= 0; got -2"):
        scaler.load_state_dict({**scaler.state_dict(), "counter": torch.tensor(-2)})


# ------------------------------------------------------------------ abandoned steps


class BoomError(Exception):
    pass


@pytest.mark.parametrize("error", [BoomError, KeyboardInterrupt], ids=["exception", "interrupt"])
@pytest.mark.parametrize("level", ["O0", "O2"])
def test_an_exception_in_backward_clears_the_gradients(
    level: str, error: type[BaseException]
) -> None:
    step = _step(level=level, accumulation_steps=2)
    control = _step(level=level, accumulation_steps=2)
    x, y = _data()
    step(x, y)  # a micro-batch accumulated, then the next one fails in backward
    weight = step.network.net[0].weight
    handle = weight.register_hook(lambda g: (_ for _ in ()).throw(error()))
    with pytest.raises(error):
        step(x, y)
    handle.remove()
    assert all(p.grad is None for p in step.optimizer.param_groups[0]["params"])
    assert all(p.grad is None for p in step.network.parameters())
    for _ in range(2):  # a whole fresh optimizer step matches a run that never failed
        step(x, y)
        control(x, y)
    for a, b in zip(
        step.optimizer.param_groups[0]["params"],
        control.optimizer.param_groups[0]["params"],
        strict=True,
    ):
        assert torch.equal(a, b)


@pytest.mark.parametrize("manager", ["fixed", "none", "dynamic"])
def test_consecutive_overflows_warn_then_raise_then_recover(
    monkeypatch: pytest.MonkeyPatch, manager: str
) -> None:
    managers = {
        "fixed": amp.FixedLossScaleManager(8.0),
        "none": None,
        "dynamic": amp.DynamicLossScaleManager(4, 2, 100),
    }
    step = _step(loss_scale_manager=managers[manager])
    monkeypatch.setattr(step, "OVERFLOW_WARNING_AFTER", 2)
    monkeypatch.setattr(step, "MAX_CONSECUTIVE_OVERFLOWS", 3)
    x, y = _data()
    step(_poisoned(x), y)
    with pytest.warns(RuntimeWarning, match="2 optimizer steps in a row were skipped"):
        step(_poisoned(x), y)
    step(_poisoned(x), y)
    with pytest.raises(RuntimeError, match="4 consecutive steps.*To recover, fix the cause"):
        step(_poisoned(x), y)
    assert all(p.grad is None for p in step.optimizer.param_groups[0]["params"])
    before = [p.detach().clone() for p in step.optimizer.param_groups[0]["params"]]
    step(x, y)  # recovery: a clean batch trains again
    assert not step.overflow
    assert step.consecutive_overflows == 0
    assert not torch.equal(before[0], step.optimizer.param_groups[0]["params"][0])


# ------------------------------------------------------------------ checkpoints


def test_malformed_checkpoints_are_refused_before_anything_is_written() -> None:
    step = _step(loss_scale_manager=amp.DynamicLossScaleManager(1024, 2, 3))
    x, y = _data()
    step(x, y)
    good = copy.deepcopy(step.state_dict())
    target = _step(loss_scale_manager=amp.DynamicLossScaleManager(64, 2, 3))
    weights = [p.detach().clone() for p in target.optimizer.param_groups[0]["params"]]

    def unchanged() -> None:
        for a, b in zip(weights, target.optimizer.param_groups[0]["params"], strict=True):
            assert torch.equal(a, b)
        assert target.loss_scale == 64

    scalar_masters = copy.deepcopy(good)
    n = len(scalar_masters["_extra_state"]["masters"])
    scalar_masters["_extra_state"]["masters"] = [torch.tensor(7.0)] * n
    with pytest.raises(ValueError, match=r"master weight 0 has shape \(\)"):
        target.load_state_dict(scalar_masters)
    unchanged()
    missing = {k: v for k, v in good.items() if k != "network.net.4.bias"}
    with pytest.raises(
        ValueError, match=r"missing keys \['network.net.4.bias'\].*nothing was loaded"
    ):
        target.load_state_dict(missing)
    unchanged()
    bad_scale = copy.deepcopy(good)
    bad_scale["_extra_state"]["loss_scale_manager"]["loss_scale"] = torch.tensor(0.0)
    with pytest.raises(ValueError, match="loss_scale must be a finite number >= 1; got 0.0"):
        target.load_state_dict(bad_scale)
    unchanged()
    target.load_state_dict(good)
    assert target.loss_scale == step.loss_scale


def test_a_checkpoint_written_by_0_1_0_loads() -> None:
    """0.1.0 wrote format 1: no 'format' key, the manager's state as plain numbers."""
    step = _step(loss_scale_manager=amp.DynamicLossScaleManager(1024, 2, 3))
    x, y = _data()
    step(x, y)
    state = step.state_dict()
    extra = state["_extra_state"]
    state["_extra_state"] = {
        "loss_scale_manager": {
            "loss_scale": 512.0,
            "scale_factor": 2.0,
            "scale_window": 3,
            "good_steps": 1,
            "bad_steps": 0,
        },
        "masters": extra["masters"],
        "overflow": False,
        "skipped_steps": 2,
        "optimizer_steps": 9,
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    target = _step(loss_scale_manager=amp.DynamicLossScaleManager(64, 2, 3))
    target.load_state_dict(torch.load(buffer, weights_only=True))
    assert target.loss_scale == 512.0
    assert (target.skipped_steps, target.optimizer_steps) == (2, 9)
    assert target.loss_scale_manager is not None
    assert target.loss_scale_manager.good_steps == 1  # type: ignore[attr-defined]


# ------------------------------------------------------------------ one source of truth


def test_writes_to_the_model_are_what_the_next_step_uses() -> None:
    step = _step()
    model_params = step.optimizer.param_groups[0]["params"]
    x, y = _data()
    step(x, y)
    # 1. an in-place write to the user's float32 model, then a direct call of the network
    with torch.no_grad():
        for p in model_params:
            p.fill_(0.01)  # an in-place write to the masters
    out = step.network(x)
    assert torch.equal(
        step.network.net[0].weight, torch.full_like(step.network.net[0].weight, 0.01)
    )
    # 2. step.network.load_state_dict with float32 values: the masters keep full precision
    value = torch.full((32, 16), 1 / 3)
    sd = step.network.state_dict()
    sd["net.0.weight"] = value
    step.network.load_state_dict(sd)
    assert torch.equal(model_params[0], value)
    # 3. a weight fixed after going inf is used by the next step, not overwritten
    with torch.no_grad():
        model_params[2].fill_(INF)
        model_params[2].zero_()
    step(x, y)
    assert torch.isfinite(model_params[2]).all()
    assert out.dtype == torch.float32


def test_load_state_dict_on_the_users_model_is_what_the_step_continues_from() -> None:
    torch.manual_seed(0)
    model, other = MLP(), MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = amp.build_train_network(
        model, optimizer, nn.CrossEntropyLoss(), level="O2", dtype="bf16"
    )
    x, y = _data()
    step(x, y)
    model.load_state_dict(other.state_dict())
    expected = other(x)
    torch.testing.assert_close(step.network(x), expected, rtol=0.05, atol=0.02)
    step(x, y)  # continues from other's weights
    control = copy.deepcopy(other)
    control_opt = torch.optim.SGD(control.parameters(), lr=0.1)
    nn.CrossEntropyLoss()(control(x), y).backward()
    control_opt.step()
    for a, b in zip(model.parameters(), control.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.01)


def test_step_network_low_precision_write_reaches_the_master() -> None:
    step = _step()
    x, y = _data()
    step(x, y)
    with torch.no_grad():
        step.network.net[0].weight.fill_(0.5)  # a low-precision write
    step(x, y)
    master = step.optimizer.param_groups[0]["params"][0]
    assert (master - 0.5).abs().max() < 0.1  # it continued from 0.5 (one SGD step away)


# ------------------------------------------------------------------ seams and scheduler


def test_scheduler_advances_only_on_applied_steps_and_seams_run() -> None:
    torch.manual_seed(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    seen: list[str] = []
    step = amp.build_train_network(
        model,
        optimizer,
        nn.CrossEntropyLoss(),
        level="O2",
        dtype="bf16",
        lr_scheduler=scheduler,
        after_unscale=lambda s, params: seen.append(f"unscale {len(params)}"),
        after_skip=lambda s: seen.append(f"skip {s.skipped_steps}"),
    )
    x, y = _data()
    for batch in (x, _poisoned(x), x, _poisoned(x), _poisoned(x)):
        step(batch, y)
    assert optimizer.param_groups[0]["lr"] == 0.25  # 2 applied steps of 5
    assert seen == [
        "unscale 6",
        "unscale 6",
        "skip 1",
        "unscale 6",
        "unscale 6",
        "skip 2",
        "unscale 6",
        "skip 3",
    ]
    with pytest.raises(ValueError, match="lr_scheduler was built on another optimizer"):
        amp.build_train_network(
            model, torch.optim.SGD(model.parameters(), lr=0.1), lr_scheduler=scheduler
        )


def test_after_unscale_sees_unscaled_gradients() -> None:
    grads: list[torch.Tensor] = []
    control = _step(level="O0", dtype=None)
    step = _step(
        level="O0",
        dtype=None,
        loss_scale_manager=amp.FixedLossScaleManager(1024.0),
        after_unscale=lambda s, params: grads.append(params[0].grad.clone()),
    )
    control_grads: list[torch.Tensor] = []
    control.hooks = type(control.hooks)(
        after_unscale=lambda s, p: control_grads.append(p[0].grad.clone())
    )
    x, y = _data()
    step(x, y)
    control(x, y)
    assert torch.equal(grads[0], control_grads[0])


# ------------------------------------------------------------------ fp16 warm-up


def test_default_fp16_manager_picks_its_first_scale_from_the_first_gradients() -> None:
    step = _step(dtype="fp16")
    x, y = _data()
    assert step.loss_scale == 1.0
    seen: list[float] = []
    step.hooks = type(step.hooks)(
        after_unscale=lambda s, params: seen.append(max(p.grad.abs().max().item() for p in params))
    )
    step(x, y)
    assert not step.overflow
    amax = seen[0]
    expected = 2.0 ** int(torch.floor(torch.log2(torch.tensor(2.0**10 / amax))).item())
    assert step.loss_scale == min(max(expected, 1.0), 2.0**24)
    assert 2.0**8 <= step.loss_scale <= 2.0**24
    step(x, y)
    assert not step.overflow


@pytest.mark.parametrize("with_loss_fn", [True, False])
def test_a_loss_that_is_not_a_scalar_is_a_type_error_naming_its_shape(with_loss_fn: bool) -> None:
    model = MLP()
    loss_fn = (lambda out, y: (out - out.detach()) ** 2) if with_loss_fn else None
    step = amp.build_train_network(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn)
    source = "loss_fn" if with_loss_fn else "the network"
    with pytest.raises(TypeError, match=rf"{source} must return the loss as a floating scalar "
                       r"tensor; got a float32 tensor of shape \(\d+, \d+\)"):  # fmt: skip
        step(*_data()) if with_loss_fn else step(_data()[0])
    assert all(p.grad is None for p in model.parameters())


def test_a_plateau_scheduler_is_refused_at_build() -> None:
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    with pytest.raises(TypeError, match=r"lr_scheduler=ReduceLROnPlateau steps on a metric"):
        amp.build_train_network(model, optimizer, nn.MSELoss(), lr_scheduler=plateau)
