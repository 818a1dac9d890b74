"""Tests for mixprec.training.scaling: traces, state round-trips, validation, overflow checks, no syncs."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from mixprec.training.grads import _inverse_scale, _unscale_grads, all_finite
from mixprec.training.scaling import (
    DynamicLossScaleManager,
    DynamicLossScaler,
    FixedLossScaleManager,
    LossScaleManager,
    LossScaler,
    StaticLossScaler,
    next_dynamic_scale,
)

INF, NAN = float("inf"), float("nan")

# MindSpore's published trace: init 1024, factor 2, window 3.
MANAGER_OVERFLOWS = ["F", "F", "F", "F", "T", "F", "F", "F", "T", "T"]
MANAGER_SCALES = [1024, 1024, 2048, 2048, 1024, 1024, 1024, 2048, 1024, 512]
SCALER_FINITE = ["T", "T", "T", "T", "F", "T", "T", "T"]
SCALER_SCALES = [1024, 1024, 2048, 2048, 1024, 1024, 1024, 2048]
SCALER_COUNTERS = [1, 2, 0, 1, 0, 1, 2, 0]


def run_manager(manager: LossScaleManager, overflows: list[str]) -> list[float]:
    scales = []
    for flag in overflows:
        manager.update_loss_scale(flag == "T")
        scales.append(manager.get_loss_scale())
    return scales


def run_scaler(
    scaler: DynamicLossScaler, finite: list[str], as_tensor: bool = True
) -> tuple[list[float], list[int]]:
    scales, counters = [], []
    for flag in finite:
        assert scaler.adjust(torch.tensor(flag == "T") if as_tensor else flag == "T") is True
        scales.append(scaler.scale_value.item())
        counters.append(int(scaler.counter.item()))
    return scales, counters


# --- host managers ------------------------------------------------------------------------------


def test_dynamic_manager_trace() -> None:
    manager = DynamicLossScaleManager(1024, scale_factor=2, scale_window=3)
    assert run_manager(manager, MANAGER_OVERFLOWS) == MANAGER_SCALES
    assert manager.get_drop_overflow_update() is True


def test_dynamic_manager_defaults() -> None:
    manager = DynamicLossScaleManager()
    assert (manager.loss_scale, manager.scale_factor, manager.scale_window) == (2**24, 2, 2000)
    assert (manager.good_steps, manager.bad_steps) == (0, 0)
    assert isinstance(manager.get_loss_scale(), float)


@pytest.mark.parametrize("overflows", [1000, 1001], ids=["1000-ok", "1001-raises"])
def test_dynamic_manager_raises_after_1000_consecutive_overflows(overflows: int) -> None:
    manager = DynamicLossScaleManager(1024, scale_factor=2, scale_window=3)
    for _ in range(overflows - 1):
        manager.update_loss_scale(True)
    if overflows == 1000:
        manager.update_loss_scale(True)
        assert manager.bad_steps == 1000
        manager.update_loss_scale(False)  # a clean step resets the run
        for _ in range(1000):
            manager.update_loss_scale(True)
        return
    with pytest.raises(RuntimeError, match=r"1001 consecutive.*learning rate.*bfloat16"):
        manager.update_loss_scale(True)


def test_dynamic_manager_scale_never_below_one_nor_inf() -> None:
    manager = DynamicLossScaleManager(2, scale_factor=4, scale_window=1)
    assert run_manager(manager, ["T", "T"]) == [1.0, 1.0]
    huge = DynamicLossScaleManager(2.0**127, scale_factor=2, scale_window=1)
    assert run_manager(huge, ["F", "F"]) == [2.0**127, 2.0**127]  # 2**128 is inf in float32
    assert huge.good_steps == 0


@pytest.mark.parametrize("drop", [True, False], ids=["drop", "no-drop"])
def test_fixed_manager_never_changes(drop: bool) -> None:
    manager = FixedLossScaleManager(256.0, drop_overflow_update=drop)
    assert run_manager(manager, ["T", "F", "T", "T", "F"]) == [256.0] * 5
    assert manager.get_drop_overflow_update() is drop
    assert manager.drop_overflow_update is drop
    assert manager.loss_scale == 256.0


def test_fixed_manager_defaults() -> None:
    manager = FixedLossScaleManager()
    assert manager.get_loss_scale() == 128.0
    assert manager.get_drop_overflow_update() is True


def test_base_manager_is_harmless() -> None:
    manager = LossScaleManager()
    manager.update_loss_scale(True)
    assert manager.get_loss_scale() == 1.0
    assert manager.get_drop_overflow_update() is True
    assert manager.state_dict() == {}
    manager.load_state_dict({})
    assert repr(manager) == "LossScaleManager()"


def test_manager_reprs_show_config_and_counters() -> None:
    manager = DynamicLossScaleManager(1024, scale_factor=2, scale_window=3)
    manager.update_loss_scale(True)
    assert repr(manager) == (
        "DynamicLossScaleManager(loss_scale=512.0, scale_factor=2.0, scale_window=3, "
        "good_steps=0, bad_steps=1)"
    )
    fixed = FixedLossScaleManager(64, drop_overflow_update=False)
    assert repr(fixed) == "FixedLossScaleManager(loss_scale=64.0, drop_overflow_update=False)"


# --- functional scalers -------------------------------------------------------------------------


@pytest.mark.parametrize("as_tensor", [True, False], ids=["bool-tensor", "python-bool"])
def test_dynamic_scaler_trace(as_tensor: bool) -> None:
    scaler = DynamicLossScaler(1024, scale_factor=2, scale_window=3)
    assert scaler.scale_value.dtype == torch.float32
    assert scaler.scale_value.dim() == 0
    assert scaler.counter.dtype == torch.int32
    assert scaler.counter.dim() == 0
    assert run_scaler(scaler, SCALER_FINITE, as_tensor) == (SCALER_SCALES, SCALER_COUNTERS)
    assert scaler.scale_value.dtype == torch.float32
    assert scaler.counter.dtype == torch.int32


def test_next_dynamic_scale_trace_and_purity() -> None:
    scale, counter = torch.tensor(1024.0), torch.tensor(0, dtype=torch.int32)
    scales, counters = [], []
    for flag in SCALER_FINITE:
        before = (scale.clone(), counter.clone())
        new_scale, new_counter = next_dynamic_scale(scale, counter, torch.tensor(flag == "T"), 2, 3)
        assert torch.equal(scale, before[0])
        assert torch.equal(counter, before[1])
        scale, counter = new_scale, new_counter
        scales.append(scale.item())
        counters.append(int(counter.item()))
    assert (scales, counters) == (SCALER_SCALES, SCALER_COUNTERS)
    assert counter.dtype == torch.int32
    assert scale.dtype == torch.float32


@pytest.mark.parametrize("as_tensor", [True, False], ids=["bool-tensor", "python-bool"])
def test_dynamic_scaler_limits(as_tensor: bool) -> None:
    flag: Callable[[bool], Any] = torch.tensor if as_tensor else bool
    floor = DynamicLossScaler(1, scale_factor=2, scale_window=3)
    floor.adjust(flag(False))
    assert floor.scale_value.item() == 1.0
    top = DynamicLossScaler(2.0**127, scale_factor=2, scale_window=1)
    top.adjust(flag(True))  # 2**128 is inf in float32: keep the scale
    assert top.scale_value.item() == 2.0**127
    assert top.counter.item() == 0


def test_static_scaler_facts() -> None:
    scaler = StaticLossScaler(1024)
    assert scaler.scale(torch.tensor(1.0)).item() == 1024.0
    g = torch.randn(64)
    assert torch.equal(scaler.unscale(g), g / 1024)
    assert scaler.adjust(torch.tensor(False)) is False
    assert scaler.adjust(True) is False
    assert scaler.scale_value.item() == 1024.0
    assert scaler.scale_value.dtype == torch.float32


@pytest.mark.parametrize(
    "scaler",
    [StaticLossScaler(8), DynamicLossScaler(8, scale_factor=2, scale_window=3)],
    ids=["static", "dynamic"],
)
def test_scale_and_unscale_nested_structures(scaler: LossScaler) -> None:
    ints = torch.tensor([1, 2])
    tree = {"a": torch.tensor([1.0, 2.0]), "b": (torch.tensor(0.5, dtype=torch.float64), ints, 3)}
    scaled = scaler.scale(tree)
    assert torch.equal(scaled["a"], torch.tensor([8.0, 16.0]))
    assert scaled["b"][0].dtype == torch.float64
    assert scaled["b"][0].item() == 4.0
    assert scaled["b"][1] is ints
    assert scaled["b"][2] == 3
    back = scaler.unscale(scaled)
    assert torch.equal(back["a"], tree["a"])
    assert back["b"][0].item() == 0.5
    assert back["b"][1] is ints


def test_scale_low_precision_keeps_dtype_without_overflowing_the_scale() -> None:
    scaler = StaticLossScaler(2**24)  # inf in float16
    x = torch.tensor([2.0**-20], dtype=torch.float16)
    scaled = scaler.scale(x)
    assert scaled.dtype == torch.float16
    assert scaled.item() == 16.0
    assert scaler.unscale(scaled).item() == 2.0**-20
    assert scaler.scale(torch.tensor([1.0], dtype=torch.bfloat16)).dtype == torch.bfloat16
    zero_dim = scaler.scale(torch.tensor(2.0**-20, dtype=torch.float16))  # 0-dim would promote
    assert zero_dim.dtype == torch.float16
    assert zero_dim.item() == 16.0


def test_dynamic_scaler_scales_with_the_current_scale() -> None:
    scaler = DynamicLossScaler(1024, scale_factor=2, scale_window=3)
    scaler.adjust(torch.tensor(False))
    assert scaler.scale(torch.tensor(1.0)).item() == 512.0
    assert scaler.unscale(torch.tensor(512.0)).item() == 1.0


def test_base_scaler_is_a_pass_through() -> None:
    scaler = LossScaler()
    x = torch.tensor(3.0)
    assert scaler.scale(x) is x
    assert scaler.unscale(x) is x
    assert scaler.adjust(True) is False
    assert scaler.state_dict() == {}
    assert scaler.to("cpu") is scaler


def test_scaler_to_and_repr() -> None:
    scaler = DynamicLossScaler(1024, scale_factor=2, scale_window=3)
    assert scaler.to(torch.device("cpu")) is scaler
    assert scaler.scale_value.device.type == "cpu"
    assert repr(scaler) == "DynamicLossScaler(scale_factor=2.0, scale_window=3, device=cpu)"
    assert repr(StaticLossScaler(4)) == "StaticLossScaler(device=cpu)"


# --- state_dict round trips ---------------------------------------------------------------------


def test_dynamic_manager_state_round_trip() -> None:
    manager = DynamicLossScaleManager(1024, scale_factor=2, scale_window=3)
    run_manager(manager, ["F", "T", "F", "T"])  # good_steps 0, bad_steps 1
    run_manager(manager, ["F"])  # good_steps 1, bad_steps 0
    manager.update_loss_scale(True)
    state = manager.state_dict()
    assert state == {
        "loss_scale": 128.0,
        "scale_factor": 2.0,
        "scale_window": 3,
        "good_steps": 0,
        "bad_steps": 1,
    }
    fresh = DynamicLossScaleManager(2**16, scale_factor=4, scale_window=10)
    fresh.load_state_dict(state)
    for name in ("loss_scale", "scale_factor", "scale_window", "good_steps", "bad_steps"):
        assert getattr(fresh, name) == getattr(manager, name), name
    assert fresh.state_dict() == state
    rest = ["F", "F", "F", "T", "F", "F", "F", "F"]
    assert run_manager(fresh, rest) == run_manager(manager, rest)
    assert fresh.state_dict() == manager.state_dict()


def test_fixed_manager_state_round_trip() -> None:
    manager = FixedLossScaleManager(256.0, drop_overflow_update=False)
    state = manager.state_dict()
    assert state == {"loss_scale": 256.0, "drop_overflow_update": False}
    fresh = FixedLossScaleManager()
    fresh.load_state_dict(state)
    assert fresh.loss_scale == 256.0
    assert fresh.get_drop_overflow_update() is False
    assert run_manager(fresh, ["T", "F"]) == run_manager(manager, ["T", "F"])


def test_dynamic_scaler_state_round_trip() -> None:
    scaler = DynamicLossScaler(1024, scale_factor=2, scale_window=3)
    run_scaler(scaler, ["T", "T", "T", "F", "T"])  # scale 1024, counter 1
    state = scaler.state_dict()
    assert set(state) == {"scale_value", "counter", "scale_factor", "scale_window"}
    scaler.adjust(True)
    assert state["counter"].item() == 1  # a snapshot, not a view of the live state
    fresh = DynamicLossScaler(8, scale_factor=4, scale_window=10)
    fresh.load_state_dict(state)
    scaler.load_state_dict(state)
    assert torch.equal(fresh.scale_value, scaler.scale_value)
    assert torch.equal(fresh.counter, scaler.counter)
    assert fresh.counter.dtype == torch.int32
    assert (fresh.scale_factor, fresh.scale_window) == (2.0, 3)
    rest = ["T", "T", "F", "T", "T", "T"]
    assert run_scaler(fresh, rest) == run_scaler(scaler, rest)


def test_static_scaler_state_round_trip() -> None:
    state = StaticLossScaler(1024).state_dict()
    assert set(state) == {"scale_value"}
    fresh = StaticLossScaler(4)
    fresh.load_state_dict(state)
    assert fresh.scale_value.item() == 1024.0
    assert fresh.unscale(torch.tensor(1024.0)).item() == 1.0


@pytest.mark.parametrize(
    "make",
    [
        LossScaleManager,
        FixedLossScaleManager,
        DynamicLossScaleManager,
        LossScaler,
        lambda: StaticLossScaler(2),
        lambda: DynamicLossScaler(2, 2, 3),
    ],
    ids=["manager", "fixed", "dynamic-manager", "scaler", "static", "dynamic-scaler"],
)
def test_load_state_dict_rejects_missing_and_unknown_keys(make: Callable[[], Any]) -> None:
    obj = make()
    state = obj.state_dict()
    with pytest.raises(ValueError, match=r"unknown keys \['bogus'\]"):
        obj.load_state_dict({**state, "bogus": 1})
    if state:
        first = next(iter(state))
        partial = {k: v for k, v in state.items() if k != first}
        with pytest.raises(ValueError, match=rf"missing keys \['{first}'\]"):
            obj.load_state_dict(partial)
    with pytest.raises(TypeError, match=r"state must be a dict; got \[\]"):
        obj.load_state_dict([])


def test_load_state_dict_with_a_bad_value_changes_nothing() -> None:
    manager = DynamicLossScaleManager(1024, scale_factor=2, scale_window=3)
    bad = {**manager.state_dict(), "scale_factor": 4.0, "loss_scale": 0.5}
    with pytest.raises(ValueError, match=r"loss_scale must be a finite number >= 1; got 0\.5"):
        manager.load_state_dict(bad)
    assert manager.scale_factor == 2.0
    assert manager.loss_scale == 1024.0
    scaler = DynamicLossScaler(1024, scale_factor=2, scale_window=3)
    with pytest.raises(ValueError, match=r"scale_window must be an int >= 1; got 0"):
        scaler.load_state_dict({**scaler.state_dict(), "scale_window": 0})
    assert scaler.scale_window == 3


# --- validation ---------------------------------------------------------------------------------

BAD_ARGUMENTS = [
    ("fixed-scale-low", lambda: FixedLossScaleManager(0.5), ValueError, "loss_scale", "0.5"),
    ("fixed-scale-inf", lambda: FixedLossScaleManager(INF), ValueError, "loss_scale", "inf"),
    ("fixed-scale-str", lambda: FixedLossScaleManager("128"), TypeError, "loss_scale", "'128'"),
    (
        "fixed-drop-int",
        lambda: FixedLossScaleManager(drop_overflow_update=1),
        TypeError,
        "drop_overflow_update",
        "1",
    ),
    (
        "dyn-init-low",
        lambda: DynamicLossScaleManager(init_loss_scale=0),
        ValueError,
        "init_loss_scale",
        "0",
    ),
    (
        "dyn-factor-one",
        lambda: DynamicLossScaleManager(scale_factor=1),
        ValueError,
        "scale_factor",
        "1",
    ),
    (
        "dyn-factor-half",
        lambda: DynamicLossScaleManager(scale_factor=0.5),
        ValueError,
        "scale_factor",
        "0.5",
    ),
    (
        "dyn-factor-bool",
        lambda: DynamicLossScaleManager(scale_factor=True),
        TypeError,
        "scale_factor",
        "True",
    ),
    (
        "dyn-window-zero",
        lambda: DynamicLossScaleManager(scale_window=0),
        ValueError,
        "scale_window",
        "0",
    ),
    (
        "dyn-window-negative",
        lambda: DynamicLossScaleManager(scale_window=-5),
        ValueError,
        "scale_window",
        "-5",
    ),
    (
        "dyn-window-float",
        lambda: DynamicLossScaleManager(scale_window=2.0),
        TypeError,
        "scale_window",
        "2.0",
    ),
    (
        "dyn-window-bool",
        lambda: DynamicLossScaleManager(scale_window=True),
        TypeError,
        "scale_window",
        "True",
    ),
    ("static-low", lambda: StaticLossScaler(0.9), ValueError, "scale_value", "0.9"),
    ("static-none", lambda: StaticLossScaler(None), TypeError, "scale_value", "None"),
    ("scaler-low", lambda: DynamicLossScaler(0.5, 2, 3), ValueError, "scale_value", "0.5"),
    ("scaler-factor", lambda: DynamicLossScaler(8, 1, 3), ValueError, "scale_factor", "1"),
    ("scaler-window", lambda: DynamicLossScaler(8, 2, 0), ValueError, "scale_window", "0"),
    ("scaler-window-float", lambda: DynamicLossScaler(8, 2, 1.5), TypeError, "scale_window", "1.5"),
    (
        "next-factor",
        lambda: next_dynamic_scale(torch.tensor(8.0), torch.tensor(0), True, 0.5, 3),
        ValueError,
        "factor",
        "0.5",
    ),
    (
        "next-window",
        lambda: next_dynamic_scale(torch.tensor(8.0), torch.tensor(0), True, 2, 0),
        ValueError,
        "window",
        "0",
    ),
    (
        "next-finite-float",
        lambda: next_dynamic_scale(torch.tensor(8.0), torch.tensor(0), 1.0, 2, 3),
        TypeError,
        "finite",
        "1.0",
    ),
    (
        "next-finite-float-tensor",
        lambda: next_dynamic_scale(torch.tensor(8.0), torch.tensor(0), torch.tensor(1.0), 2, 3),
        TypeError,
        "finite",
        "torch.float32",
    ),
    ("all-finite-item", lambda: all_finite([torch.ones(1), 3.0]), TypeError, "tensors", "3.0"),
    (
        "unscale-int-grad",
        lambda: _unscale_grads([torch.ones(2, dtype=torch.int64)], torch.tensor(1.0)),
        TypeError,
        "grads",
        "torch.int64",
    ),
    (
        "unscale-float-inv",
        lambda: _unscale_grads([torch.ones(2)], 0.5),
        TypeError,
        "inv_scale",
        "0.5",
    ),
]


@pytest.mark.parametrize(
    ("make", "error", "argument", "value"),
    [case[1:] for case in BAD_ARGUMENTS],
    ids=[case[0] for case in BAD_ARGUMENTS],
)
def test_bad_arguments_name_the_argument_and_value(
    make: Callable[[], Any], error: type[Exception], argument: str, value: str
) -> None:
    with pytest.raises(error, match=rf"^{re.escape(argument)} must .*got .*{re.escape(value)}"):
        make()


# --- all_finite and unscale_grads_ --------------------------------------------------------------

FINITE_CASES = [
    ("finite", [torch.tensor([1.0, -2.0, 3.0])], True),
    ("pos-inf", [torch.ones(3), torch.tensor([1.0, INF])], False),
    ("neg-inf", [torch.tensor([-INF, 0.0])], False),
    ("nan", [torch.tensor([NAN]), torch.ones(2)], False),
    (
        "mixed-dtypes",
        [
            torch.tensor([65504.0, -65504.0], dtype=torch.float16),  # fp16 max: an L2 norm is inf
            torch.tensor([3e38], dtype=torch.bfloat16),
            torch.tensor([1.0], dtype=torch.float64),
            torch.ones(3),
        ],
        True,
    ),
    ("fp16-inf", [torch.ones(2), torch.tensor([1.0, INF], dtype=torch.float16)], False),
    ("bf16-nan", [torch.tensor([NAN], dtype=torch.bfloat16), torch.ones(2)], False),
    ("ints-ignored", [torch.tensor([1, 2]), torch.tensor([True]), torch.ones(2)], True),
    ("empty", [], True),
    ("nones-and-empty-tensors", [None, torch.empty(0), torch.empty(0, dtype=torch.float16)], True),
    ("zero-dim-nan", [torch.tensor(NAN)], False),
]


@pytest.mark.parametrize(
    ("tensors", "expected"),
    [case[1:] for case in FINITE_CASES],
    ids=[case[0] for case in FINITE_CASES],
)
def test_all_finite(tensors: list[torch.Tensor], expected: bool) -> None:
    result = all_finite(tensors)
    assert result.dtype == torch.bool
    assert result.dim() == 0
    assert result.item() is expected
    assert all_finite(iter(tensors)).item() is expected  # any iterable, even a generator


def test_all_finite_single_tensor_dict_and_grad_leaves() -> None:
    assert all_finite(torch.tensor([1.0, INF])).item() is False
    assert all_finite({"w": torch.ones(2), "b": torch.tensor([NAN])}).item() is False
    leaf = torch.tensor([1.0, 2.0], requires_grad=True)
    version = leaf._version
    result = all_finite([leaf])
    assert result.item() is True
    assert not result.requires_grad
    assert leaf._version == version  # only read


def test_all_finite_sparse() -> None:
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, INF], (4,), check_invariants=True)
    assert all_finite([sparse]).item() is False
    assert (
        all_finite([torch.sparse_coo_tensor([[0]], [1.0], (4,), check_invariants=True)]).item()
        is True
    )


def test_unscale_grads_sparse() -> None:
    grad = torch.sparse_coo_tensor([[1, 3]], [8.0, 16.0], (4,), check_invariants=True)
    assert _unscale_grads([grad], torch.tensor(0.125)).item() == 0.0
    assert torch.equal(grad.to_dense(), torch.tensor([0.0, 1.0, 0.0, 2.0]))
    bad = torch.sparse_coo_tensor([[0]], [NAN], (2,), check_invariants=True)
    assert _unscale_grads([grad, bad], torch.tensor(1.0)).item() == 1.0


def test_inverse_scale_in_float64() -> None:
    inv = _inverse_scale(torch.tensor(3.0))
    assert inv.dtype == torch.float32
    assert inv.item() == torch.tensor(1 / 3, dtype=torch.float32).item()
    assert _inverse_scale(torch.tensor(1024.0)).item() == 2.0**-10


@pytest.mark.parametrize("exponent", [0, 10, 24], ids=lambda e: f"scale=2**{e}")
def test_unscale_grads_exact_for_powers_of_two(exponent: int) -> None:
    scale = torch.tensor(2.0**exponent)
    originals = [torch.randn(5, 3), torch.randn(7, dtype=torch.float64), torch.randn(())]
    grads = [g * scale.to(g.dtype) for g in originals]
    found_inf = _unscale_grads(grads, _inverse_scale(scale))
    assert found_inf.dtype == torch.float32
    assert found_inf.dim() == 0
    assert found_inf.item() == 0.0
    for grad, original in zip(grads, originals, strict=True):
        assert torch.equal(grad, original)


@pytest.mark.parametrize("bad", [INF, -INF, NAN], ids=["pos-inf", "neg-inf", "nan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_unscale_grads_reports_overflow(bad: float, dtype: torch.dtype) -> None:
    grads = [torch.full((3,), 4.0, dtype=dtype), torch.tensor([8.0, bad], dtype=dtype)]
    found_inf = _unscale_grads(grads, torch.tensor(0.25))
    assert found_inf.item() == 1.0
    assert grads[0].dtype == dtype
    assert torch.equal(grads[0], torch.ones(3, dtype=dtype))


def test_unscale_grads_fp16_and_mixed_dtypes() -> None:
    grads = [
        torch.tensor([2048.0, -1.0], dtype=torch.float16),
        torch.tensor([1024.0], dtype=torch.bfloat16),
        None,
        torch.tensor([4096.0]),
    ]
    found_inf = _unscale_grads(grads, _inverse_scale(torch.tensor(1024.0)))
    assert found_inf.item() == 0.0
    assert torch.equal(grads[0], torch.tensor([2.0, -1 / 1024], dtype=torch.float16))
    assert grads[1].item() == 1.0
    assert grads[3].item() == 4.0
    assert _unscale_grads([], torch.tensor(1.0)).item() == 0.0


# --- no host synchronization --------------------------------------------------------------------


class HostSyncError(AssertionError):
    pass


@contextlib.contextmanager
def forbid_host_sync(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every Tensor -> Python conversion raises while active."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise HostSyncError("host sync")

    with monkeypatch.context() as patch:
        for name in ("item", "__bool__", "__float__", "__int__", "tolist"):
            patch.setattr(torch.Tensor, name, refuse)
        with pytest.raises(HostSyncError):  # the patch works, so the test can fail
            bool(torch.tensor(True))
        yield


def test_tensor_paths_never_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    with forbid_host_sync(monkeypatch):
        grads = [torch.full((3,), 8.0), torch.tensor([1.0, INF], dtype=torch.float16)]
        finite = all_finite(grads)
        found_inf = _unscale_grads(grads, _inverse_scale(torch.tensor(8.0)))
        scaler = DynamicLossScaler(1024, scale_factor=2, scale_window=3)
        loss = scaler.scale(torch.tensor(1.0))
        unscaled = scaler.unscale({"g": torch.tensor([2048.0])})
        for flag in (finite, torch.tensor(True), True, False):
            scaler.adjust(flag)
        scale, counter = next_dynamic_scale(scaler.scale_value, scaler.counter, finite, 2, 3)
        state = scaler.state_dict()  # a snapshot; loading validates it, which reads it
        static = StaticLossScaler(4)
        static_out = static.unscale(static.scale(torch.tensor([0.5])))
        static.adjust(finite)
    assert finite.item() is False
    assert found_inf.item() == 1.0
    assert grads[0].tolist() == [1.0, 1.0, 1.0]
    assert loss.item() == 1024.0
    assert unscaled["g"].item() == 2.0
    assert scaler.scale_value.item() == 256.0
    assert scaler.counter.item() == 0
    assert scale.item() == 128.0
    assert counter.item() == 0
    assert static_out.item() == 0.5
    scaler.load_state_dict(state)
    assert scaler.scale_value.item() == 256.0
