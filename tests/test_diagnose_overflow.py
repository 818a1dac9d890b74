"""find_overflow and the skipped-step probe: planted non-finite values, found and fixed."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from helpers import MLP
from mixprec.cli import planted
from mixprec.cli.planted import DivZero, LogNeg
from mixprec.diagnose import FixKind, OverflowDebugger, probe_skipped_step


class Dropper(nn.Module):
    """BatchNorm and dropout: state a probe must not disturb."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn, self.drop, self.out = (
            nn.Linear(4, 6),
            nn.BatchNorm1d(6),
            nn.Dropout(0.5),
            nn.Linear(6, 2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(self.bn(self.fc(x))))


def tiny_bert() -> nn.Module:
    pytest.importorskip("transformers")
    return planted.tiny_bert()


X = torch.linspace(-2, 2, 12).reshape(3, 4)


def test_inf_from_a_zero_buffer_is_the_models_own_code() -> None:
    torch.manual_seed(0)
    report = mixprec.find_overflow(DivZero(), X, level="O2", dtype="fp16")
    assert report.found
    assert report.forward is not None
    assert report.forward.module == ""  # made by DivZero.forward itself, between fc1 and fc2
    assert report.forward.seen_at == "input of fc2"
    assert report.forward.kind == "inf"
    assert report.fix.kind is FixKind.NOT_PRECISION
    assert report.fix.verified
    assert "fc1.weight" in report.nonfinite_params


def test_nan_from_log_of_a_negative_names_the_module() -> None:
    torch.manual_seed(0)
    report = mixprec.find_overflow(LogNeg(), X, level="O2", dtype="bf16")
    assert report.forward is not None
    assert (report.forward.module, report.forward.module_type) == ("act", "Log")
    assert report.forward.kind == "nan"
    assert report.forward.dtype == "bfloat16"
    assert report.fix.kind is FixKind.NOT_PRECISION
    assert report.module == "act"
    data = report.to_dict()
    assert data["loss"] == "nan"  # strict JSON: no NaN literal
    assert json.loads(json.dumps(data, allow_nan=False))["forward"]["kind"] == "nan"


def test_clean_model_reports_nothing() -> None:
    torch.manual_seed(0)
    report = mixprec.find_overflow(MLP(), torch.randn(3, 16), level="O2", dtype="fp16")
    assert not report.found
    assert report.forward is None
    assert report.backward is None
    assert report.nonfinite_params == ()
    assert report.fix.kind is FixKind.NONE
    assert str(report).endswith("every module output, gradient and the loss are finite")
    assert json.loads(json.dumps(report.to_dict()))["found"] is False


def test_fp16_overflow_in_the_middle_of_a_transformers_model() -> None:
    model = tiny_bert()
    with torch.no_grad():  # one output channel of one layer grows past float16's 65504
        model.encoder.layer[0].intermediate.dense.weight[5].mul_(1e6)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(model(ids).last_hidden_state).all()  # fine in float32

    report = mixprec.find_overflow(model, ids, level="O2", dtype="fp16")
    culprit = report.forward
    assert culprit is not None
    assert culprit.module == "encoder.layer.0.intermediate.dense"
    assert (culprit.kind, culprit.dtype, culprit.limit) == ("inf", "float16", 65504.0)
    assert 0 < culprit.largest_before < culprit.limit
    assert report.fix.kind is FixKind.FP32_MODULE
    assert report.fix.verified
    assert report.fix.module is not None
    assert "encoder.layer.0.intermediate.dense".startswith(report.fix.module)
    assert f"fp32_modules=[{report.fix.module!r}]" in report.fix.text

    fixed = mixprec.auto_mixed_precision(model, "O2", "fp16", fp32_modules=[report.fix.module])
    assert not mixprec.find_overflow(fixed, ids).found  # a converted network runs as it is
    # the same model in bfloat16 has the range
    assert not mixprec.find_overflow(model, ids, level="O2", dtype="bf16").found


def test_backward_only_overflow_names_the_largest_finite_loss_scale() -> None:
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(3, 16)
    report = mixprec.find_overflow(model, x, level="O2", dtype="fp16", loss_scale=2.0**24)
    assert report.forward is None
    assert report.backward is not None
    assert report.fix.kind is FixKind.LOWER_LOSS_SCALE
    assert report.scale_backoff
    scale = report.fix.loss_scale
    assert scale is not None
    assert scale < 2.0**24
    finite = mixprec.find_overflow(model, x, level="O2", dtype="fp16", loss_scale=scale)
    above = mixprec.find_overflow(model, x, level="O2", dtype="fp16", loss_scale=2 * scale)
    assert not finite.found
    assert above.found


def test_loss_fn_and_target_are_used() -> None:
    torch.manual_seed(0)
    seen = []

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        seen.append((output.dtype, target.dtype))
        return F.mse_loss(output, target)

    target = torch.zeros(3, 8, dtype=torch.float16)
    report = mixprec.find_overflow(MLP(), torch.randn(3, 16), loss_fn=loss_fn, target=target)
    assert seen == [(torch.float32, torch.float32)]
    assert report.loss is not None
    assert report.loss > 0


