"""Master weights follow the user's writes (O2 and O3, bf16 and fp16): requires_grad changes
after the build, writes that move no version counter (``.data``, ``vector_to_parameters``) on
either copy, and ``step.network.state_dict()`` holds the float32 masters."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from torch import nn

import mixprec as amp
from helpers import needs_compile

CASES = [("O2", "bfloat16"), ("O2", "float16"), ("O3", "bfloat16"), ("O3", "float16")]


def _build(level: str, dtype: str | None, **options: Any) -> tuple[amp.TrainStep, nn.Sequential]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))
    step = amp.build_train_network(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5),
        nn.CrossEntropyLoss(),
        level=level,
        dtype=dtype,
        loss_scale_manager=None,
        **options,
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
    step, model = _build(level, dtype, accumulation_steps=2)
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


# ------------------------------------------------------------ writes that move no version counter

WRITES = {
    # each on the user's Parameters (the masters) or on step.network's (the low copies);
    # .data has a version counter of its own, vector_to_parameters assigns .data
    "p.data.mul_": lambda params: [p.data.mul_(0.5) for p in params],
    "p.data.copy_": lambda params: [
        p.data.copy_(torch.linspace(-0.3, 0.3, p.numel()).view_as(p)) for p in params
    ],
    "p.data.clamp_": lambda params: [p.data.clamp_(-0.05, 0.05) for p in params],
    "vector_to_parameters": lambda params: nn.utils.vector_to_parameters(
        torch.linspace(-0.2, 0.2, sum(p.numel() for p in params)), params
    ),
}


def _low_reference(
    weights: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor, low: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward in the low dtype with ``weights`` (O2 and O3 compute exactly this on the
    test model) and its float32 loss."""
    w0, b0, w2, b2 = (w.to(low) for w in weights)
    out = nn.functional.linear(nn.functional.linear(x.to(low), w0, b0).relu(), w2, b2).float()
    return out, nn.functional.cross_entropy(out, y)


