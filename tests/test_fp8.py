"""fp8: recipes, emulated casts and their statistics, the module swap, every level."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import mixprec
from mixprec.diagnose import FindingKind
from mixprec.fp8 import (
    Fp8Config,
    Fp8Linear,
    Fp8Recipe,
    Gemm,
    apply_fp8,
    default_fp8_filter,
    fp8_report,
    fp8_stats,
)
from mixprec.fp8.scaling import cast_stats, quantize, round_to_fp8, scale_of
from mixprec.fp8.swap import native_fp8_missing

RECIPES = [r.value for r in Fp8Recipe]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.LayerNorm(32),
        nn.Linear(32, 48),
        nn.ReLU(),
        nn.Linear(48, 4),
    )


def fp8_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, Fp8Linear)]


# --- recipes ------------------------------------------------------------------------------


def test_recipe_parse_and_error() -> None:
    assert Fp8Recipe.parse(" RowWise ") is Fp8Recipe.ROWWISE
    with pytest.raises(ValueError, match=r"fp8 must be one of 'tensorwise', 'rowwise'.*'rowise'"):
        Fp8Recipe.parse("rowise")
    with pytest.raises(ValueError, match=r"fp8 must be one of"):
        Fp8Recipe.parse(8)


def test_recipes_cast_every_operand_as_torchao_does() -> None:
    tw = Fp8Config.from_recipe("tensorwise")
    assert tw.grad_output.dtype == E5M2
    assert tw.input.dtype == E4M3
    assert not tw.pow2_scales
    row = Fp8Config.from_recipe("rowwise")
    assert all(s.rowwise and s.dtype == E4M3 for g in Gemm for s in row.operands(g))
    hp = Fp8Config.from_recipe("rowwise_with_gw_hp")
    assert [s.short() for s in hp.operands(Gemm.GRAD_WEIGHT)] == ["hp", "hp"]
    assert hp.weight_for_grad_input.short() == "e4m3/tensor"
    assert "grad_weight=hpxhp" in hp.describe()


# --- casts and statistics in closed form ----------------------------------------------------


def test_cast_stats_count_saturated_and_flushed_values() -> None:
    # e4m3: largest 448; smallest subnormal 2**-9, so |v| < 2**-10 becomes 0 (2**-10 ties to 0)
    # 450 and 464 round to 448 (464 ties to even): no clipping; 465 would round to 480: clipped
    x = torch.tensor(
        [500.0, -1000.0, 448.0, 2.0**-11, -(2.0**-12), 2.0**-10, 2.0**-9, 0.0, 1.0, 450.0, 464.0]
    )
    stats = cast_stats(x, torch.tensor(1.0), E4M3)
    assert int(stats.saturated) == 2  # 500 and -1000
    assert int(stats.flushed) == 3  # 2**-11, -2**-12 and 2**-10; the zero is not counted
    assert float(stats.amax) == 1000.0
    assert stats.numel == 11
    assert int(cast_stats(torch.tensor([465.0]), torch.tensor(1.0), E4M3).saturated) == 1
    # e5m2 (largest 57344, smallest 2**-16) with a scale of 2: 2**-18 * 2 flushes, 4e4 * 2
    # saturates, 3e4 * 2 rounds to 57344
    y = torch.tensor([4e4, 2.0**-18, 1.0, 3e4])
    s5 = cast_stats(y, torch.tensor(2.0), E5M2)
    assert (int(s5.saturated), int(s5.flushed)) == (1, 1)


def test_dynamic_scale_and_quantize_match_the_closed_form() -> None:
    x = torch.tensor([[1024.0, 1e-3, 1.0], [1.0, 1e-3, 0.5]])
    # tensorwise: one scale 448 / 1024; 1e-3 * 0.4375 < 2**-10 flushes in both rows
    dq, scale = quantize(x, E4M3, None, pow2=False)
    assert float(scale) == pytest.approx(448 / 1024)
    assert dq[:, 1].tolist() == [0.0, 0.0]
    assert int(cast_stats(x, scale, E4M3).flushed) == 2
    # rowwise, power of two: the second row gets 2**floor(log2(448)) = 256 and keeps 1e-3
    dq_row, scales = quantize(x, E4M3, -1, pow2=True)
    assert scales.flatten().tolist() == [0.25, 256.0]
    assert dq_row[1, 1] != 0
    assert int(cast_stats(x, scales, E4M3).flushed) == 1
    assert float(scale_of(torch.tensor(0.0), E4M3, False)) == pytest.approx(448e12)


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_rounding_in_float32_is_the_cast(dtype: torch.dtype) -> None:
    # every fp8 value, the midpoints between neighbours (ties go to even) and the floats
    # just beside them, and random floats up to the largest fp8 value, both signs
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = grid[grid.isfinite() & (grid >= 0)].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    near = [mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9)), grid]
    top = int(torch.tensor(torch.finfo(dtype).max).view(torch.int32))
    bits = torch.randint(0, top + 1, (100_000,), generator=torch.Generator().manual_seed(0))
    v = torch.cat([*near, bits.to(torch.int32).view(torch.float32)])
    v = torch.cat([v, -v])
    want = v.to(dtype).float()
    got = v.clone()
    round_to_fp8(got, dtype)
    assert torch.equal(got, want)


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "columns"])
def test_quantize_keeps_the_layout_and_is_the_cast(transposed: bool) -> None:
    torch.manual_seed(3)
    x = torch.randn(200, 96) * torch.randn(200, 1).exp() * 4
    x = x.t() if transposed else x
    for dtype, dim, pow2 in ((E4M3, None, False), (E5M2, 0, True), (E4M3, -1, True)):
        dq, scale = quantize(x, dtype, dim, pow2)
        assert dq.stride() == x.stride()
        assert torch.equal(dq, (x * scale).to(dtype).float() / scale)
        bf16 = x.bfloat16()
        dq16, scale16 = quantize(bf16, dtype, dim, pow2)
        assert torch.equal(dq16, (bf16.float() * scale16).to(dtype).float() / scale16)


# --- bit-identical to torchao -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_emulated_is_bit_identical_to_torchao_emulate(recipe: str, dtype: torch.dtype) -> None:
    float8 = pytest.importorskip("torchao.float8", reason="torchao is not installed")
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(1)
    linear = nn.Linear(32, 48).to(dtype)
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    config = type(config)(**{**config.__dict__, "emulate": True})
    ref = Float8Linear.from_float(copy.deepcopy(linear), config=config)
    mine = Fp8Linear.from_linear(copy.deepcopy(linear), Fp8Config.from_recipe(recipe), "l")
    x_ref = (torch.randn(4, 5, 32) * 3).to(dtype).requires_grad_()
    x_mine = x_ref.detach().clone().requires_grad_()
    y_ref, y_mine = ref(x_ref), mine(x_mine)
    grad = torch.randn_like(y_ref)
    y_ref.backward(grad)
    y_mine.backward(grad)
    assert y_mine.dtype == dtype
    assert torch.equal(y_ref, y_mine)
    assert torch.equal(x_ref.grad, x_mine.grad)
    assert torch.equal(ref.weight.grad, mine.weight.grad)
    assert torch.equal(ref.bias.grad, mine.bias.grad)


# --- the swap -----------------------------------------------------------------------------


def test_default_filter_skips_first_last_and_odd_dims() -> None:
    model = nn.Sequential(
        nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 24), nn.Linear(24, 32), nn.Linear(32, 8)
    )
    choose = default_fp8_filter(model)
    assert [n for n, m in model.named_modules() if choose(m, n)] == ["1"]


def test_swap_shares_parameters_and_leaves_the_original() -> None:
    model = mlp()
    fp8 = apply_fp8(model, "tensorwise", emulate=True)
    assert fp8_names(fp8) == ["2", "4"]
    assert fp8_names(model) == []
    assert fp8[2].weight is model[2].weight
    assert fp8[4].bias is model[4].bias
    assert "fp8=tensorwise" in repr(fp8[2])
    assert apply_fp8(model, None) is model


def test_filter_and_pins() -> None:
    model = mlp()
    everything = apply_fp8(model, "rowwise", filter=lambda m, n: True, emulate=True)
    assert fp8_names(everything) == ["0", "2", "4", "6"]
    net = mixprec.auto_mixed_precision(
        model, "O2", "bf16", fp8="rowwise", fp8_filter=lambda m, n: True, fp32_modules=["4"]
    )
    assert fp8_names(net) == ["0", "2", "6"]


def test_bad_arguments_name_the_value() -> None:
    with pytest.raises(TypeError, match=r"filter must be a function.*'yes'"):
        apply_fp8(mlp(), "rowwise", filter="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"emulate must be True, False or None; got 1"):
        apply_fp8(mlp(), "rowwise", emulate=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"fp8 must be one of .*'fp4'"):
        mixprec.auto_mixed_precision(mlp(), "O2", fp8="fp4")


def test_native_without_an_fp8_gpu_says_what_is_missing() -> None:
    assert "CUDA GPU with fp8" in (native_fp8_missing(torch.device("cpu")) or "")
    with pytest.raises(ValueError, match=r"native fp8 needs a CUDA GPU.*on cpu.*emulate=True"):
        apply_fp8(mlp(), "tensorwise", emulate=False)


def test_explain_names_the_fp8_layers() -> None:
    net = mixprec.auto_mixed_precision(mlp(), "O2", "bf16", fp8="rowwise")
    ops = {row.path: row.op for row in mixprec.explain(net).rows}
    assert ops["2"] == "Fp8Linear [fp8 rowwise]"
    assert ops["0"] == "Linear"


# --- statistics and the report ------------------------------------------------------------


def test_stats_cover_three_gemms_and_restore_the_layers() -> None:
    net = apply_fp8(mlp(), "tensorwise", emulate=True)
    with fp8_stats(net) as stats:
        net(torch.randn(8, 16)).sum().backward()
    keys = {(r.layer, r.gemm, r.operand) for r in stats.rows()}
    assert len(keys) == 12  # 2 layers x 3 GEMMs x 2 operands
    assert all(m._fp8_recorder is None for m in net.modules() if isinstance(m, Fp8Linear))
    metrics = stats.metrics()
    assert metrics["fp8/2/grad_weight/grad_output/saturated"] == 0.0
    assert "flushed" in stats.table()
    with pytest.raises(ValueError, match="no"):
        fp8_stats(mlp()).__enter__()


def outlier_model() -> nn.Sequential:
    model = mlp()
    with torch.no_grad():
        model[2].weight[0] = 1e5  # one output channel dominates a tensorwise weight amax
    return model


def test_an_outlier_channel_fails_tensorwise_and_passes_rowwise() -> None:
    x = torch.randn(16, 16)
    tensorwise = fp8_report(outlier_model(), x, recipe="tensorwise")
    rowwise = fp8_report(outlier_model(), x, recipe="rowwise")
    assert [row.layer for row in tensorwise.hurt] == ["2"]
    worst = tensorwise.hurt[0]
    assert (worst.gemm, worst.operand) == (Gemm.OUTPUT, "weight")
    assert worst.flushed > 0.9
    assert "keep '2' in bf16" in str(tensorwise)
    # rowwise keeps the forward: each output channel has its own weight scale ...
    out_weight = {(r.gemm, r.operand): r for r in rowwise.stats.rows() if r.layer == "2"}
    assert out_weight[Gemm.OUTPUT, "weight"].flushed == 0.0
    # ... but grad_input reads the weight along the other axis, where the outlier is in
    # every row: the statistics show it, and the report names that GEMM
    assert [(r.layer, r.gemm) for r in rowwise.hurt] == [("2", Gemm.GRAD_INPUT)]
    # and the numbers agree: the other channels of layer 2 are lost tensorwise, kept rowwise
    model = outlier_model()
    with torch.no_grad():
        want = model[:3](x)[:, 1:]
        for recipe, bound in (("tensorwise", None), ("rowwise", 0.1)):
            got = apply_fp8(model, recipe, emulate=True)[:3](x)[:, 1:]
            error = float((got - want).norm() / want.norm())
            assert error < bound if bound else error > 0.5
    assert model[2].weight.grad is None  # the report left gradients alone


class ChannelOutlier(nn.Module):
    """Multiplies feature 0 by 1e6: an outlier activation channel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gain = torch.ones(x.shape[-1], dtype=x.dtype)
        gain[0] = 1e6
        return x * gain


