"""explain(converted, *inputs) is exact: the casts a real forward makes, measured on fakes.

Every model and level: equal to what CastCounter counts in a real call with those inputs
(run-time parts included, a shared layer counted per call), and nothing real touched.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import mixprec as amp
from mixprec.cli import models as cli_models
from mixprec.inspect import CastCounter

LEVELS = ["O1", "autocast", "O2", "O3"]


class _Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(out)))


class _ResNet(nn.Module):
    """A ResNet in miniature: stem, two residual blocks, pooling, a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.blocks = nn.Sequential(_Residual(4), _Residual(4))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


def _tokens() -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, 32, (1, 6)),)


def _bert() -> tuple[nn.Module, tuple[Any, ...]]:
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=32, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=16,
    )  # fmt: skip
    return BertModel(config), _tokens()


def _gpt2() -> tuple[nn.Module, tuple[Any, ...]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=32, n_embd=8, n_layer=2, n_head=2, n_positions=16)
    return GPT2LMHeadModel(config), _tokens()


def _t5() -> tuple[nn.Module, tuple[Any, ...]]:
    from transformers import T5Config, T5Model

    config = T5Config(
        vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
        decoder_start_token_id=0,
    )  # fmt: skip
    ids = _tokens()[0]
    return T5Model(config), (ids, None, ids)  # input_ids, attention_mask, decoder_input_ids


def _albert() -> tuple[nn.Module, tuple[Any, ...]]:
    from transformers import AlbertConfig, AlbertModel

    config = AlbertConfig(
        vocab_size=32, embedding_size=8, hidden_size=8, num_hidden_layers=12,
        num_attention_heads=2, intermediate_size=16, max_position_embeddings=16,
    )  # fmt: skip
    return AlbertModel(config), _tokens()  # one shared layer, called 12 times


MODELS: dict[str, Callable[[], tuple[nn.Module, tuple[Any, ...]]]] = {
    "bert": _bert,
    "gpt2": _gpt2,
    "t5": _t5,
    "albert": _albert,
    "resnet": lambda: (_ResNet(), (torch.randn(2, 3, 8, 8),)),
    "lenet5": lambda: (cli_models.lenet5(), (torch.randn(1, 1, 32, 32),)),
    "mlp": lambda: (cli_models.TinyMLP(), (torch.randn(2, 16),)),
    "cnn": lambda: (cli_models.SmallCNN(channels=4), (torch.randn(2, 3, 8, 8),)),
    "transformer": lambda: (
        cli_models.TinyTransformer(dim=8, heads=2),
        (torch.randint(0, 50, (2, 6)),),
    ),
}


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", list(MODELS))
def test_explain_with_inputs_equals_the_casts_a_forward_makes(
    name: str, level: str, grad: bool
) -> None:
    """(Without gradients O1 takes a view of a low result as it is, where with gradients
    it casts the view: explain measures in the caller's grad mode.)"""
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model.eval()
    with warnings.catch_warnings(), torch.set_grad_enabled(grad):
        warnings.simplefilter("ignore")
        converted = amp.auto_mixed_precision(model, level, "bf16")
        with CastCounter() as counter:
            converted(*inputs)
    before, rng = _state(model), torch.random.get_rng_state()
    with torch.set_grad_enabled(grad):
        plan = amp.explain(converted, *inputs)
    assert plan.num_casts == counter.total, plan
    assert sum(len(row.casts_before) for row in plan.rows) == counter.total
    assert all(torch.equal(a, b) for a, b in zip(before, _state(model), strict=True))
    assert torch.equal(rng, torch.random.get_rng_state())


def test_a_shared_layer_is_counted_per_call() -> None:
    model, inputs = _albert()
    shared = "encoder.albert_layer_groups.0.albert_layers.0"
    converted = amp.auto_mixed_precision(model.eval(), "O2", "bf16", fp32_modules=[f"{shared}.ffn"])
    rows = {row.path: row.num_casts for row in amp.explain(converted, *inputs).rows}
    # the one shared layer's float32 Linear casts its input up and its output back on each
    # of 12 calls; its weights are read in float32 (no cast); the LayerNorm islands run as
    # one kernel on their low input (no cast on CPU)
    assert rows[f"{shared}.ffn"] == 24
    assert f"{shared}.attention.LayerNorm" not in rows


class _TouchesEverything(nn.Module):
    """A forward that writes its argument, its buffers (BatchNorm in training) and draws
    random numbers (dropout)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        state.add_(1.0)
        return self.drop(self.bn(self.fc(x)))


@pytest.mark.parametrize("level", LEVELS)
def test_explain_modifies_no_parameter_buffer_argument_or_rng(level: str) -> None:
    model = _TouchesEverything().train()
    converted = amp.auto_mixed_precision(model, level, "bf16")
    x, state = torch.randn(3, 4), torch.zeros(2)
    with CastCounter() as counter:
        converted(x.clone(), state.clone())
    before, rng = _state(model), torch.random.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (nothing read of a fake that has no data)
        plan = amp.explain(converted, x, state)
    assert plan.num_casts == counter.total
    assert torch.equal(state, torch.zeros(2))
    assert all(torch.equal(a, b) for a, b in zip(before, _state(model), strict=True))
    assert int(model.bn.num_batches_tracked) == 1  # the real call only
    assert torch.equal(rng, torch.random.get_rng_state())


def test_explain_without_inputs_keeps_the_static_view() -> None:
    converted = amp.auto_mixed_precision(cli_models.TinyMLP(), "O2", "bf16")
    plan = amp.explain(converted)
    assert plan.assumption == "each floating input is one float32 tensor"
    assert {row.kind.value for row in plan.rows} <= {"inputs", "weights", "island", "outputs"}


class _Cache:
    """A KV cache as transformers' ``DynamicCache`` holds one: an object, no container."""

    def __init__(self, first: torch.Tensor) -> None:
        self.keys = [first]


class _Appends(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: _Cache) -> torch.Tensor:
        h = self.fc(x)
        cache.keys.append(h)
        cache.keys[0].add_(1.0)
        return h + cache.keys[0]


@pytest.mark.parametrize("level", LEVELS)
def test_explain_leaves_an_object_argument_as_it_was(level: str) -> None:
    converted = amp.auto_mixed_precision(_Appends(), level, "bf16")
    x = torch.randn(2, 4)
    first = torch.zeros(2, 4)
    cache = _Cache(first)
    with CastCounter() as counter:
        converted(x, _Cache(first.clone()))
    assert amp.explain(converted, x, cache).num_casts == counter.total
    assert len(cache.keys) == 1
    assert cache.keys[0] is first
    assert torch.equal(first, torch.zeros(2, 4))


def test_explain_leaves_a_transformers_kv_cache_as_it_was() -> None:
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
    converted = amp.auto_mixed_precision(tf.GPT2LMHeadModel(config).eval(), "O2", "bf16")
    ids = torch.randint(0, 32, (1, 4))
    cache = tf.DynamicCache(config=config)
    with torch.no_grad():
        converted(ids, past_key_values=cache, use_cache=True)
        amp.explain(converted, ids[:, :1], past_key_values=cache, use_cache=True)
        assert cache.get_seq_length() == 4
        layer = cache.layers[0]
        assert type(layer.keys) is torch.Tensor
        converted(ids[:, :1], past_key_values=cache, use_cache=True)  # still real
    assert cache.get_seq_length() == 5
