"""The one answer to "what does this module compute in": ``Recipe.module_precision``.

A table pins it per level for a model holding every kind of module the policy treats
apart (white list, black list, recurrent, pinned float32 and low, a pin inside a pin, a
declared float32 module, a parametrization); conversion, FSDP2's units and ``decide``
are checked against the same answers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import mixprec
from mixprec.convert.declared import with_declared_pins
from mixprec.convert.structure import user_class
from mixprec.policy.levels import Precision, Recipe, resolve

L, F, W = Precision.LOW, Precision.FP32, Precision.FOLLOW


class _Symmetric(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + w.t()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))


class _Declares(nn.Module):
    _keep_in_fp32_modules_strict = ("wo",)

    def __init__(self) -> None:
        super().__init__()
        self.wo = nn.Linear(4, 4)
        self.wi = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wi(self.wo(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.bn = nn.BatchNorm1d(4)
        self.ln = nn.LayerNorm(4)
        self.gru = nn.GRU(4, 4)
        self.pinned = _Block()
        self.lowpin = _Block()
        self.ff = _Declares()
        self.par = nn.Linear(4, 4)
        parametrize.register_parametrization(self.par, "weight", _Symmetric())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln(self.bn(self.act(self.lin(x))))
        x = self.gru(x)[0]
        return self.par(self.ff(self.lowpin(self.pinned(x))))


PINS: dict[str, Any] = {"fp32_modules": ["pinned"], "low_modules": ["lowpin", "pinned.act"]}
PAR = ("par.parametrizations.weight", "par.parametrizations.weight.0")

#: level -> module -> precision (``par.parametrizations``, a ModuleDict, follows ``par``).
TABLE: dict[str, dict[str, Precision]] = {
    "O0": {
        **dict.fromkeys(["", "lin", "act", "bn", "ln", "gru", "pinned", "pinned.lin"], F),
        **dict.fromkeys(["pinned.act", "lowpin", "lowpin.lin", "lowpin.act"], F),
        **dict.fromkeys(["ff", "ff.wo", "ff.wi", "par", "par.parametrizations", *PAR], F),
    },
    "O1": {
        "": W, "lin": L, "act": W, "bn": W, "ln": W, "gru": L,
        "pinned": F, "pinned.lin": F, "pinned.act": L,
        "lowpin": L, "lowpin.lin": L, "lowpin.act": L,
        "ff": W, "ff.wo": F, "ff.wi": L,
        "par": L, "par.parametrizations": L, PAR[0]: F, PAR[1]: F,
    },
    "O2": {
        "": L, "lin": L, "act": L, "bn": F, "ln": F, "gru": L,
        "pinned": F, "pinned.lin": F, "pinned.act": L,
        "lowpin": L, "lowpin.lin": L, "lowpin.act": L,
        "ff": L, "ff.wo": F, "ff.wi": L,
        "par": L, "par.parametrizations": L, PAR[0]: F, PAR[1]: F,
    },
    "O3": {
        "": L, "lin": L, "act": L, "bn": L, "ln": L, "gru": L,
        "pinned": F, "pinned.lin": F, "pinned.act": L,
        "lowpin": L, "lowpin.lin": L, "lowpin.act": L,
        "ff": L, "ff.wo": F, "ff.wi": L,
        "par": L, "par.parametrizations": L, PAR[0]: F, PAR[1]: F,
    },
    "autocast": {
        "": W, "lin": W, "act": W, "bn": W, "ln": W, "gru": L,
        "pinned": F, "pinned.lin": F, "pinned.act": L,
        "lowpin": L, "lowpin.lin": L, "lowpin.act": L,
        "ff": W, "ff.wo": F, "ff.wi": W,
        "par": W, "par.parametrizations": W, PAR[0]: F, PAR[1]: F,
    },
}  # fmt: skip


def _recipe(net: nn.Module, level: str, **options: Any) -> Recipe:
    return with_declared_pins(net, resolve(net, level, "bf16", **{**PINS, **options}))


@pytest.mark.parametrize("level", list(TABLE))
def test_module_precision_per_level(level: str) -> None:
    net = _Net()
    assert _recipe(net, level).module_precisions(net) == TABLE[level]


def test_a_custom_black_list_and_keep_batchnorm_fp32() -> None:
    net = _Net()
    custom = _recipe(net, "O2", black_list=[_Block]).module_precisions(net)
    assert (custom["bn"], custom["ln"], custom["lowpin"], custom["lowpin.lin"]) == (L, L, L, L)
    assert (custom["pinned"], custom["pinned.act"]) == (F, L)  # the pins beat the list
    none = _recipe(net, "O2", keep_batchnorm_fp32=False).module_precisions(net)
    assert (none["bn"], none["ln"]) == (L, L)
    kept = _recipe(net, "O3", keep_batchnorm_fp32=True).module_precisions(net)
    assert (kept["bn"], kept["ln"], kept["lin"]) == (F, F, L)


def test_declared_fp32_depends_on_the_dtype() -> None:
    class Fp16Only(_Declares):
        _keep_in_fp32_modules_strict = ()
        _keep_in_fp32_modules = ("wo",)

    net = nn.Sequential(Fp16Only())
    for dtype, expected in (("bf16", L), ("fp16", F)):
        recipe = with_declared_pins(net, resolve(net, "O2", dtype))
        assert recipe.module_precision(net[0].wo, "0.wo", L) is expected


def test_a_root_pin_and_a_module_filter() -> None:
    net = _Net()
    root = _recipe(net, "O2", fp32_modules=[""], low_modules=["lin"]).module_precisions(net)
    assert (root[""], root["act"], root["gru"], root["lin"]) == (F, F, F, L)
    by_class = _recipe(net, "O3", fp32_modules=lambda m, _: isinstance(m, nn.GRU))
    assert by_class.module_precision(net.gru, "gru", L) is F


@pytest.mark.parametrize("level", ["O1", "autocast"])
def test_graph_levels_agree_with_decide_for_module_calls(level: str) -> None:
    net = _Net()
    recipe = _recipe(net, level)
    answers = recipe.module_precisions(net)
    scopes: dict[str, tuple[tuple[str, nn.Module], ...]] = {"": (("", net),)}
    for path, module in net.named_modules():
        if path:
            parent = path.rpartition(".")[0]
            scopes[path] = (*scopes[parent], (path, module))
        if isinstance(module, parametrize.ParametrizationList) or any(
            isinstance(m, parametrize.ParametrizationList) for _, m in scopes[path]
        ):
            continue  # decide() knows ops, not where a parametrization's inputs come from
        assert recipe.decide(None, scopes[path]) is answers[path], path


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_conversion_computes_what_the_policy_says(
    level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each module's own ``forward`` receives its inputs in the dtype the policy gives it
    (a norm whose kernel computes in float32 from a low input receives it low)."""
    from mixprec.convert.cast_at_use import fused_island

    net = _Net()
    answers = _recipe(net, level).module_precisions(net)
    converted = mixprec.auto_mixed_precision(net, level, "bf16", **PINS)
    names = {id(m): p for p, m in converted.named_modules()}
    # (a recurrent layer runs on a per-call view of itself, which shares its tables)
    tables = {id(m._parameters): p for p, m in converted.named_modules()}
    seen: dict[str, torch.dtype] = {}

    def recording(forward: Any) -> Any:
        def record(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            path = names.get(id(module)) or tables.get(id(module._parameters))
            if path and args and isinstance(args[0], torch.Tensor):
                seen.setdefault(path, args[0].dtype)
            return forward(module, *args, **kwargs)

        return record

    modules = dict(net.named_modules())
    fused = {
        path
        for path in modules
        if fused_island(modules[path])
        and answers[path] is F
        and answers[path.rpartition(".")[0]] is L
    }
    for cls in {user_class(m) for m in converted.modules()}:
        monkeypatch.setattr(cls, "forward", recording(cls.forward))
    converted(torch.randn(3, 4))
    expected_dtype = {L: torch.bfloat16, F: torch.float32}
    assert fused == ({"bn", "ln"} if level == "O2" else set())
    expected = {path: expected_dtype[answers[path]] for path in seen}
    assert seen == {**expected, **dict.fromkeys(fused, torch.bfloat16)}
    called = set(answers) - {"", "par.parametrizations", "par.parametrizations.weight"}
    assert set(seen) == called


def test_fsdp2_units_follow_the_policy() -> None:
    pytest.importorskip("torch.distributed.fsdp")
    from mixprec.distributed.shard import _units

    net = _Net()
    recipe = _recipe(net, "O2")
    answers = recipe.module_precisions(net)
    names = {id(m): p for p, m in net.named_modules()}
    units = {names[id(m)]: policy.param_dtype for m, policy in _units(net, recipe, None)}
    islands = {p for p, a in answers.items() if a is F and answers[p.rpartition(".")[0]] is L}
    assert {p for p, d in units.items() if d == torch.float32} == islands
