"""What the step gives a training loop: the network's last output, and the loss found in
tuple, dict and object outputs (or a clear error saying how to name it)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as amp


class _LogitsAndLoss(nn.Module):
    """Returns ``(logits, loss)``, as nanoGPT does; the label comes in as an input."""

    def __init__(self, form: str = "tuple") -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.form = form

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        logits = self.fc(x)
        loss = F.cross_entropy(logits.float(), y)
        if self.form == "dict":
            return {"logits": logits, "total": loss}
        if self.form == "logits":
            return (logits, logits)
        return (logits, loss)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


def _build(model: nn.Module, **kwargs: Any) -> amp.TrainStep:
    return amp.build_train_network(
        model, torch.optim.SGD(model.parameters(), lr=0.1), level="O2", **kwargs
    )


def test_a_tuple_with_the_loss_second_needs_output_loss_and_says_so() -> None:
    torch.manual_seed(0)
    step = _build(_LogitsAndLoss())
    x, y = _batch()
    with pytest.raises(TypeError, match=r"output_loss=<index>\) \(e.g. output_loss=1"):
        step(x, y)
    torch.manual_seed(0)
    model = _LogitsAndLoss()
    step = _build(model, output_loss=1)
    loss = step(x, y)
    assert loss.dtype == torch.float32
    assert step.optimizer_steps == 1
    logits, own_loss = step.last_output
    assert logits.shape == (4, 3)
    assert not logits.requires_grad
    assert torch.equal(own_loss.float(), loss)


def test_a_dict_output_by_key_and_a_bad_key_named() -> None:
    x, y = _batch()
    step = _build(_LogitsAndLoss("dict"), output_loss="total")
    step(x, y)
    assert set(step.last_output) == {"logits", "total"}
    step = _build(_LogitsAndLoss("dict"), output_loss="loss")
    with pytest.raises(ValueError, match="output_loss='loss'.*keys \\['logits', 'total'\\]"):
        step(x, y)


def test_an_output_without_a_scalar_is_refused_with_what_it_holds() -> None:
    step = _build(_LogitsAndLoss("logits"))
    x, y = _batch()
    with pytest.raises(TypeError, match="tuple of \\(a float32 tensor of shape \\(4, 3\\)"):
        step(x, y)


def test_last_output_with_a_loss_fn_is_the_network_output() -> None:
    model = nn.Linear(6, 3)
    step = _build(model, loss_fn=nn.CrossEntropyLoss())
    assert step.last_output is None
    x, y = _batch()
    step(x, y)
    assert step.last_output.shape == (4, 3)
    assert not step.last_output.requires_grad


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (True, TypeError, "output_loss must be an index"),
        (1.0, TypeError, "output_loss must be an index"),
    ],
)
def test_bad_output_loss_is_refused(value: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        _build(_LogitsAndLoss(), output_loss=value)


def test_output_loss_with_a_loss_fn_is_refused() -> None:
    with pytest.raises(ValueError, match="pass one of them"):
        _build(nn.Linear(6, 3), loss_fn=nn.CrossEntropyLoss(), output_loss=0)


class _OwnLoss(nn.Module):
    """Computes its own loss from its labels and returns an object with ``.loss``, as a
    transformers model given ``labels`` does (without upcasting the logits itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.loss_dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = self.fc(x)
        if labels is None:
            return logits
        loss = F.cross_entropy(logits, labels)
        self.loss_dtypes.append(loss.dtype)
        return type("Output", (), {"loss": loss, "logits": logits})()


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_model_computing_its_own_loss_computes_it_in_float32(level: str) -> None:
    x, y = _batch()
    own, given = _OwnLoss(), _OwnLoss()
    given.load_state_dict(own.state_dict())
    control = F.cross_entropy(own(x), y)  # float32
    by_model = amp.build_train_network(
        own, torch.optim.SGD(own.parameters(), lr=0.1), level=level, dtype="bf16"
    )(x, labels=y)
    by_step = amp.build_train_network(
        given, torch.optim.SGD(given.parameters(), lr=0.1), nn.CrossEntropyLoss(), level,
        dtype="bf16",
    )(x, y)  # fmt: skip
    assert own.loss_dtypes == [torch.float32]
    assert torch.equal(by_model, by_step)  # the same bf16 logits, the same float32 loss
    torch.testing.assert_close(by_model, control, rtol=2e-2, atol=0)


@pytest.mark.parametrize("level", ["O2", "O3"])
@pytest.mark.parametrize("pin", [[""], lambda module, name: name == ""])
def test_a_root_pinned_to_float32_keeps_outputs_and_loss_float32(level: str, pin: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 3))
    x, y = _batch()
    logits = model(x)
    control = F.cross_entropy(logits, y)
    converted = amp.auto_mixed_precision(model, level, "bf16", fp32_modules=pin)
    assert torch.equal(converted(x), logits)  # bit for bit: nothing is rounded to bf16
    step = amp.build_train_network(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), level,
        dtype="bf16", fp32_modules=pin,
    )  # fmt: skip
    assert torch.equal(step.network(x), logits)
    assert torch.equal(step(x, y), control)
    assert step.last_output.dtype == torch.float32


def test_step_and_network_train_and_eval_agree() -> None:
    model = nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.5), nn.Linear(6, 3))
    step = _build(nn.Sequential(model), dtype="bf16")
    assert step.training
    assert step.network.training
    step.network.eval()
    assert not step.training
    assert not step.network[0][1].training
    step.train()
    assert step.training
    assert step.network[0][1].training
    step.eval()
    assert not step.network.training
    assert not step.network[0][1].training
    step.training = True
    assert step.network.training


def test_a_transformers_model_given_labels_computes_its_loss_in_float32() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=16, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config)
    ids, labels = torch.randint(0, 32, (2, 6)), torch.tensor([0, 2])
    control = model(input_ids=ids, labels=labels).loss  # float32
    step = amp.build_train_network(
        model, torch.optim.SGD(model.parameters(), lr=0.0), level="O2", dtype="bf16"
    )
    loss = step(input_ids=ids, labels=labels)
    logits = step.last_output.logits  # the bf16 logits, returned as float32
    assert torch.equal(loss, F.cross_entropy(logits, labels))  # computed on them in float32
    torch.testing.assert_close(loss, control.detach(), rtol=2e-2, atol=0)
