"""Third-party model code at O2/O3 on the mode-free hot path, adapted in a few lines.

nanoGPT's attention without flash (a float32 ``tril`` buffer as the causal mask, softmax and
``att @ v`` in the block's own code) and pytorch/examples' ``word_language_model``
(``TransformerModel``: a float32 positional-encoding buffer added to the embeddings, a float32
square mask built in ``forward``; ``RNNModel``: float32 zero states from ``init_hidden``).
Each trains a few steps through ``build_train_network`` with a loss within bf16 tolerance of
float32, and its forward stays close to the float32 model's.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as amp

LEVELS = ["O2", "O3"]
VOCAB, WIDTH, LENGTH, BATCH = 32, 16, 8, 2


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention (model.py), the path without flash attention."""

    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH)
        self.c_proj = nn.Linear(WIDTH, WIDTH)
        self.n_head = 2
        self.register_buffer(
            "bias", torch.tril(torch.ones(LENGTH, LENGTH)).view(1, 1, LENGTH, LENGTH)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(WIDTH, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(WIDTH), CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's GPT, shrunk: ``forward(idx, targets)`` returns ``(logits, loss)``."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(LENGTH, WIDTH)
        self.h = nn.ModuleList([Block() for _ in range(2)])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


class PositionalEncoding(nn.Module):
    """word_language_model's, with its float32 ``pe`` buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.dropout = nn.Dropout(0.0)
        position = torch.arange(LENGTH).unsqueeze(1)
        div = torch.exp(torch.arange(0, WIDTH, 2) * (-math.log(10000.0) / WIDTH))
        pe = torch.zeros(LENGTH, 1, WIDTH)
        pe[:, 0, 0::2] = torch.sin(position * div)
        pe[:, 0, 1::2] = torch.cos(position * div)
        self.register_buffer("pe", pe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(x + self.pe[: x.size(0), :])


class TransformerModel(nn.Module):
    """word_language_model's ``TransformerModel`` (sequence-first), its mask made in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.pos_encoder = PositionalEncoding()
        layer = nn.TransformerEncoderLayer(WIDTH, 2, 32, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.decoder = nn.Linear(WIDTH, VOCAB)

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        mask = torch.log(torch.tril(torch.ones(len(src), len(src))))  # float32, -inf above
        src = self.pos_encoder(self.embedding(src) * math.sqrt(WIDTH))
        return F.log_softmax(self.decoder(self.encoder(src, mask)), dim=-1)


class RNNModel(nn.Module):
    """word_language_model's ``RNNModel`` (LSTM), the state from ``init_hidden``."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, WIDTH)
        self.rnn = nn.LSTM(WIDTH, WIDTH, 2)
        self.decoder = nn.Linear(WIDTH, VOCAB)

    def forward(
        self, src: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        output, hidden = self.rnn(self.encoder(src), hidden)
        return F.log_softmax(self.decoder(output), dim=-1), hidden

    def init_hidden(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        weight = next(self.parameters())
        return weight.new_zeros(2, batch, WIDTH), weight.new_zeros(2, batch, WIDTH)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randint(0, VOCAB, (LENGTH, BATCH)), torch.randint(0, VOCAB, (LENGTH, BATCH))


@pytest.mark.parametrize("level", LEVELS)
def test_nanogpt_trains_and_matches_float32(level: str) -> None:
    torch.manual_seed(0)
    model = GPT()
    idx, targets = (t.T.contiguous() for t in _data())
    _, control = model(idx, targets)
    step = amp.build_train_network(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), level=level, dtype="bf16",
        output_loss=1,
    )  # fmt: skip
    losses = [step(idx, targets).item() for _ in range(4)]
    assert abs(losses[0] - control.item()) <= 0.02 * control.item()
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("level", LEVELS)
def test_word_language_transformer_trains_and_matches_float32(level: str) -> None:
    torch.manual_seed(0)
    model = TransformerModel()
    src, targets = _data()
    control = F.nll_loss(model(src).view(-1, VOCAB), targets.view(-1))
    converted = amp.auto_mixed_precision(model, level, "bf16")
    out = converted(src)
    assert out.dtype == torch.float32
    assert converted.pos_encoder.pe.dtype == torch.float32
    torch.testing.assert_close(out, model(src), rtol=0.05, atol=0.1)

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.nll_loss(output.view(-1, VOCAB), target.view(-1))

    step = amp.build_train_network(
        model, torch.optim.SGD(model.parameters(), lr=0.5), loss_fn, level, dtype="bf16"
    )
    losses = [step(src, targets).item() for _ in range(4)]
    assert abs(losses[0] - control.item()) <= 0.02 * control.item()
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("level", LEVELS)
def test_word_language_lstm_carries_its_state(level: str) -> None:
    torch.manual_seed(0)
    model = RNNModel()
    src, _ = _data()
    converted = amp.auto_mixed_precision(model, level, "bf16")
    hidden = model.init_hidden(BATCH)  # float32 zeros, outside any call
    assert hidden[0].dtype == torch.float32
    out, hidden = converted(src, hidden)
    again, _ = converted(src, hidden)  # the state from the first call is used
    ref, ref_hidden = model(src, model.init_hidden(BATCH))
    ref_again, _ = model(src, ref_hidden)
    assert hidden[0].dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0.05, atol=0.05)
    torch.testing.assert_close(again, ref_again, rtol=0.05, atol=0.05)
    assert not torch.allclose(again, out, atol=1e-3)  # the state changed the output
