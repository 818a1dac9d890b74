"""A forward that updates Parameters (a momentum encoder's EMA, MoCo-style) at O2/O3,
where reading a Parameter inside the forward gives its low-precision cast:
``mixprec.float32_parameters`` makes the update in float32, as on the original; without it
the update still reaches the Parameter (rounded) and a warning says so."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import mixprec as amp

STYLES = ["data", "in_place", "lerp", "foreach"]


class _MomentumEncoder(nn.Module):
    """MoCo's key encoder: an EMA of the query encoder, updated at each forward."""

    def __init__(self, style: str, wrap: bool) -> None:
        super().__init__()
        self.q = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
        self.k = copy.deepcopy(self.q)
        for p in self.k.parameters():
            p.requires_grad_(False)
        with torch.no_grad():
            for p in self.k.parameters():
                p.add_(torch.randn_like(p) * 0.3)
        self.m = 0.999
        self.style, self.wrap = style, wrap

    @torch.no_grad()
    def _momentum_update(self) -> None:
        pairs = list(zip(self.q.parameters(), self.k.parameters(), strict=True))
        for q, k in pairs:
            if self.style == "data":  # MoCo's own code
                k.data = k.data * self.m + q.data * (1.0 - self.m)
            elif self.style == "in_place":
                k.mul_(self.m).add_(q, alpha=1.0 - self.m)
            elif self.style == "lerp":
                k.lerp_(q, 1.0 - self.m)
        if self.style == "foreach":
            torch._foreach_lerp_([k for _, k in pairs], [q for q, _ in pairs], 1.0 - self.m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = self.k(x)  # the key encoder's weights are cast before the update
        if self.wrap:
            with amp.float32_parameters(self):
                self._momentum_update()
        else:
            self._momentum_update()
        return self.q(x) + self.k(x) - first


def _run(model: nn.Module, steps: int = 5) -> torch.Tensor:
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    out = x
    for _ in range(steps):
        out = model(x)
    return out


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("level", ["O2", "O3"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_an_update_under_float32_parameters_is_the_originals_bit_for_bit(
    style: str, level: str, dtype: str
) -> None:
    torch.manual_seed(0)
    original = _MomentumEncoder(style, wrap=True)
    reference = copy.deepcopy(original)
    converted = amp.auto_mixed_precision(original, level, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of a low update
        out = _run(converted)
    want = _run(reference)
    for mine, theirs in zip(original.k.parameters(), reference.k.parameters(), strict=True):
        assert mine.dtype == torch.float32
        assert torch.equal(mine, theirs)  # the EMA made in float32
    torch.testing.assert_close(out, want, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_an_update_of_the_casts_reaches_the_parameters_and_is_warned_of(
    style: str, level: str
) -> None:
    torch.manual_seed(0)
    original = _MomentumEncoder(style, wrap=False)
    before = [p.detach().clone() for p in original.k.parameters()]
    converted = amp.auto_mixed_precision(original, level, "bf16")
    with pytest.warns(UserWarning, match=r"float32_parameters\(module\)") as caught:
        _run(converted, steps=1)
    assert "bfloat16 cast" in str(caught[0].message)
    # the first weight moved (``.data = ...`` moves no version counter: it was lost before);
    # rounded to bfloat16, some of the other, smaller updates are lost: what the warning says
    assert not torch.equal(next(original.k.parameters()), before[0])


def test_a_write_into_a_weight_by_name_is_not_warned_of() -> None:
    class Pins(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.fc.weight[0].fill_(0.5)  # an exact write
            return self.fc(x)

    model = Pins()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp.auto_mixed_precision(model, "O2", "bf16")(torch.randn(2, 4))
    assert torch.equal(model.fc.weight[0], torch.full((4,), 0.5))


class _WritesThenReads(nn.Module):
    """Writes a weight through its cast, then reads the Parameter under the block, which
    calls a submodule too."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.fc.bias.fill_(2.0)  # into the cast
        with amp.float32_parameters(self):
            self.seen.append(self.fc.bias.dtype)
            total = self.fc.bias.sum()  # the write is in the Parameter already
            inner = self.fc(x)  # a module called in the block: its own entry
        self.seen.append(self.fc.bias.dtype)
        return self.fc(x) + total + inner


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_the_block_reads_the_parameters_with_earlier_writes_and_casts_afresh_after(
    level: str,
) -> None:
    torch.manual_seed(0)
    model = _WritesThenReads()
    converted = amp.auto_mixed_precision(model, level, "bf16")
    x = torch.randn(2, 4)
    out = converted(x)
    assert model.seen == [torch.float32, torch.bfloat16]
    assert out.dtype == torch.float32
    reference = copy.deepcopy(model)
    torch.testing.assert_close(out, reference(x), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("level", ["O0", "O1", "autocast"])
def test_float32_parameters_changes_nothing_where_forward_reads_the_parameters(
    level: str,
) -> None:
    torch.manual_seed(0)
    original = _MomentumEncoder("in_place", wrap=True)
    reference = copy.deepcopy(original)
    converted = amp.auto_mixed_precision(original, level, "bf16")
    _run(converted)
    _run(reference)
    for mine, theirs in zip(original.k.parameters(), reference.k.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_float32_parameters_outside_a_call_and_on_a_bad_argument() -> None:
    model = nn.Linear(2, 2)
    converted = amp.auto_mixed_precision(model, "O2", "bf16")
    with amp.float32_parameters(converted):
        assert converted.weight is model.weight  # outside a call: the Parameter anyway
    with pytest.raises(TypeError, match="module must be an nn.Module, got Parameter"):
        amp.float32_parameters(model.weight)  # type: ignore[arg-type]