def _fp32_loss(weights: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    w0, b0, w2, b2 = weights
    out = nn.functional.linear(nn.functional.linear(x, w0, b0).relu(), w2, b2)
    return nn.functional.cross_entropy(out, y)


@pytest.mark.parametrize(("level", "dtype"), CASES)
@pytest.mark.parametrize("write", list(WRITES))
@pytest.mark.parametrize("through", ["model", "network"])
def test_a_write_that_moves_no_version_counter_is_computed_with(
    level: str, dtype: str, write: str, through: str
) -> None:
    """A write through the user's model (the masters) or through ``step.network`` (the low
    copies): the next step computes with the written value, exactly as the low dtype
    computes it, and within 2e-2 of the same weights in float32; the optimizer steps the
    masters from it exactly as from the same values loaded with ``load_state_dict``."""
    step, model = _build(level, dtype)
    x, y = _batch()
    step(x, y)  # a first step: the copies are in use
    params = list((model if through == "model" else step.network).parameters())
    mirror = [nn.Parameter(p.detach().clone()) for p in params]  # the write on plain tensors
    WRITES[write](mirror)
    written = [p.detach().float() for p in mirror]
    WRITES[write](params)
    low = getattr(torch, dtype)
    want_out, want_loss = _low_reference(written, x, y, low)
    loss = step(x, y)
    torch.testing.assert_close(step.last_output, want_out, rtol=0, atol=0)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
    torch.testing.assert_close(loss, _fp32_loss(written, x, y), rtol=2e-2, atol=2e-2)
    twin, twin_model = _build(level, dtype)  # the same values written with a version bump
    twin_model.load_state_dict(dict(zip(twin_model.state_dict(), written, strict=True)))
    twin(x, y)
    for master, want in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert torch.equal(master, want)  # trained from the written value
    assert all(p.dtype == low for p in step.network.parameters())
    assert torch.equal(step.network[0].weight, model[0].weight.to(low))


@pytest.mark.parametrize(("level", "dtype"), CASES)
def test_a_low_copys_data_shares_its_version_counter_and_survives_copies(
    level: str, dtype: str
) -> None:
    """The low copies are Parameters whose ``.data`` moves their version counter (deepcopy and
    pickle keep that); the user's masters stay plain ``nn.Parameter`` objects (torch's
    optimizers pick their foreach kernels by that exact type)."""
    step, model = _build(level, dtype)
    assert all(type(p) is nn.Parameter for p in model.parameters())
    for network in (
        step.network,
        copy.deepcopy(step.network),
        pickle.loads(pickle.dumps(step.network)),
    ):
        weight = network[0].weight
        assert isinstance(weight, nn.Parameter)
        assert weight.master.shape == weight.shape
        assert weight.master.dtype == torch.float32
        before = weight._version
        weight.data.mul_(2)
        assert weight._version == before + 1


@needs_compile
@pytest.mark.parametrize(("level", "dtype"), CASES)
def test_a_write_is_computed_with_when_compiled_and_in_inference_mode(
    level: str, dtype: str
) -> None:
    """Compiled, the check runs eagerly before the graph: a write is computed with, and
    neither it nor a step recompiles (one graph, no break)."""
    step, model = _build(level, dtype)
    x, y = _batch()
    graphs: list[object] = []

    def backend(gm: torch.fx.GraphModule, example: object) -> object:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(step.network, backend=backend)
    compiled(x)
    low = getattr(torch, dtype)
    for p in model.parameters():
        p.data.mul_(0.5)
    want, _ = _low_reference([p.detach() for p in model.parameters()], x, y, low)
    torch.testing.assert_close(compiled(x), want, rtol=0, atol=0)
    step(x, y)
    compiled(x)
    assert len(graphs) == 1
    for p in model.parameters():
        p.data.clamp_(-0.05, 0.05)
    want, _ = _low_reference([p.detach() for p in model.parameters()], x, y, low)
    with torch.inference_mode():
        torch.testing.assert_close(step.network.eval()(x), want, rtol=0, atol=0)


@pytest.mark.parametrize(("level", "dtype"), CASES)
def test_two_forwards_before_one_backward_still_run(level: str, dtype: str) -> None:
    """Every forward copies the masters down through an alias with its own version counter,
    so the graph of an earlier forward (a pipeline schedule's micro-batch) stays valid."""
    step, _ = _build(level, dtype)
    x = _batch()[0]
    first = step.network(x)
    second = step.network(x)
    (first.sum() + second.sum()).backward()
    assert step.network[0].weight.grad is not None


@pytest.mark.parametrize(("level", "dtype"), CASES)
def test_when_both_copies_are_written_a_counted_master_write_wins(level: str, dtype: str) -> None:
    step, model = _build(level, dtype)
    x, y = _batch()
    step.network[0].weight.data.mul_(2)
    with torch.no_grad():
        model[0].weight.mul_(0.5)  # in place: moves the master's counter
    want, _ = _low_reference([p.detach() for p in model.parameters()], x, y, getattr(torch, dtype))
    torch.testing.assert_close(step.network(x), want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("fused", [True, False])
def test_without_masters_the_users_model_follows_a_fused_optimizer(dtype: str, fused: bool) -> None:
    """``master_weights=False``: the optimizer steps the low copies (a fused kernel moves no
    version counter); after every step the user's Parameters and ``step.network.state_dict()``
    hold the stepped values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))
    step = amp.build_train_network(
        model,
        torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused, foreach=None if fused else True),
        nn.CrossEntropyLoss(),
        level="O3",
        dtype=dtype,
        master_weights=False,
        loss_scale_manager=None,
    )
    before = model[0].weight.detach().clone()
    for _ in range(2):
        step(*_batch())
    assert not torch.equal(model[0].weight, before)
    for got, low in zip(model.parameters(), step.network.parameters(), strict=True):
        assert torch.equal(got, low.float())
    saved = step.network.state_dict()
    assert torch.equal(saved["0.weight"], model[0].weight)
