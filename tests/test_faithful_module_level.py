"""O2/O3: a converted model is the user's model.

Whatever a user does with their module (modes, hooks, other entry points, checkpointing,
custom autograd Functions, writes to weights, parametrizations, mixed operands, export,
compile, adapters, threads) works on the converted one, with the same meaning, computing
in the level's precision. Hand-written modules run at both levels and dtypes; the
transformers models (tiny, random weights, built from configs) run in bfloat16.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt
from torch import nn
from torch.nn.utils import parametrize

import mixprec as amp
from helpers import MLP, compiled_in_one_graph, count_casts, needs_compile, rel_error
from mixprec.convert.cast_at_use import low_precision_parameters
from mixprec.convert.structure import forward_of, is_converted_exactly, user_class

LEVELS = ["O2", "O3"]
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 4e-3}


@pytest.fixture(autouse=True)
def _quiet_slow_dtype_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("mixprec.convert.api.warn_if_slow", lambda *a: None)


def _watch(model: nn.Module, weights: bool = True) -> dict[str, set[torch.dtype]]:
    """Forward hooks recording, per Linear, the dtypes of its output and (when
    ``weights``) weight: what it computes in. (Its hooks see the arguments its caller
    passed, as under ``torch.autocast``: a layer casts its inputs inside its own call.) A
    hook runs inside its parent's call, not its own: on a module called from outside the
    model, it reads the stored float32 weight."""
    seen: dict[str, set[torch.dtype]] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):

            def hook(mod: nn.Module, args: Any, out: Any, name: str = name) -> None:
                found = {out.dtype} | ({mod.weight.dtype} if weights else set())
                seen.setdefault(name, set()).update(found)

            module.register_forward_hook(hook)
    return seen


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.fc(x))
        if self.training:
            h = h + 100.0
        return self.norm(h)


class Net(nn.Module):
    """Two blocks, an extra method, a float32 buffer used in a matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 4)
        self.register_buffer("proj", torch.randn(8, 8) / 3)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encode(x) @ self.proj)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


# ------------------------------------------------------------------ 1. modes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", LEVELS)
def test_train_and_eval_take_effect(level: str, dtype: torch.dtype) -> None:
    model = _net().train()
    converted = amp.auto_mixed_precision(model, level, dtype)
    x = torch.randn(3, 8)
    converted.eval()
    model.eval()
    assert torch.equal(converted(x), converted(x))  # dropout off
    assert rel_error(converted(x), model(x)) < TOLERANCE[dtype]
    converted.train()
    assert not torch.equal(converted(x), converted(x))  # dropout on again
    assert converted.blocks[0].training
    assert not model.training


# ------------------------------------------------------------------ 2. hooks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", LEVELS)
def test_hooks_before_and_after_conversion_fire_on_every_call(
    level: str, dtype: torch.dtype
) -> None:
    model = _net()
    calls: list[tuple[str, torch.dtype]] = []
    model.blocks[1].fc.register_forward_hook(lambda m, a, o: calls.append(("before", o.dtype)))
    converted = amp.auto_mixed_precision(model, level, dtype)
    fc = converted.get_submodule("blocks.0.fc")
    fc.register_forward_pre_hook(lambda m, a: calls.append(("pre", a[0].dtype)))
    fc.register_forward_hook(lambda m, a, o: calls.append(("after", m.weight.dtype)))
    fc.register_full_backward_hook(lambda m, gi, go: calls.append(("backward", go[0].dtype)))
    x = torch.randn(3, 8)
    for _ in range(2):
        converted(x).sum().backward()
    assert calls == [("pre", dtype), ("after", dtype), ("before", dtype), ("backward", dtype)] * 2
    calls.clear()
    model(x)  # hooks added to the converted model stay off the original
    assert calls == [("before", torch.float32)]


