"""calibrate: the one sensitive layer pinned, the tolerance met, on a transformers model too."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mixprec
from helpers import rel_error
from mixprec.cli.planted import sensitive_model
from mixprec.diagnose.calibrate import relative_error


def test_pins_exactly_the_sensitive_layer_and_meets_the_tolerance() -> None:
    model = sensitive_model()
    x, held = torch.randn(4, 8), torch.randn(4, 8)
    net, report = mixprec.calibrate(model, x, dtype="fp16", tolerance=1e-2, holdout=[held])
    assert report.pins == ("2",)
    assert report.low_pins == ()
    assert report.met
    assert report.error_after <= 1e-2 < report.error_before
    assert report.modules[0].path == "2"
    assert report.modules[0].pinned
    assert [m.path for m in report.modules if m.pinned] == ["2"]

    with torch.no_grad():  # measured here, independently of the report
        assert rel_error(net(x), model(x)) == pytest.approx(report.error_after, rel=1e-6)
        assert rel_error(net(held), model(held)) <= 1e-2
        plain = mixprec.auto_mixed_precision(model, "O2", "fp16")
        assert rel_error(plain(x), model(x)) > 1e-2
    assert report.holdout_error is not None
    assert report.holdout_error <= 1e-2
    rows = {(r.path, r.dtype, r.note) for r in mixprec.explain(net).rows}
    assert ("2", "float32", "island") in rows
    assert ("3", "float16", "weights") in rows
    assert net(x).dtype == torch.float32


def test_a_container_and_its_child_become_one_pin() -> None:
    class Wrapped(nn.Module):  # the large offset is added in the container's own code
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x + 3000.0) - 3000.0 * self.fc.weight.sum(1)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), Wrapped(), nn.Linear(16, 4))
    _, report = mixprec.calibrate(model, torch.randn(4, 8), dtype="fp16", tolerance=1e-2)
    assert report.pins == ("1",)
    assert report.met
    assert {m.path for m in report.modules if m.pinned} == {"1", "1.fc"}


def test_unreachable_tolerance_warns_and_returns_the_best() -> None:
    model = sensitive_model()
    with pytest.warns(UserWarning, match="no set of float32 pins meets tolerance 1e-09"):
        net, report = mixprec.calibrate(model, torch.randn(4, 8), dtype="bf16", tolerance=1e-9)
    assert not report.met
    assert report.error_after < report.error_before
    assert report.error_after > 1e-9
    assert "NOT met" in str(report)
    assert isinstance(mixprec.explain(net), mixprec.CastPlan)


def test_custom_metric_and_batches() -> None:
    calls = []

    def max_abs(output: torch.Tensor, reference: torch.Tensor) -> float:
        calls.append(output.shape)
        return float((output - reference).abs().max())

    model = sensitive_model()
    batches = [torch.randn(2, 8), (torch.randn(3, 8),)]
    _, report = mixprec.calibrate(
        model, dtype="fp16", tolerance=0.05, batches=batches, metric=max_abs
    )
    assert report.met
    assert report.pins == ("2",)
    assert {tuple(s) for s in calls} == {(2, 4), (3, 4)}


def test_no_trace_and_modes_restored() -> None:
    model = sensitive_model().train()
    stats = [p.clone() for p in model.parameters()]
    mixprec.calibrate(model, torch.randn(4, 8), dtype="bf16", tolerance=0.5)
    assert all(m.training for m in model.modules())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), stats, strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_transformers_model_meets_its_tolerance() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids, held = (
        torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(s)) for s in (1, 2)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net, report = mixprec.calibrate(model, ids, dtype="bf16", tolerance=3e-3, holdout=[held])
    assert report.met
    assert report.error_after <= 3e-3
    with torch.no_grad():
        assert relative_error(net(ids), model(ids)) == pytest.approx(report.error_after, rel=1e-6)


def test_relative_error() -> None:
    assert relative_error(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.0])) == 0.0
    assert relative_error(torch.tensor([3.0, 5.0]), torch.tensor([3.0, 4.0])) == pytest.approx(0.2)
    assert relative_error(torch.tensor([float("inf")]), torch.tensor([1.0])) == float("inf")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"level": "O1"}, ValueError, "level must be 'O2' or 'O3' for calibrate; got 'O1'"),
        ({"tolerance": 0}, ValueError, "tolerance must be a positive number; got 0"),
        ({"metric": "l2"}, TypeError, "metric must be callable .* got 'l2'"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        mixprec.calibrate(sensitive_model(), torch.randn(2, 8), **kwargs)


def test_needs_a_batch() -> None:
    with pytest.raises(ValueError, match="calibrate needs at least one batch"):
        mixprec.calibrate(sensitive_model())


def test_a_metric_returning_a_negative_error_is_refused() -> None:
    def signed(output: torch.Tensor, reference: torch.Tensor) -> float:
        return float((output - reference).sum()) - 1.0  # below 0: "better than exact"

    model = sensitive_model().train()
    with pytest.raises(ValueError, match=r"metric must return an error >= 0 .* returned -"):
        mixprec.calibrate(model, torch.randn(2, 8), dtype="bf16", metric=signed)
    assert all(m.training for m in model.modules())  # left as it was
