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