def test_leaves_no_trace_rng_buffers_grads_hooks() -> None:
    torch.manual_seed(0)
    model = Dropper().train()
    model(torch.randn(8, 4)).sum().backward()  # gradients the probe must not touch
    grads = {n: (p.grad, p.grad.clone()) for n, p in model.named_parameters()}
    x = torch.randn(8, 4) * 1e6
    stats = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()
    hooks = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]

    report = mixprec.find_overflow(model, x, level="O2", dtype="fp16")
    assert report.found  # it ran something worth restoring

    assert torch.equal(torch.get_rng_state(), rng)
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, stats[name]), name
    for name, param in model.named_parameters():
        assert param.grad is grads[name][0], name
        assert torch.equal(param.grad, grads[name][1]), name
    assert [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()] == hooks


def test_probes_are_removed_when_the_model_raises() -> None:
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    model = mixprec.auto_mixed_precision(Broken(), "O2", "bf16")
    before = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    with pytest.raises(RuntimeError, match="boom"):
        mixprec.find_overflow(model, X)
    assert [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()] == before


def test_skipped_step_probe_keeps_the_step_outcome() -> None:
    torch.manual_seed(0)
    model = Dropper().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = mixprec.build_train_network(model, optimizer, nn.MSELoss(), level="O2", dtype="fp16")
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    net = step.network
    net(x).sum().backward()
    grads = {n: (p.grad, p.grad.clone()) for n, p in net.named_parameters()}
    stats = {n: b.clone() for n, b in net.named_buffers()}
    rng = torch.get_rng_state()

    report = probe_skipped_step(net, (x,), {}, nn.MSELoss(), y, loss_scale=2.0**24)
    assert (report.level, report.dtype, report.loss_scale) == ("O2", "float16", 2.0**24)
    assert report.scale_backoff
    assert report.fix.verified
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(b, stats[n]) for n, b in net.named_buffers())
    for name, param in net.named_parameters():
        assert param.grad is grads[name][0], name
        assert torch.equal(param.grad, grads[name][1]), name


def test_debugger_summarises_backoffs_and_warns_on_real_overflows() -> None:
    torch.manual_seed(0)
    net = mixprec.auto_mixed_precision(MLP(), "O2", "fp16")
    debugger = OverflowDebugger()
    x, y = torch.randn(3, 16), torch.randn(3, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        debugger.after_skip(net, (x,), {}, nn.MSELoss(), y, loss_scale=2.0**24)
        debugger.after_skip(net, (x,), {}, nn.MSELoss(), y, loss_scale=2.0**23)
    assert len(caught) == 1
    assert "counted, not reported one by one" in str(caught[0].message)
    assert (debugger.skips, debugger.backoffs) == (2, 2)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = debugger.after_skip(net, (x * 1e6,), {}, nn.MSELoss(), y, loss_scale=1.0)
    assert debugger.last_report is report
    assert report.module is not None
    assert len(caught) == 1
    assert f"at {report.module}" in str(caught[0].message)
    assert debugger.summary().startswith("3 skipped steps probed: 2 loss-scale back-offs")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"loss_scale": 0.5}, ValueError, "loss_scale must be a finite number from 1 .* got 0.5"),
        ({"loss_scale": math.inf}, ValueError, "float32's largest value 3.403e\\+38; got inf"),
        ({"loss_scale": 1e39}, ValueError, "float32's largest value .*; got 1e\\+39"),
        ({"loss_scale": math.nan}, ValueError, "loss_scale must be a finite number .* got nan"),
        ({"level": "O5"}, ValueError, "level must be one of"),
        ({"dtype": "fp8"}, ValueError, "dtype must be one of .* got 'fp8'"),
        ({"loss_fn": 3}, TypeError, "loss_fn must be callable or None; got 3"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        mixprec.find_overflow(MLP(), torch.randn(2, 16), **kwargs)


def test_not_a_module() -> None:
    with pytest.raises(TypeError, match="network must be a torch.nn.Module; got str"):
        mixprec.find_overflow("model", X)


def test_debug_overflow_reports_a_skipped_step_without_changing_training() -> None:
    """``build_train_network(debug_overflow=True)``: the skipped step's report names the
    module, the warning points at the caller, and the weights end as without debugging."""

    def run(debug: bool) -> tuple[mixprec.TrainStep, list[torch.Tensor], list[str]]:
        torch.manual_seed(0)
        model = MLP()
        step = mixprec.build_train_network(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            nn.MSELoss(),
            level="O2",
            dtype="bf16",
            debug_overflow=debug,
        )
        x, y = torch.randn(3, 16), torch.randn(3, 8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(x, y)
            step(torch.full((3, 16), 3e38), y)  # the first layer's output overflows bf16
            step(x, y)
        lines = [f"{w.filename}: {w.message}" for w in caught if "debug_overflow" in str(w.message)]
        return step, [p.detach().clone() for p in model.parameters()], lines

    plain, plain_weights, _ = run(debug=False)
    step, weights, lines = run(debug=True)
    assert plain.skipped_steps == step.skipped_steps == 1
    assert plain.last_overflow_report is None
    report = step.last_overflow_report
    assert report is not None
    assert report.module == "net.0"
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights, strict=True))
    assert len(lines) == 1
    assert lines[0].startswith(f"{__file__}: mixprec debug_overflow: step skipped:")
    assert "net.0" in lines[0]
