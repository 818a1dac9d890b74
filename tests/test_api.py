"""The public surface: names, dtype spellings, lists, and every error message."""

from __future__ import annotations

import logging
import operator

import pytest
import torch
from torch import nn

import mixprec as amp
from helpers import MLP
from mixprec.policy import lists
from mixprec.policy.dtypes import resolve_dtype
from mixprec.policy.ops import op_key, op_name

PUBLIC = {
    "CalibrationReport",
    "CastPlan",
    "DynamicLossScaleManager",
    "DynamicLossScaler",
    "FixedLossScaleManager",
    "GroupLossScaleManager",
    "Level",
    "LossScaleManager",
    "LintReport",
    "LossScaler",
    "OverflowReport",
    "StaticLossScaler",
    "StepMetrics",
    "TrainStep",
    "all_finite",
    "auto_mixed_precision",
    "build_train_network",
    "calibrate",
    "custom_mixed_precision",
    "explain",
    "find_overflow",
    "get_black_list",
    "get_white_list",
    "lint",
    "unscale_",
}


def test_public_names() -> None:
    assert set(amp.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(amp, name) is not None


@pytest.mark.parametrize(
    ("spelling", "expected"),
    [
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        ("fp16", torch.float16),
        ("float16", torch.float16),
        ("half", torch.float16),
        ("HALF", torch.float16),
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("torch.bfloat16", torch.bfloat16),
        (None, torch.bfloat16),  # the CPU's usual low type
    ],
)
def test_dtype_spellings(spelling: object, expected: torch.dtype) -> None:
    assert resolve_dtype(spelling) == expected


@pytest.mark.parametrize("bad", [torch.float32, torch.int8, "fp8", "float", 16, object()])
def test_unknown_dtype_lists_the_choices(bad: object) -> None:
    with pytest.raises(
        ValueError, match=r"dtype must be one of torch.float16, torch.bfloat16, 'fp16'.*; got "
    ):
        amp.auto_mixed_precision(MLP(), "O2", bad)  # type: ignore[arg-type]


def test_unknown_level_lists_the_choices() -> None:
    with pytest.raises(
        ValueError,
        match=r"The amp level 'O5' is not supported: amp_level must be one of 'O0', 'O1', 'O2', 'O3', 'autocast', 'auto'",
    ):
        amp.auto_mixed_precision(MLP(), "O5")
    assert amp.Level.parse("o2") is amp.Level.O2
    assert amp.Level.parse(amp.Level.AUTOCAST) is amp.Level.AUTOCAST


def test_non_module_network() -> None:
    with pytest.raises(TypeError, match=r"network must be a torch.nn.Module; got function"):
        amp.auto_mixed_precision(lambda x: x, "O2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"network must be a torch.nn.Module; got list"):
        amp.custom_mixed_precision([nn.Linear(2, 2)], white_list=[nn.Linear])  # type: ignore[arg-type]


def test_default_lists_are_copies() -> None:
    white, black = amp.get_white_list(), amp.get_black_list()
    assert nn.Linear in white
    assert torch.matmul in white
    assert nn.MultiheadAttention in white
    assert {nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm, nn.SyncBatchNorm} <= set(black)
    white.clear()
    black.clear()
    assert amp.get_white_list()
    assert amp.get_black_list()
    assert isinstance(lists.WHITE_MODULES, tuple)
    assert isinstance(lists.CPU_LOWER_OPS, frozenset)


def test_op_names_unify_function_method_and_operator_forms() -> None:
    assert (
        op_name(torch.matmul)
        == op_name(torch.Tensor.matmul)
        == op_name(operator.matmul)
        == "matmul"
    )
    assert op_name("__matmul__") == op_name("__rmatmul__") == "matmul"
    assert op_name("__iadd__") == "add_"
    assert op_key(torch.nn.functional.relu) == op_key(torch.relu) == "relu"

    def mine(x: torch.Tensor) -> torch.Tensor:
        return x

    assert op_key(mine) is mine  # a user's function is keyed by identity


def test_custom_lists_exactly_one() -> None:
    with pytest.raises(ValueError, match="exactly one of white_list or black_list; got neither"):
        amp.custom_mixed_precision(MLP())
    with pytest.raises(ValueError, match="exactly one of white_list or black_list; got both"):
        amp.custom_mixed_precision(MLP(), white_list=[nn.Linear], black_list=[nn.LayerNorm])


def test_custom_list_must_be_a_list_of_classes_or_functions() -> None:
    with pytest.raises(TypeError, match=r"white_list must be a list; got tuple: \(<class"):
        amp.custom_mixed_precision(MLP(), white_list=(nn.Linear,))  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=r"white_list\[0\] must be a class, not an instance: got Linear.*pass Linear itself",
    ):
        amp.custom_mixed_precision(MLP(), white_list=[nn.Linear(2, 2)])  # type: ignore[list-item]
    with pytest.raises(
        TypeError, match=r"white_list\[1\] must be one of nn.Module subclasses or functions; got 3"
    ):
        amp.custom_mixed_precision(MLP(), white_list=[nn.Linear, 3])  # type: ignore[list-item]
    with pytest.raises(
        TypeError, match=r"black_list\[0\] must be one of nn.Module subclasses; got <built-in"
    ):
        amp.custom_mixed_precision(MLP(), black_list=[torch.matmul])  # type: ignore[list-item]
    with pytest.raises(
        TypeError, match=r"black_list\[0\] must be one of nn.Module subclasses; got <class 'int'>"
    ):
        amp.custom_mixed_precision(MLP(), black_list=[int])  # type: ignore[list-item]


def test_black_list_leaving_out_defaults_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        converted = amp.custom_mixed_precision(
            nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2), nn.BatchNorm1d(2)),
            black_list=[nn.LayerNorm],
        )
    assert "black_list leaves out built-in black-list entries BatchNorm1d" in caplog.text
    rows = {row.path: row.dtype for row in amp.explain(converted).rows if row.note == "island"}
    assert rows == {"1": "float32"}  # only the listed class is an fp32 island