# ------------------------------------------------------------------ 3. entry points


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", LEVELS)
def test_submodules_and_other_methods_compute_low(level: str, dtype: torch.dtype) -> None:
    model = _net().eval()
    converted = amp.auto_mixed_precision(model, level, dtype)
    seen = _watch(converted)
    x = torch.randn(3, 8)
    encoded = converted.encode(x)  # another method of the class
    block = converted.blocks[1](x)  # a submodule on its own
    assert seen == {"blocks.0.fc": {dtype}, "blocks.1.fc": {dtype}}
    assert encoded.dtype == block.dtype == dtype  # O2: the LayerNorm island's output, cast back
    assert rel_error(encoded, model.encode(x)) < TOLERANCE[dtype]
    assert rel_error(block, model.blocks[1](x)) < TOLERANCE[dtype]
    assert converted.blocks[1].norm.weight.dtype == torch.float32  # outside a call: stored
    probe: list[torch.dtype] = []
    converted.blocks[1].norm.register_forward_pre_hook(lambda m, a: probe.append(a[0].dtype))
    converted.blocks[1](x)
    assert probe == [dtype]  # its hooks see what its caller passed (O2: float32 inside)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


class Checkpointed(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.a, self.b, self.mode = nn.Linear(8, 8), nn.Linear(8, 8), mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "none":
            return self.b(torch.tanh(self.a(x)))
        inner = lambda h: torch.tanh(self.a(h))  # noqa: E731
        h = ckpt.checkpoint(inner, x, use_reentrant=self.mode == "reentrant")
        return self.b(h)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", LEVELS)
def test_checkpointed_recomputation_sees_the_low_weights(
    level: str, dtype: torch.dtype, mode: str
) -> None:
    torch.manual_seed(0)
    model = Checkpointed(mode)
    plain = copy.deepcopy(model)
    plain.mode = "none"
    x = torch.randn(4, 8, requires_grad=True)
    for net in (model, plain):
        converted = amp.auto_mixed_precision(net, level, dtype)
        for _ in range(2):  # a plain loop: the recomputation happens in backward
            converted(x).square().sum().backward()
    for ours, ref in zip(_grads(model), _grads(plain), strict=True):
        assert ours.dtype == torch.float32
        assert torch.equal(ours, ref)  # recomputed in the same precision: the same gradients


class ReverseGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return -grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", LEVELS)
def test_custom_autograd_function_keeps_its_backward(level: str, dtype: torch.dtype) -> None:
    class Adversarial(nn.Module):
        def __init__(self, reverse: bool) -> None:
            super().__init__()
            self.a, self.b, self.reverse = nn.Linear(4, 4), nn.Linear(4, 1), reverse

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.b(ReverseGrad.apply(h) if self.reverse else h)

    torch.manual_seed(0)
    model = Adversarial(reverse=True)
    plain = copy.deepcopy(model)
    plain.reverse = False
    x = torch.randn(3, 4)
    for net in (model, plain):
        amp.auto_mixed_precision(net, level, dtype)(x).sum().backward()
    assert torch.equal(model.a.weight.grad, -plain.a.weight.grad)
    assert torch.equal(model.b.weight.grad, plain.b.weight.grad)


# ------------------------------------------------------------------ 4. state


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", LEVELS)
def test_every_write_is_what_the_next_forward_uses(level: str, dtype: torch.dtype) -> None:
    model = _net().eval()
    converted = amp.auto_mixed_precision(model, level, dtype)
    x = torch.randn(3, 8)

    def fresh() -> torch.Tensor:  # a conversion made now, from the same weights
        return amp.auto_mixed_precision(model, level, dtype)(x)

    other = _net()
    torch.nn.init.normal_(other.head.weight)
    writes: list[Callable[[], object]] = [
        lambda: converted.load_state_dict(other.state_dict()),
        lambda: model.load_state_dict(_net().state_dict()),
        lambda: model.head.weight.data.mul_(3.0),  # bumps no version counter
        lambda: converted.head.bias.data.add_(1.0),
        lambda: torch.nn.init.zeros_(converted.blocks[0].fc.weight),
    ]
    with torch.no_grad():
        for write in writes:
            before = converted(x)
            write()
            after = converted(x)
            assert not torch.equal(after, before)
            assert torch.equal(after, fresh())
    assert list(converted.state_dict()) == list(model.state_dict())


# ------------------------------------------------------------------ 5. parametrizations


class Symmetric(nn.Module):
    def __init__(self, seen: list[torch.dtype]) -> None:
        super().__init__()
        self.seen = seen

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        self.seen.append(w.dtype)
        return w.triu() + w.triu(1).transpose(0, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", LEVELS)
def test_parametrizations_run_in_float32_and_feed_low_layers(
    level: str, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    seen: list[torch.dtype] = []
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    parametrize.register_parametrization(model[0], "weight", Symmetric(seen))
    nn.utils.parametrizations.weight_norm(model[2])
    x = torch.randn(3, 6)
    expected = model(x)
    seen.clear()
    converted = amp.auto_mixed_precision(model, level, dtype)
    weights = _watch(converted)
    out = converted(x)
    assert seen
    assert set(seen) == {torch.float32}
    assert weights == {"0": {dtype}, "2": {dtype}}  # the layers compute with the low result
    assert out.dtype == torch.float32
    assert rel_error(out, expected) < TOLERANCE[dtype]
    out.sum().backward()
    original = model[0].parametrizations.weight.original
    assert original.grad is not None
    assert original.grad.dtype == torch.float32


class Scaled(nn.Module):
    def __init__(self, seen: list[torch.dtype]) -> None:
        super().__init__()
        self.seen = seen

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        self.seen.append(t.dtype)
        return t * 0.5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", LEVELS)
def test_parametrizations_registered_after_conversion_run_as_those_before(
    level: str, dtype: torch.dtype
) -> None:
    """A parametrization registered on a converted model (a weight, a second one on the
    same weight, a bias) computes in float32 on the float32 original, and the low layer
    computes with its low result, as one registered before conversion does."""
    torch.manual_seed(0)
    seen: list[torch.dtype] = []
    model = nn.Sequential(Block(), nn.Linear(8, 2)).eval()
    converted = amp.auto_mixed_precision(model, level, dtype)
    for net in (model, converted):  # the same change to both
        parametrize.register_parametrization(net[0].fc, "weight", Symmetric(seen))
        parametrize.register_parametrization(net[0].fc, "weight", Scaled(seen))
        parametrize.register_parametrization(net[1], "bias", Scaled(seen))
    assert forward_of(model[0].fc.parametrizations.weight) is None  # the user's: as made
    x = torch.randn(3, 8)
    expected = model(x)
    seen.clear()
    out = converted(x)
    assert seen == [torch.float32] * 3  # each parametrization once, in float32
    weights = _watch(converted)
    converted(x)
    assert weights["0.fc"] == {dtype}
    assert weights["1"] == {dtype}
    assert out.dtype == torch.float32
    assert rel_error(out, expected) < TOLERANCE[dtype]
    out.sum().backward()
    for original in (
        converted[0].fc.parametrizations.weight.original,
        converted[1].parametrizations.bias.original,
    ):
        assert original.grad is not None
        assert original.grad.dtype == torch.float32
    assert torch.equal(torch.compile(converted, backend="eager")(x), converted(x))


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("level", LEVELS)
def test_remove_parametrizations_leaves_the_float32_weight(level: str, when: str) -> None:
    """Outside a call a parametrized weight reads float32 (as a stored weight does), so
    ``remove_parametrizations`` writes the parametrized value into the float32 original
    (the same Parameter: an optimizer keeps it) and the layer is converted as before."""
    torch.manual_seed(0)
    seen: list[torch.dtype] = []
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    if when == "before":
        parametrize.register_parametrization(model[0], "weight", Symmetric(seen))
    converted = amp.auto_mixed_precision(model, level, torch.bfloat16)
    if when == "after":
        parametrize.register_parametrization(converted[0], "weight", Symmetric(seen))
    original = converted[0].parametrizations.weight.original
    value = converted[0].weight
    assert value.dtype == torch.float32
    x = torch.randn(3, 6)
    parametrized = converted(x)
    parametrize.remove_parametrizations(converted[0], "weight")
    assert converted[0].weight is original
    assert torch.equal(original, value)
    assert is_converted_exactly(converted[0])  # a converted Linear again
    assert user_class(converted[0]) is nn.Linear
    assert torch.equal(converted(x), parametrized)
    weights = _watch(converted)
    converted(x)
    assert weights["0"] == {torch.bfloat16}
    if when == "before":  # the user's model keeps its parametrization
        assert parametrize.is_parametrized(model[0], "weight")
        assert model(x).dtype == torch.float32


# ------------------------------------------------------------------ 6. mixed operands


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", LEVELS)
def test_mixed_operands_follow_autocast_rules(level: str, dtype: torch.dtype) -> None:
    seen: dict[str, torch.dtype] = {}

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("proj", torch.randn(4, 4))
            self.register_buffer("bias", torch.randn(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            product = h @ self.proj  # a lower-precision op: low
            summed = h + self.bias  # type promotion: float32
            chosen = h.float() @ self.proj  # all float32 operands: the model's float32 math
            seen.update(product=product.dtype, summed=summed.dtype, chosen=chosen.dtype)
            return product + summed + chosen

    model = Mixed()
    out = amp.auto_mixed_precision(model, level, dtype)(torch.randn(2, 4))
    assert seen == {"product": dtype, "summed": torch.float32, "chosen": torch.float32}
    assert out.dtype == torch.float32


# ------------------------------------------------------------------ 7. export and compile


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("level", ["O1", "autocast", *LEVELS])
def test_export_matches_eager(level: str, strict: bool) -> None:
    """Non-strict ``torch.export`` runs the eager path; strict export traces with
    TorchDynamo and takes the compiled path (it traced the eager one and failed: "Read
    uninitialized cell")."""
    converted = amp.auto_mixed_precision(_net().eval(), level, torch.bfloat16)
    x = torch.randn(3, 8)
    exported = torch.export.export(converted, (x,), strict=strict)
    if strict and level == "O1":  # (export's decomposed linear rounds its bias add apart)
        torch.testing.assert_close(exported.module()(x), converted(x), rtol=0.01, atol=0.01)
    else:
        assert torch.equal(exported.module()(x), converted(x))


@pytest.mark.parametrize("level", ["O1", "autocast", *LEVELS])
def test_symbolic_trace_is_refused_and_a_traced_original_converts(level: str) -> None:
    """``torch.fx.symbolic_trace`` replaces a module's call with its own, where a
    converted model makes its casts: tracing a converted model is refused with the way
    out (it made a graph that computed in float32, or failed on mixed dtypes). A traced
    original (a ``GraphModule``, whose class is its own) converts at every level, eagerly
    and compiled (its copy lacked the class's ``forward``)."""
    torch.manual_seed(0)
    model = _net().eval()
    converted = amp.auto_mixed_precision(model, level, torch.bfloat16)
    with pytest.raises(TypeError, match="Trace the original and convert the GraphModule"):
        torch.fx.symbolic_trace(converted)
    graph_module = torch.fx.symbolic_trace(model)
    traced = amp.auto_mixed_precision(graph_module, level, torch.bfloat16)

    def model_graph(_: nn.Module) -> torch.fx.Graph:
        return graph_module.graph

    x = torch.randn(3, 8)
    assert torch.equal(traced(x), converted(x))
    torch._dynamo.reset()
    assert torch.equal(torch.compile(traced, backend="eager")(x), converted(x))
    traced.recompile()  # (made on the traced class: it set a forward and a __call__ on
    assert torch.equal(traced(x), converted(x))  # the converted one that recursed)
    twin = copy.deepcopy(traced)  # (GraphModule's own deepcopy dropped the conversion)
    assert twin(x).dtype == converted(x).dtype
    assert torch.equal(twin(x), converted(x))
    assert traced.graph is not model_graph(model)  # (a graph of its own: edits stay there)


@pytest.mark.parametrize("level", ["O1", "autocast", *LEVELS])
def test_an_uninitialized_lazy_module_is_refused(level: str) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.LazyLinear(4))
    with pytest.raises(ValueError, match=r"lazy modules .* \('1'\).*Run one forward"):
        amp.auto_mixed_precision(model, level, torch.bfloat16)
    model(torch.randn(2, 8))  # initialized: a plain nn.Linear now
    converted = amp.auto_mixed_precision(model, level, torch.bfloat16)
    assert converted(torch.randn(2, 8)).shape == (2, 4)


@needs_compile
@pytest.mark.parametrize("level", LEVELS)
def test_compile_has_no_graph_breaks_and_matches_eager(level: str) -> None:
    converted = amp.auto_mixed_precision(MLP().eval(), level, torch.bfloat16)
    x = torch.randn(3, 16)
    assert torch.equal(compiled_in_one_graph(converted, x), converted(x))


# ------------------------------------------------------------------ 10. the rest of nn.Module


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", LEVELS)
def test_freezing_to_and_functional_call_after_conversion(level: str, dtype: torch.dtype) -> None:
    model = _net()
    converted = amp.auto_mixed_precision(model, level, dtype)
    converted.blocks.requires_grad_(False)
    x = torch.randn(3, 8)
    converted(x).sum().backward()
    assert all(p.grad is None for p in model.blocks.parameters())
    assert model.head.weight.grad is not None
    assert converted.to(torch.device("cpu")) is converted
    params = {name: torch.zeros_like(p) for name, p in converted.named_parameters()}
    out = torch.func.functional_call(converted, params, (x,))
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.zeros_like(out))  # it computed with the given weights
    assert converted(x).abs().sum() > 0  # and put the stored ones back


@pytest.mark.parametrize("level", LEVELS)
def test_one_model_from_two_threads_gives_the_serial_results(level: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    converted = amp.auto_mixed_precision(model, level, torch.bfloat16)
    inputs = [torch.randn(2, 8) for _ in range(200)]
    results: dict[int, list[torch.Tensor]] = {}

    def run(index: int) -> None:
        with torch.no_grad():
            results[index] = [converted(x) for x in inputs]

    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: intra-op threads would only contend
    try:
        run(-1)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        torch.set_num_threads(threads_before)
    for index in range(2):
        assert all(torch.equal(a, b) for a, b in zip(results[index], results[-1], strict=True))
    assert results[-1][0].dtype == torch.float32


@pytest.mark.parametrize("level", LEVELS)
def test_tied_weight_is_cast_once_per_forward(level: str) -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8, bias=False)
            self.b = nn.Linear(8, 8)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)) + F.linear(x, self.a.weight)  # read in the parent too

    converted = amp.auto_mixed_precision(Tied(), level, torch.bfloat16)
    _, counter = count_casts(converted, torch.randn(2, 8))
    assert counter.total == 4  # the input, the shared weight once, b.bias, the output
    assert amp.explain(converted).num_casts == 4
    owners = [(p.owner, p.name) for p in low_precision_parameters(converted)]
    assert owners == [(converted.a, "weight"), (converted.b, "bias"), (converted.b, "weight")]


def test_low_precision_parameters_refuses_an_unconverted_module() -> None:
    with pytest.raises(TypeError, match="converted must be a module converted at O2 or O3"):
        low_precision_parameters(MLP())


def test_an_exception_leaves_no_call_running() -> None:
    class Boom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.fc(x)
            raise RuntimeError("boom")

    model = Boom()
    converted = amp.auto_mixed_precision(model, "O2", "bf16")
    with pytest.raises(RuntimeError, match="boom"):
        converted(torch.randn(2, 4))
    assert converted.fc.weight is model.fc.weight  # read outside a call: the Parameter
    assert next(iter(converted.parameters())) is model.fc.weight
    assert torch.overrides._get_current_function_mode_stack() == []
