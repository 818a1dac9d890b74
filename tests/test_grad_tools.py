"""The public gradient tools: ``mixprec.unscale_`` (checked against
``torch.amp.GradScaler.unscale_`` on the same gradients), ``step.grad_norm`` and
``step.metrics()`` (lazy: no host read until a value is read)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import mixprec as amp
from helpers import MLP
from test_sync_budget import count_syncs


def _scaled_grads(seed: int, poison: str | None, scale: float) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(5, 3, generator=g)), nn.Parameter(torch.randn(7))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    if poison is not None:
        params[1].grad[2] = float(poison)
    return params


def _copy(params: list[nn.Parameter]) -> list[nn.Parameter]:
    out = []
    for p in params:
        q = nn.Parameter(p.detach().clone())
        q.grad = None if p.grad is None else p.grad.clone()
        out.append(q)
    return out


@pytest.mark.parametrize("poison", [None, "inf", "-inf", "nan"])
@pytest.mark.parametrize("as_tensor", [False, True])
@pytest.mark.parametrize("through", ["optimizer", "params"])
def test_unscale_matches_gradscaler_and_is_idempotent(
    poison: str | None, as_tensor: bool, through: str
) -> None:
    scale = 3.0 * 2.0**11  # not a power of two: the reciprocal's rounding shows
    ours = _scaled_grads(0, poison, scale)
    theirs = _copy(ours)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    scaler.scale(torch.ones(()))  # creates the scale tensor, as a backward would
    their_opt = torch.optim.SGD(theirs, lr=0.1)
    scaler.unscale_(their_opt)
    expected = bool(sum(v.item() for v in scaler._found_inf_per_device(their_opt).values()))

    our_opt = torch.optim.SGD(ours, lr=0.1)
    target: Any = our_opt if through == "optimizer" else ours
    s: Any = torch.tensor(scale) if as_tensor else scale
    found = amp.unscale_(target, s)
    assert found.dtype == torch.bool
    assert found.dim() == 0
    assert bool(found) == expected == (poison is not None)
    for a, b in zip(ours, theirs, strict=True):
        assert a.grad is not None
        assert b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, equal_nan=True)
    again = amp.unscale_(target, s)  # GradScaler refuses a second call; ours is a no-op
    assert bool(again) == expected
    for a, b in zip(ours, theirs, strict=True):
        assert a.grad is not None
        assert b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, equal_nan=True)


def test_unscale_reads_nothing_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    params = _scaled_grads(1, "inf", 1024.0)
    with count_syncs(monkeypatch) as counter:
        found = amp.unscale_(params, torch.tensor(1024.0))
        amp.unscale_(params, 1024.0)
    assert counter.count == 0
    assert bool(found)


def test_unscale_unscales_new_gradients_and_mixes_flags() -> None:
    w = nn.Parameter(torch.ones(3))
    v = nn.Parameter(torch.ones(2))
    (w.sum() * 8.0).backward()
    assert not amp.unscale_([w], 8.0)
    (v.sum() * 8.0).backward()  # a gradient the first call did not see
    assert w.grad is not None
    assert v.grad is not None
    v.grad[0] = math.inf
    assert amp.unscale_([w, v], 8.0)
    assert torch.equal(w.grad, torch.ones(3))  # not unscaled twice
    w.grad = None
    (w.sum() * 8.0).backward()  # after zero_grad: a new gradient, unscaled again
    assert not amp.unscale_([w], 8.0)
    assert torch.equal(w.grad, torch.ones(3))
    w.grad.mul_(4.0)  # written since: unscaled again
    amp.unscale_([w], 4.0)
    assert torch.equal(w.grad, torch.ones(3))


def test_unscale_handles_sparse_and_missing_gradients() -> None:
    emb = nn.Embedding(4, 2, sparse=True)
    (emb(torch.tensor([1, 2])).sum() * 16.0).backward()
    unused = nn.Parameter(torch.ones(2))
    assert not amp.unscale_([emb.weight, unused], 16.0)
    assert emb.weight.grad is not None
    assert torch.equal(emb.weight.grad.to_dense()[1], torch.ones(2))
    assert not amp.unscale_([], 2.0)
    assert amp.unscale_([], 2.0).dtype == torch.bool


@pytest.mark.parametrize(
    ("target", "scale", "error", "match"),
    [
        (3, 1.0, TypeError, "optimizer_or_params"),
        ([1.0], 1.0, TypeError, "optimizer_or_params"),
        ([], 0.0, ValueError, "scale"),
        ([], math.inf, ValueError, "scale"),
        ([], "2", TypeError, "scale"),
        ([], torch.ones(2), TypeError, "scale"),
        ([], True, TypeError, "scale"),
    ],
)
def test_unscale_refuses_bad_input(target: Any, scale: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        amp.unscale_(target, scale)


def _step(**kwargs: Any) -> tuple[amp.TrainStep, nn.Module]:
    torch.manual_seed(0)
    model = MLP()
    step = amp.build_train_network(
        model, torch.optim.SGD(model.parameters(), lr=0.01), nn.CrossEntropyLoss(), **kwargs
    )
    return step, model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 16, generator=g), torch.randint(0, 8, (8,), generator=g)


@pytest.mark.parametrize("clip", [None, 1e-3])
def test_grad_norm_is_the_unscaled_norm_before_clipping(clip: float | None) -> None:
    seen: list[float] = []

    def after_unscale(step: amp.TrainStep, params: list[torch.Tensor]) -> None:
        # the step already unscaled these: a second unscale_ leaves them alone
        assert not amp.unscale_(params, 1024.0)
        seen.append(float(torch.nn.utils.get_total_norm([p.grad for p in params])))

    step, _ = _step(
        level="O2",
        dtype="float16",
        loss_scale_manager=amp.FixedLossScaleManager(1024.0),
        after_unscale=after_unscale,
        clip_grad_norm=clip,
    )
    assert math.isnan(step.grad_norm)
    x, y = _batch()
    step(x, y)
    assert step.grad_norm == pytest.approx(seen[0], rel=1e-6)
    assert seen[0] > 1e-2  # so clipping bites when clip is set


def test_grad_norm_keeps_the_last_applied_step_through_a_skip() -> None:
    step, _model = _step(level="O0")
    x, y = _batch()
    step(x, y)
    norm = step.grad_norm
    assert math.isfinite(norm)
    assert norm > 0
    bad = x.clone()
    bad[0, 0] = math.nan
    step(bad, y)
    assert step.overflow
    assert step.grad_norm == norm


def test_metrics_read_nothing_until_read(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = MLP()
    step = amp.build_train_network(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01, fused=True),
        nn.CrossEntropyLoss(),
        level="O2",
        dtype="float16",
    )
    x, y = _batch()
    step(x, y)
    with count_syncs(monkeypatch) as counter:
        step(x, y)
        metrics = step.metrics()
        assert list(metrics) == list(amp.StepMetrics.KEYS)
        assert counter.count == 0
        assert metrics["grad_norm"] > 0
        assert counter.count == 1
    values = dict(metrics)
    assert values["loss_scale"] == step.loss_scale
    assert values["skipped_steps"] == 0
    assert values["consecutive_overflows"] == 0
    assert values["overflow_module"] is None
    with pytest.raises(KeyError, match="grad_norm"):
        metrics["gradnorm"]


def test_metrics_name_the_overflowing_module_when_debugging() -> None:
    step, _model = _step(level="O0", debug_overflow=True)
    x, y = _batch()
    bad = x.clone()
    bad[0, 0] = math.inf
    step(bad, y)
    assert step.overflow
    assert step.metrics()["overflow_module"] == "(inputs)"


class _Lookup(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(3, 4, sparse=sparse)

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        return (self.emb(i) * torch.arange(4.0)).sum()  # returns its loss


def test_a_sparse_gradient_with_repeated_indices_counts_as_its_dense_gradient() -> None:
    """``nn.Embedding(sparse=True)``'s gradient holds one row per lookup, uncoalesced: the
    norm (and clipping by it) is that of the summed rows, as for the dense gradient."""
    idx = torch.tensor([0, 0, 0, 2])
    runs = {}
    for sparse in (True, False):
        net = _Lookup(sparse)
        opt = torch.optim.SGD(net.parameters(), lr=1.0)
        step = amp.build_train_network(net, opt, None, "O0", clip_grad_norm=1.0)
        step(idx)
        runs[sparse] = step.grad_norm, net.emb.weight.detach().clone()
    # the dense gradient: row 0 holds 3 * arange(4), row 2 arange(4): norm sqrt(10 * 14)
    assert runs[False][0] == pytest.approx(math.sqrt(140), rel=1e-6)
    assert runs[True][0] == pytest.approx(runs[False][0], rel=1e-6)
    torch.testing.assert_close(runs[True][1], runs[False][1], rtol=0, atol=1e-6)
    g = torch.sparse_coo_tensor(torch.tensor([[1, 1]]), torch.tensor([[3.0], [4.0]]), (2, 1))
    assert float(amp.training.grads.total_norm([g])) == pytest.approx(7.0)