def activation_outlier_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32),
        ChannelOutlier(),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.Linear(32, 4),
    )


def test_lint_names_the_fp8_layers_whose_weights_suffer() -> None:
    model = outlier_model()
    report = mixprec.lint(model, level="O2", dtype="bf16", fp8="tensorwise")
    assert [(f.kind, f.place) for f in report] == [(FindingKind.FP8, "2 (Linear) weight")]
    finding = report.findings[0]
    assert "the output GEMM's cast of the weight flushes 96.9% of its values" in finding.problem
    assert "fp8_filter=lambda module, name: name != '2'" in finding.fix
    assert "fp32_modules=['2']" in finding.fix
    assert "'rowwise' recipe" in finding.fix
    # rowwise: the forward's per-channel scales are fine, grad_input reads the other axis
    rowwise = mixprec.lint(model, level="O0", fp8="rowwise")
    assert [f.problem.split(" the ")[1] for f in rowwise] == ["grad_input GEMM's cast of"]
    # the fixes it names silence it; no fp8, or a clean model, finds nothing
    keep_out = mixprec.lint(model, fp8="tensorwise", fp8_filter=lambda m, n: n == "4")
    assert len(keep_out) == 0
    assert len(mixprec.lint(model, dtype="bf16", fp8="tensorwise", fp32_modules=["2"])) == 0
    assert len(mixprec.lint(model, dtype="bf16")) == 0
    assert len(mixprec.lint(mlp(), dtype="bf16", fp8="tensorwise")) == 0
    with pytest.raises(ValueError, match=r"fp8 must be one of .*'int8'"):
        mixprec.lint(model, fp8="int8")
    with pytest.raises(TypeError, match=r"fp8_filter must be a function.*'2'"):
        mixprec.lint(model, fp8="rowwise", fp8_filter="2")  # type: ignore[arg-type]


