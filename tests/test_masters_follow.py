"""Master weights follow the user's writes: requires_grad changes after the build, and
``step.network.state_dict()`` holds the float32 masters (O2 and O3, bf16 and fp16)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec as amp

CASES = [("O2", "bfloat16"), ("O2", "float16"), ("O3", "bfloat16"), ("O3", "float16")]


def _build(level: str, dtype: str) -> tuple[amp.TrainStep, nn.Sequential]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))
    step = amp.build_train_network(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        nn.CrossEntropyLoss(),
        level=level,
        dtype=dtype,
        loss_scale_manager=None,
    )
    return step, model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


@pytest.mark.parametrize(("level", "dtype"), CASES)
@pytest.mark.parametrize("through", ["model", "network"])
def test_freezing_and_unfreezing_after_build_are_followed(
    level: str, dtype: str, through: str
) -> None:
    step, model = _build(level, dtype)
    layer = model[0] if through == "model" else step.network[0]
    layer.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    trained = model[2].weight.detach().clone()
    step(*_batch())
    assert torch.equal(model[0].weight, frozen)
    assert not torch.equal(model[2].weight, trained)
    layer.requires_grad_(True)  # unfrozen later: it trains again
    step(*_batch())
    assert not torch.equal(model[0].weight, frozen)


@pytest.mark.parametrize(("level", "dtype"), CASES)
def test_network_state_dict_holds_the_float32_masters(level: str, dtype: str) -> None:
    step, model = _build(level, dtype)
    for _ in range(2):
        step(*_batch())
    saved = step.network.state_dict()
    assert all(v.dtype == torch.float32 for v in saved.values())
    restored = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))
    restored.load_state_dict(saved)
    for got, want in zip(restored.parameters(), model.parameters(), strict=True):
        assert torch.equal(got, want)
    again, again_model = _build(level, dtype)  # and the step loads it back exactly
    again.network.load_state_dict(saved)
    for got, want in zip(again_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(("level", "dtype"), [*CASES, ("O0", None), ("O1", "bfloat16")])
def test_hooks_on_the_users_parameters_fire_as_on_the_original(
    level: str, dtype: str | None
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))
    step = amp.build_train_network(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        nn.CrossEntropyLoss(),
        level=level,
        dtype=dtype,
        loss_scale_manager=None,
        accumulation_steps=2,
    )
    seen: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    model[2].weight.register_hook(lambda g: seen.append(("grad", g.dtype, tuple(g.shape))))
    model[2].weight.register_post_accumulate_grad_hook(
        lambda p: seen.append(("accumulated", p.grad.dtype, tuple(p.grad.shape)))  # type: ignore[union-attr]
    )
    model[0].bias.register_hook(torch.zeros_like)  # a returned tensor replaces the gradient
    bias = model[0].bias.detach().clone()
    trained = model[0].weight.detach().clone()
    for _ in range(2):  # two micro-batches: one optimizer step
        step(*_batch())
    assert seen == [("grad", torch.float32, (3, 6)), ("accumulated", torch.float32, (3, 6))] * 2
    assert torch.equal(model[0].bias, bias)
    assert not torch.equal(model[0].weight, trained)


@pytest.mark.parametrize(("level", "dtype"), CASES)
@pytest.mark.parametrize("write", ["in place", ".data assigned", "load_state_dict"])
def test_a_submodule_called_directly_computes_with_the_written_weights(
    level: str, dtype: str, write: str
) -> None:
    step, model = _build(level, dtype)
    x = _batch()[0]
    step.network[0](x)  # a first direct call (its low copy as built)
    doubled = model[0].weight.detach() * 2
    if write == "in place":
        with torch.no_grad():
            model[0].weight.mul_(2)
    elif write == ".data assigned":
        model[0].weight.data = doubled.clone()
    else:
        model[0].load_state_dict({"weight": doubled, "bias": model[0].bias.detach()})
    low = getattr(torch, dtype)
    want = nn.functional.linear(x.to(low), doubled.to(low), model[0].bias.detach().to(low))
    torch.testing.assert_close(step.network[0](x).to(low), want, rtol=0, atol=0)
    torch.testing.assert_close(step.network[2].weight, model[2].weight.to(low), rtol=0, atol=0)
