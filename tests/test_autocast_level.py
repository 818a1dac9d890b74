"""The autocast level is torch.autocast on the user's own code: nothing traced, nothing
frozen, every module answering as it does under ``torch.autocast``."""

from __future__ import annotations

import pickle
import time
import warnings
from typing import Any

import torch
from torch import nn

import mixprec as amp
from helpers import count_casts, rel_error
from mixprec.convert.structure import forward_of

BF16 = torch.bfloat16


def _level(model: nn.Module, **pins: Any) -> nn.Module:
    return amp.auto_mixed_precision(model, "autocast", "bf16", **pins)


def _theirs(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    with torch.autocast("cpu", BF16):
        return model(*args, **kwargs)


class Cache(nn.Module):
    """Appends to a list argument (a KV cache) and draws random numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor] | None = None) -> torch.Tensor:
        h = self.fc(x) + 0.0 * torch.rand_like(x)
        if cache is not None:
            cache.append(h)
        return h


def test_conversion_runs_no_user_code() -> None:
    cache: list[torch.Tensor] = []
    model = Cache()
    torch.manual_seed(0)
    _level(model)
    after_conversion = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(3), after_conversion)  # the RNG stream is untouched
    converted = _level(model)
    x = torch.randn(2, 4)
    converted(x, cache)
    converted(x, cache)
    theirs: list[torch.Tensor] = []
    _theirs(model, x, theirs)
    assert len(cache) == 2  # updated on every call
    assert all(t.dtype == theirs[0].dtype for t in cache)


class Recurrent(nn.Module):
    """pytorch/examples word_language_model: the (h, c) state passed in a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(
        self, x: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        out, hidden = self.rnn(x, hidden)
        return self.head(out), hidden


def test_tensors_in_tuple_arguments_are_used_as_passed() -> None:
    torch.manual_seed(0)
    model = Recurrent()
    converted = _level(model)
    x = torch.randn(5, 1, 4)
    zeros = (torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    first, hidden = converted(x, zeros)
    again, _ = converted(x, tuple(h.float() for h in hidden))
    expected, _ = model(x, tuple(h.float() for h in model(x, zeros)[1]))
    assert not torch.equal(first, again)  # the state was read
    assert rel_error(again.float(), expected) < 5e-2


class MaskCache(nn.Module):
    """A mask kept in an attribute, rebuilt when the length changes; an attribute that
    is None at conversion and a list later."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.src_mask: torch.Tensor | None = None
        self.extra: list[float] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.src_mask is None or self.src_mask.size(0) != x.size(0):
            self.src_mask = torch.ones(x.size(0), 1)
        h = self.fc(x) * self.src_mask
        for value in self.extra or ():
            h = h + value
        return h


def test_state_read_at_each_call() -> None:
    model = MaskCache()
    converted = _level(model)
    assert converted(torch.randn(3, 4)).shape == (3, 4)
    assert converted(torch.randn(5, 4)).shape == (5, 4)
    converted.extra = [1.0, 2.0]
    x = torch.randn(2, 4)
    converted.extra, model.extra = [1.0, 2.0], [1.0, 2.0]
    assert rel_error(converted(x).float(), model(x)) < 3e-2


def test_children_replaced_after_conversion_are_honoured() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    converted = _level(model)
    converted[1] = nn.Tanh()
    x = torch.randn(2, 4)
    assert torch.equal(converted(x), _theirs(nn.Sequential(model[0], nn.Tanh()), x))


def test_every_module_answers_as_under_torch_autocast() -> None:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.BertConfig(
        vocab_size=32,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    model = tf.BertModel(cfg).eval()
    seen: dict[str, list[torch.dtype]] = {"ours": [], "theirs": []}

    def hook(key: str) -> Any:
        return lambda module, args, out: seen[key].append(out.dtype)

    converted = _level(model)
    layer = converted.encoder.layer[0]
    handles = [
        layer.attention.self.query.register_forward_hook(hook("ours")),
        layer.intermediate.dense.register_forward_hook(hook("ours")),
        model.encoder.layer[0].attention.self.query.register_forward_hook(hook("theirs")),
        model.encoder.layer[0].intermediate.dense.register_forward_hook(hook("theirs")),
    ]
    ids = torch.randint(0, 32, (1, 6))
    with torch.no_grad():  # the first call's grad mode changes nothing
        converted(ids)
    converted(ids)
    _theirs(model, ids)
    _theirs(model, ids)
    for handle in handles:
        handle.remove()
    assert seen["ours"] == seen["theirs"] == [BF16] * 4


def test_pickles_deep_models_and_max_pool() -> None:
    deep = nn.Sequential(*[nn.Sequential(nn.Linear(2, 2)) for _ in range(60)])
    cnn = nn.Sequential(nn.Conv2d(1, 2, 3), nn.MaxPool2d(2), nn.Flatten())
    for model, x in ((deep, torch.randn(1, 2)), (cnn, torch.randn(1, 1, 6, 6))):
        converted = _level(model)
        again = pickle.loads(pickle.dumps(converted))
        assert torch.equal(again(x), converted(x))


def test_fp32_pins_hold_under_an_outer_autocast_which_warns_once() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    converted = _level(model, fp32_modules=["1"])
    x = torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cpu", torch.float16):
            first = converted(x)
            converted(x)
    outer = [w for w in caught if "outer torch.autocast" in str(w.message)]
    assert len(outer) == 1
    assert first.dtype == torch.float32
    assert converted[0](x).dtype == BF16  # a direct submodule call enters the region


def test_orthogonal_parametrization_keeps_orgqr_in_float32() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    nn.utils.parametrizations.orthogonal(model[0])
    x = torch.randn(2, 4)
    out = _level(model)(x)
    assert torch.equal(out, _theirs(model, x))


def test_gradient_checkpointing_of_a_transformers_model() -> None:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.BartConfig(
        vocab_size=32,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=16,
        decoder_ffn_dim=16,
        max_position_embeddings=16,
    )
    model = tf.BartModel(cfg)
    model.gradient_checkpointing_enable()
    converted = _level(model)
    ids = torch.randint(3, 32, (1, 6))
    converted(input_ids=ids).last_hidden_state.float().sum().backward()
    assert all(p.grad is not None for p in model.encoder.layers[0].parameters())


def test_conversion_of_gpt2_small_is_fast() -> None:
    import transformers as tf

    model = tf.GPT2Model(tf.GPT2Config())
    start = time.perf_counter()
    _level(model)
    assert time.perf_counter() - start < 0.5


def test_compiles_with_no_more_graph_breaks_than_torch_autocast() -> None:
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.LayerNorm(4), nn.Linear(4, 2))
    converted = _level(model)
    x = torch.randn(2, 4)
    ours = torch._dynamo.explain(converted)(x)
    theirs = torch._dynamo.explain(lambda t: _theirs(model, t))(x)
    assert ours.graph_break_count <= theirs.graph_break_count
    compiled = torch.compile(converted, backend="eager")
    assert torch.equal(compiled(x), converted(x))
    _, counter = count_casts(converted, x)
    with torch.autocast("cpu", BF16):
        _, theirs_count = count_casts(model, x)
    assert counter.total == theirs_count.total


class _OwnAutocast(nn.Module):
    """Turns autocast off around its head (a numerically sensitive layer), and runs a
    pair of layers under a float16 autocast of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)
        self.pair = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.body(x)
        with torch.autocast("cpu", enabled=False):
            head = self.head(h.float())
        with torch.autocast("cpu", torch.float16):
            pair = self.pair(x)
        return h, head, pair


def test_a_torch_autocast_inside_the_forward_holds_for_its_children() -> None:
    model = _OwnAutocast()
    x = torch.randn(2, 4)
    ours, theirs = _level(model)(x), _theirs(model, x)
    assert [t.dtype for t in ours] == [t.dtype for t in theirs]
    assert [t.dtype for t in ours] == [BF16, torch.float32, torch.float16]
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    # a child called directly still enters the level's region
    assert _level(model).head(x).dtype == BF16


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on a GPU (what :func:`call_device` reads)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def test_the_region_is_the_device_the_call_runs_on() -> None:
    """The autocast region follows the model: its Parameters as they are at the call (a
    model converted on the CPU and moved to a GPU runs under CUDA's autocast), else the
    first tensor argument (a module without Parameters), else the conversion's device.
    (tests/test_cuda_levels.py checks the numerics on a GPU.)"""
    from mixprec.convert.autocast import call_device

    layer = nn.Linear(2, 2)
    cpu, gpu = torch.zeros(1), torch.zeros(1).as_subclass(_OnCuda)
    assert call_device(layer, layer.weight, (gpu,), {}, "cuda") == "cpu"  # Parameters first
    assert call_device(layer, gpu, (cpu,), {}, "cpu") == "cuda"
    empty = nn.ReLU()
    assert call_device(empty, None, (3, gpu), {}, "cpu") == "cuda"  # else the first tensor
    assert call_device(empty, None, (), {"x": gpu}, "cpu") == "cuda"
    assert call_device(empty, None, (2.0,), {}, "cuda") == "cuda"  # else the conversion's
    converted = amp.auto_mixed_precision(nn.Sequential(nn.Linear(2, 2)), "autocast", "bf16")
    assert forward_of(converted).probe is converted[0].weight