def test_lint_at_conversion_warns_about_fp8_weights() -> None:
    with pytest.warns(UserWarning, match=r"mixprec lint: \[fp8 cast\] 2 \(Linear\) weight"):
        mixprec.auto_mixed_precision(outlier_model(), "O0", fp8="tensorwise", lint=True)


def test_find_overflow_with_fp8_names_an_activation_outlier() -> None:
    # the weights are clean (lint finds nothing); the input of layer 2 has an outlier channel
    model = activation_outlier_model()
    assert len(mixprec.lint(model, fp8="tensorwise")) == 0
    x = torch.randn(16, 16)
    report = mixprec.find_overflow(model, x, level="O0", fp8="tensorwise")
    assert not report.found  # finite: fp8 harm is not overflow
    assert report.fp8 is not None
    assert report.fp8.layers == ("2",)
    worst = report.fp8.hurt[0]
    assert (worst.gemm, worst.operand) == (Gemm.OUTPUT, "input")
    assert worst.flushed > 0.5
    text = str(report)
    assert "fp8 (tensorwise): 1 layer(s) hurt beyond 1.0%" in text
    assert "fp8 fix: keep '2' in bf16: fp8_filter=lambda module, name: name not in {'2'}" in text
    data = json.loads(json.dumps(report.to_dict()))
    assert data["fp8"]["hurt"][0]["layer"] == "2"
    assert data["fp8"]["recipe"] == "tensorwise"
    # rowwise scales each token, and the channel is in every token: still hurt
    assert mixprec.find_overflow(model, x, level="O0", fp8="rowwise").fp8.layers == ("2",)
    # a model with fp8 layers is read as it is; without fp8 there is no fp8 part
    net = mixprec.auto_mixed_precision(model, "O0", fp8="tensorwise")
    assert mixprec.find_overflow(net, x, level="O0").fp8.layers == ("2",)
    converted = mixprec.auto_mixed_precision(model, "O2", "bf16", fp8="tensorwise", emulate=True)
    assert mixprec.find_overflow(converted, x).fp8.layers == ("2",)
    assert mixprec.find_overflow(model, x, level="O0").fp8 is None
    assert (
        mixprec.find_overflow(
            model, x, level="O0", fp8_filter=lambda m, n: n == "4", fp8="tensorwise"
        ).fp8.layers
        == ()
    )


# --- every level trains with fp8 ------------------------------------------------------------


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3", "autocast"])
def test_every_level_trains_with_fp8(level: str) -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = mixprec.build_train_network(
        model, optimizer, nn.MSELoss(), level, dtype="bf16", emulate=True, fp8="rowwise"
    )
    assert fp8_names(step.network) == ["2", "4"]
    torch.manual_seed(2)
    x = torch.randn(64, 16)
    y = x[:, :4].sin()
    losses = [float(step(x, y)) for _ in range(25)]
    assert losses[-1] < 0.7 * losses[0]
    with fp8_stats(step) as stats:
        step(x, y)
    assert {r.layer for r in stats.rows()} == {"2", "4"}
