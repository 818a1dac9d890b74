"""O1 runs the user's own code under its list: nothing traced, nothing frozen, the
white-list ops low and everything else float32, at every entry point."""

from __future__ import annotations

import copy
import pickle
import sys
import time
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import mixprec as amp
from helpers import count_casts, needs_compile, rel_error
from mixprec.convert.autocast import ListedForward
from mixprec.convert.structure import forward_of
from test_autocast_level import Cache, MaskCache, Recurrent

BF16 = torch.bfloat16
TOL = 3e-2  # relative error of a tiny network at O1 bf16 against float32


def _o1(model: nn.Module, **pins: Any) -> nn.Module:
    return amp.auto_mixed_precision(model, "O1", "bf16", **pins)


def test_conversion_runs_no_user_code_and_every_call_runs_it() -> None:
    model = Cache()
    torch.manual_seed(0)
    converted = _o1(model)
    after_conversion = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(3), after_conversion)  # the RNG stream is untouched
    cache: list[torch.Tensor] = []
    x = torch.randn(2, 4)
    converted(x, cache)
    converted(x, cache)
    assert len(cache) == 2  # the list argument is updated on every call
    assert all(t.dtype == torch.float32 for t in cache)  # the Linear's result, cast back


def test_tensors_in_tuple_arguments_are_used_as_passed() -> None:
    torch.manual_seed(0)
    model = Recurrent()
    converted = _o1(model)
    x = torch.randn(5, 1, 4)
    zeros = (torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    first, hidden = converted(x, zeros)
    assert first.dtype == hidden[0].dtype == torch.float32
    again, _ = converted(x, hidden)
    expected, _ = model(x, model(x, zeros)[1])
    assert not torch.equal(first, again)  # the LSTM read the state it was given
    assert rel_error(again, expected) < TOL


def test_state_and_children_are_read_at_each_call() -> None:
    model = MaskCache()
    converted = _o1(model)
    assert converted(torch.randn(3, 4)).shape == (3, 4)
    assert converted(torch.randn(5, 4)).shape == (5, 4)  # the mask cache rebuilt
    x = torch.randn(2, 4)
    converted.extra, model.extra = [1.0, 2.0], [1.0, 2.0]  # None at conversion, a list now
    assert rel_error(converted(x), model(x)) < TOL
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    converted = _o1(seq)
    converted[1] = nn.Tanh()
    reference = nn.Sequential(seq[0], nn.Tanh())
    assert rel_error(converted(x), reference(x)) < TOL


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return self.fc(x) * scale


def test_a_changing_scalar_argument_keeps_nothing_per_value() -> None:
    converted = _o1(Scaled())
    x = torch.randn(2, 4)
    before = len(pickle.dumps(converted))
    outs = [converted(x, float(k)) for k in range(20)]
    assert torch.equal(outs[3], outs[1] * 3)
    assert len(pickle.dumps(converted)) == before  # no per-value state was kept


def test_pickles_deep_models_and_max_pool() -> None:
    deep = nn.Sequential(*[nn.Sequential(nn.Linear(2, 2)) for _ in range(60)])
    cnn = nn.Sequential(nn.Conv2d(1, 2, 3), nn.MaxPool2d(2), nn.Flatten())
    for model, x in ((deep, torch.randn(1, 2)), (cnn, torch.randn(1, 1, 6, 6))):
        converted = _o1(model)
        for again in (pickle.loads(pickle.dumps(converted)), copy.deepcopy(converted)):
            assert torch.equal(again(x), converted(x))


def test_a_deep_model_converts_and_runs_within_the_recursion_limit() -> None:
    model: nn.Module = nn.Linear(2, 2)
    for _ in range(90):
        model = nn.Sequential(model)
    x = torch.randn(1, 2)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(600)  # about 4 frames per level, converted or not (bench_depth.py)
    try:
        model(x)
        assert _o1(model)(x).dtype == torch.float32
    finally:
        sys.setrecursionlimit(limit)


def test_orthogonal_parametrization_runs_in_float32() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    nn.utils.parametrizations.orthogonal(model[0], orthogonal_map="householder")
    x = torch.randn(2, 4)
    out, counter = count_casts(_o1(model), x)
    assert rel_error(out, model(x)) < TOL
    # x, the orthogonal weight (computed in float32) and the bias down; the result up
    # (the parametrization's own float32 -> int32 cast is its code's)
    assert counter.casts[(torch.float32, BF16)] == 3
    assert counter.casts[(BF16, torch.float32)] == 1


@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_a_one_call_layer_whose_weight_is_not_a_parameter_computes_with_it(layer: str) -> None:
    # (a parametrized weight is a property, not in ``_parameters``: the direct call must read
    # the attribute, the weight the parametrization computes in float32, then cast it down)
    torch.manual_seed(0)
    module = nn.Linear(4, 3) if layer == "linear" else nn.Conv2d(2, 3, 3, padding=1)
    nn.utils.parametrizations.weight_norm(module)
    x = torch.randn(2, 4) if layer == "linear" else torch.randn(1, 2, 5, 5)
    converted = _o1(nn.Sequential(module))
    with torch.no_grad():
        out = converted(x)
        weight, bias = module.weight.to(BF16), module.bias.to(BF16)
        if layer == "linear":
            expected = nn.functional.linear(x.to(BF16), weight, bias)
        else:
            expected = nn.functional.conv2d(x.to(BF16), weight, bias, padding=1)
    assert out.dtype == torch.float32
    assert torch.equal(out, expected.float())


def test_the_plan_does_not_depend_on_the_first_calls_grad_mode() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    x = torch.randn(2, 4)
    a, b = _o1(model), _o1(model)
    with torch.no_grad():
        a(x)
    b(x)
    assert amp.explain(a).to_dict() == amp.explain(b).to_dict()
    assert amp.explain(a, x).num_casts == amp.explain(b, x).num_casts == count_casts(a, x)[1].total


def test_gradient_checkpointing_of_a_transformers_model_trains() -> None:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.BartConfig(
        vocab_size=32, d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
        decoder_ffn_dim=16, max_position_embeddings=16,
    )  # fmt: skip
    model = tf.BartModel(cfg)
    model.gradient_checkpointing_enable()
    converted = _o1(model)
    ids = torch.randint(3, 32, (1, 6))
    converted(input_ids=ids).last_hidden_state.sum().backward()
    assert all(p.grad is not None for p in model.encoder.layers[0].parameters())


def test_generate_with_a_kv_cache() -> None:
    import transformers as tf

    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=32, n_embd=16, n_layer=2, n_head=2))
    converted = _o1(model.eval())
    ids = torch.randint(0, 32, (1, 4))
    with torch.no_grad():
        out = converted.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        logits = converted(ids).logits
    assert out.shape == (1, 9)
    assert logits.dtype == torch.float32
    assert rel_error(logits, model(ids).logits) < TOL


