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
    "dtype_name",
    "explain",
    "find_overflow",
    "float32_parameters",
    "get_black_list",
    "get_white_list",
    "is_native",
    "lint",
    "low_precision_parameters",
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
    # exact at every level: run-time parts (O1/autocast's encoder layer) are measured too
    assert amp.explain(converted, tokens).num_casts == counter.total
    assert amp.explain(converted, tokens=tokens).num_casts == counter.total
    assert "measured on fake tensors" in amp.explain(converted, tokens).assumption
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


def test_the_0_1_gradient_helpers_still_import_with_a_deprecation_warning() -> None:
    import mixprec.training.grads as grads

    with pytest.warns(DeprecationWarning, match="unscale_grads_ is deprecated.*mixprec.unscale_"):
        old = grads.unscale_grads_
    g = [torch.full((2,), 4.0)]
    with pytest.warns(DeprecationWarning, match="inverse_scale is deprecated"):
        inverse = grads.inverse_scale(torch.tensor(4.0))
    assert float(old(g, inverse)) == 0.0
    assert torch.equal(g[0], torch.ones(2))
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        grads.nothing  # noqa: B018


def test_every_deep_path_the_docs_teach_is_public_at_the_top() -> None:
    import mixprec.convert.cast_at_use as cast_at_use
    import mixprec.policy.dtypes as dtypes
    import mixprec.policy.hardware as hardware

    assert amp.low_precision_parameters is cast_at_use.low_precision_parameters
    assert amp.dtype_name is dtypes.dtype_name
    assert amp.is_native is hardware.is_native


def test_reuse_weight_casts_is_a_deprecated_no_op() -> None:
    from mixprec.convert.cast_at_use import reuse_weight_casts

    model = amp.auto_mixed_precision(torch.nn.Linear(4, 4), "O2", "bf16")
    with pytest.warns(DeprecationWarning, match="does nothing"), reuse_weight_casts(model):
        pass
    assert not hasattr(amp, "reuse_weight_casts")