def test_pin_errors() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(
        ValueError,
        match=r"fp32_modules names '1.1', which is not a module of the network; did you mean '1.0'",
    ):
        amp.auto_mixed_precision(model, "O1", fp32_modules=["1.1"])
    with pytest.raises(
        TypeError, match="low_modules must be a list of qualified module names or a function"
    ):
        amp.auto_mixed_precision(model, "O1", low_modules="0")
    with pytest.raises(
        TypeError, match=r"low_modules must hold qualified module names \(str\); got 0"
    ):
        amp.auto_mixed_precision(model, "O1", low_modules=[0])  # type: ignore[list-item]


def test_explain_errors() -> None:
    with pytest.raises(ValueError, match="was not converted by mixprec"):
        amp.explain(MLP())
    with pytest.raises(TypeError, match="network must be a torch.nn.Module; got str"):
        amp.explain("model")  # type: ignore[arg-type]


def test_auto_level_follows_the_probe(cpu_kind: str) -> None:
    model = MLP()
    if cpu_kind == "native-bf16":
        converted = amp.auto_mixed_precision(model, "auto")
        assert amp.explain(converted).level == "O2"
        assert amp.explain(converted).dtype == "bfloat16"
    else:
        with pytest.warns(UserWarning, match="chose O0") as record:
            assert amp.auto_mixed_precision(model, "auto") is model
        assert record[0].filename == __file__  # the user's line, not mixprec's


def test_scaler_validation_messages() -> None:
    with pytest.raises(ValueError, match=r"scale_window must be an int >= 1; got 0"):
        amp.DynamicLossScaleManager(scale_window=0)
    with pytest.raises(ValueError, match=r"loss_scale must be a finite number >= 1; got 0.5"):
        amp.FixedLossScaleManager(0.5)
    with pytest.raises(ValueError, match=r"init_loss_scale must be a finite number >= 1; got 0.25"):
        amp.DynamicLossScaleManager(init_loss_scale=0.25)


@pytest.mark.parametrize("level", ["O1", "autocast", "O2", "O3"])
def test_explain_with_example_inputs_counts_their_casts(level: str) -> None:
    from helpers import TinyTransformer, count_casts

    model = TinyTransformer().eval()
    tokens = torch.randint(0, 50, (2, 7))
    converted = amp.auto_mixed_precision(model, level, "bf16")
    _, counter = count_casts(converted, tokens)
    plan = amp.explain(converted, tokens)
    if level in ("O1", "autocast"):
        # the encoder layer's own code branches on tensor values, so its ops are decided at
        # run time: the plan names that part and counts no more casts than are made
        assert plan.runtime_parts == ("encoder",)
        assert plan.num_casts <= counter.total
        assert "encoder runs at run time: its forward branches or loops on tensor values" in str(
            plan
        )
        return
    assert plan.runtime_parts == ()
    assert amp.explain(converted, tokens).num_casts == counter.total
    assert amp.explain(converted, tokens=tokens).num_casts == counter.total
    assert amp.explain(converted, tokens).assumption == "the given example inputs"
    with pytest.raises(TypeError, match="the example inputs do not fit"):
        amp.explain(converted, tokens, tokens)


def test_explain_with_a_low_precision_input() -> None:
    from helpers import count_casts

    converted = amp.auto_mixed_precision(MLP(), "O2", "bf16")
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    _, counter = count_casts(converted, x)
    assert amp.explain(converted).num_casts == counter.total + 1  # the default assumes float32
    assert amp.explain(converted, x).num_casts == counter.total


def test_more_option_errors() -> None:
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        ValueError,
        match=r"cast_model_type must be torch.float32 \('fp32', 'float32'\) or a low-precision dtype .*; got 'int8'",
    ):
        amp.build_train_network(model, optimizer, level="O2", cast_model_type="int8")
    with pytest.raises(TypeError, match="accumulation_steps must be a positive int; got '2'"):
        amp.build_train_network(model, optimizer, accumulation_steps="2")
    with pytest.raises(
        ValueError,
        match=r"fp32_modules names 'zzz', which is not a module of the network; its modules are 'net', 'net.0'",
    ):
        amp.auto_mixed_precision(model, "O1", fp32_modules=["zzz"])