def test_conversion_of_gpt2_small_is_fast() -> None:
    import transformers as tf

    model = tf.GPT2Model(tf.GPT2Config())
    start = time.perf_counter()
    _o1(model)
    assert time.perf_counter() - start < 0.5


@needs_compile
@pytest.mark.parametrize("level", ["O1", "autocast"])
def test_compiles_with_no_more_graph_breaks_than_the_original(level: str) -> None:
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.LayerNorm(4), nn.Linear(4, 2))
    converted = amp.auto_mixed_precision(model, level, "bf16")
    x = torch.randn(2, 4)
    ours = torch._dynamo.explain(converted)(x)
    theirs = torch._dynamo.explain(model)(x)
    assert ours.graph_break_count <= theirs.graph_break_count
    compiled = torch.compile(converted, backend="eager")
    assert torch.equal(compiled(x), converted(x))


class OwnMathLinear(nn.Linear):
    """transformers' FalconLinear: an nn.Linear subclass doing its own matmul."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.weight.T
        return out if self.bias is None else out + self.bias


def test_a_linear_subclass_with_its_own_math_computes_low() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(OwnMathLinear(4, 8), nn.ReLU(), OwnMathLinear(8, 2))
    x = torch.randn(3, 4)
    out, counter = count_casts(_o1(model), x)
    assert out.dtype == torch.float32
    assert rel_error(out, model(x)) < TOL
    # each layer: its input down (the second takes relu's low result), the weight down for
    # the matmul, its result up (the bias is added in float32); relu's result up
    assert counter.casts == {(torch.float32, BF16): 4, (BF16, torch.float32): 3}


class _SeesDtypes(nn.Module):
    """A white-list layer, then ops O1 keeps in float32: ``vecdot`` (on torch.autocast's
    CPU lower-precision list), softmax and a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        dot, probs = torch.linalg.vecdot(h, h), torch.softmax(h, -1)
        out = self.norm(probs + dot[:, None])
        self.seen += [dot.dtype, probs.dtype, out.dtype]
        return out


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "mode"])
@pytest.mark.parametrize("outer", [torch.float16, BF16], ids=["fp16", "bf16"])
def test_float32_ops_hold_under_an_outer_autocast_which_warns_once(
    outer: torch.dtype, kernels: bool
) -> None:
    """As the other levels keep their float32 modules: the outer autocast is off inside,
    so the white list computes in the level's dtype and everything else in float32."""
    torch.manual_seed(0)
    converted = _o1(_SeesDtypes())
    forward = forward_of(converted)
    assert isinstance(forward, ListedForward)
    forward.region.kernels = kernels  # the dispatcher's kernels, or the mode (compile's path)
    low: list[torch.dtype] = []
    converted.fc.register_forward_hook(lambda m, a, out: low.append(out.dtype))
    x = torch.randn(3, 4)
    plain = converted(x)
    converted.seen.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cpu", outer):
            first = converted(x)
            again = converted(x)
    told = [str(w.message) for w in caught if "outer torch.autocast" in str(w.message)]
    assert told == [
        "a model converted by mixprec runs under an outer torch.autocast: inside the model "
        "the level's own dtype, lists and float32 pins apply"
    ]  # once per conversion
    assert low == [BF16] * 3  # the level's dtype, not the outer autocast's
    assert converted.seen == [torch.float32] * 6
    assert first.dtype == torch.float32
    assert torch.equal(first, plain)
    assert torch.equal(again, plain)
    with torch.autocast("cpu", outer):
        assert converted.fc(x).dtype == torch.float32  # a direct call of a submodule too
