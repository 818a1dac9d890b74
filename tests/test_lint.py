"""lint: each planted setting found, nothing on clean models; the lint CLI commands."""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec
from conftest import NATIVE_BF16, fake_cpu
from helpers import MLP
from mixprec.cli.diagnose import add_commands
from mixprec.cli.plan import PlanError
from mixprec.cli.planted import HandRMSNorm, MaskedAttention
from mixprec.diagnose import FindingKind


def kinds(report: mixprec.LintReport) -> list[tuple[FindingKind, str]]:
    return [(f.kind, f.place) for f in report]


def test_large_mask_constants_in_fp16() -> None:
    model = nn.Sequential(MaskedAttention(), nn.Linear(8, 2))
    report = mixprec.lint(model, dtype="fp16")
    assert kinds(report) == [
        (FindingKind.LARGE_CONSTANT, "0 (MaskedAttention) buffer 'mask'"),
        (FindingKind.LARGE_CONSTANT, "0 (MaskedAttention) attribute 'fill'"),
    ]
    assert "1e+09" in report.findings[0].problem
    assert "torch.finfo" in report.findings[0].fix
    assert len(mixprec.lint(model, dtype="bf16")) == 0  # bfloat16 has the range
    assert len(mixprec.lint(model, dtype="fp16", fp32_modules=["0"])) == 0  # kept in fp32
    assert len(mixprec.lint(model, level="O1", dtype="fp16")) == 0  # mask added in fp32


def test_adam_eps_with_fp16_state_but_not_with_master_weights() -> None:
    model = MLP()
    adam = torch.optim.Adam(model.parameters(), eps=1e-8)
    report = mixprec.lint(model, adam, dtype="fp16", master_weights=False)
    assert [f.kind for f in report] == [FindingKind.OPTIMIZER_EPS]
    assert report.findings[0].place == "Adam param group 0 (from net.0.weight)"
    assert "eps=1e-08 is below float16's smallest normal" in report.findings[0].problem
    assert len(mixprec.lint(model, adam, dtype="fp16")) == 0  # masters: state in float32
    assert len(mixprec.lint(model, adam, dtype="bf16", master_weights=False)) == 0
    safe = torch.optim.Adam(model.parameters(), eps=1e-4)
    assert len(mixprec.lint(model, safe, dtype="fp16", master_weights=False)) == 0
    half = MLP().half()  # float16 parameters: float16 state whatever the level
    report = mixprec.lint(half, torch.optim.AdamW(half.parameters()), level="O1", dtype="fp16")
    assert [f.kind for f in report] == [FindingKind.OPTIMIZER_EPS]


def test_norm_eps_that_underflows_where_it_runs() -> None:
    model = nn.Sequential(nn.Linear(8, 8), HandRMSNorm(8), nn.LayerNorm(8, eps=1e-12))
    report = mixprec.lint(model, dtype="fp16")
    assert kinds(report) == [(FindingKind.NORM_EPS, "1 (HandRMSNorm)")]
    assert "fp32_modules=['1']" in report.findings[0].fix
    assert len(mixprec.lint(model, dtype="fp16", fp32_modules=["1"])) == 0
    # torch's LayerNorm computes in float32 inside: no alarm even at O3, where it runs low
    assert kinds(mixprec.lint(model, level="O3", dtype="fp16")) == kinds(report)
    fine = nn.Sequential(nn.Linear(8, 8), HandRMSNorm(8, eps=1e-3))
    assert len(mixprec.lint(fine, dtype="fp16")) == 0


def test_fixed_loss_scale_beyond_fp16() -> None:
    model = MLP()
    fixed = mixprec.FixedLossScaleManager(2.0**17)
    report = mixprec.lint(model, dtype="fp16", loss_scale_manager=fixed)
    assert kinds(report) == [(FindingKind.LOSS_SCALE, "FixedLossScaleManager")]
    dynamic = mixprec.DynamicLossScaleManager()  # 2**24, but it backs off
    assert len(mixprec.lint(model, dtype="fp16", loss_scale_manager=dynamic)) == 0
    assert len(mixprec.lint(model, dtype="bf16", loss_scale_manager=fixed)) == 0


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_clean_transformers_models_report_nothing(level: str) -> None:
    transformers = pytest.importorskip("transformers")
    models = [
        transformers.BertModel(
            transformers.BertConfig(
                vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=64, max_position_embeddings=16,
            )
        ),
        transformers.T5Model(
            transformers.T5Config(
                vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2
            )
        ),
    ]  # fmt: skip
    for model in models:
        adam = torch.optim.AdamW(model.parameters())
        report = mixprec.lint(model, adam, level=level, dtype="fp16")
        assert len(report) == 0, str(report)
        assert str(report) == f"lint: level {level}, float16: no findings"


def test_auto_mixed_precision_lint_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpu(monkeypatch, NATIVE_BF16)  # bf16 native: no slow-dtype warning in the strict block
    model = nn.Sequential(MaskedAttention(), nn.Linear(8, 2))
    with pytest.warns(UserWarning, match=r"mixprec lint: \[large constant\] 0 \(MaskedAttention\)"):
        mixprec.auto_mixed_precision(model, "O2", "fp16", lint=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mixprec.auto_mixed_precision(model, "O2", "fp16")
        mixprec.auto_mixed_precision(model, "O2", "bf16", lint=True)


def test_report_to_dict() -> None:
    report = mixprec.lint(nn.Sequential(MaskedAttention()), dtype="fp16")
    data = json.loads(json.dumps(report.to_dict()))
    assert data["dtype"] == "float16"
    assert data["findings"][0]["kind"] == "large constant"


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer or None; got 3"):
        mixprec.lint(MLP(), 3)
    with pytest.raises(TypeError, match="master_weights must be a bool; got 'yes'"):
        mixprec.lint(MLP(), master_weights="yes")
    with pytest.raises(ValueError, match="level must be one of"):
        mixprec.lint(MLP(), level="O9")
    with pytest.raises(
        TypeError, match=r"loss_scale_manager must be a LossScaleManager .* got int: 3"
    ):
        mixprec.lint(MLP(), loss_scale_manager=3)
    scaler = mixprec.training.scaling.StaticLossScaler(2.0**17)
    assert kinds(mixprec.lint(MLP(), dtype="fp16", loss_scale_manager=scaler)) == [
        (FindingKind.LOSS_SCALE, "StaticLossScaler")
    ]


def test_a_norm_too_large_to_run_is_judged_by_its_eps() -> None:
    huge = nn.LayerNorm((2**20, 2**20), eps=1e-9, elementwise_affine=False)  # 2**40 features
    report = mixprec.lint(nn.Sequential(nn.Linear(4, 4), huge), level="O3", dtype="fp16")
    assert kinds(report) == [(FindingKind.NORM_EPS, "1 (LayerNorm)")]
    assert str(report).startswith("lint: level O3, float16: 1 finding\n")


# ---------------------------------------------------------------------- command line
FACTORY = """
import torch
from torch import nn

class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.fill = -1e9

    def forward(self, x):
        return self.fc(x)

def masked():
    return Masked()

def exploding():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    with torch.no_grad():
        model[0].weight.mul_(1e6)
    return model
"""


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    parser = argparse.ArgumentParser(prog="mixprec")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    assert args.handler(args) == 0
    return capsys.readouterr().out


def test_cli_lint_and_find_overflow(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "models.py"
    path.write_text(FACTORY)
    out = run(["lint", f"{path}:masked", "--dtype", "fp16"], capsys)
    assert "lint: level O2, float16: 1 finding" in out
    assert "attribute 'fill'" in out
    out = run(["lint", f"{path}:masked", "--dtype", "fp16", "--optimizer", "adam",
               "--no-master-weights", "--json"], capsys)  # fmt: skip
    assert [f["kind"] for f in json.loads(out)["findings"]] == ["optimizer eps", "large constant"]

    out = run(["find-overflow", f"{path}:exploding", "--input", "3,4", "--dtype", "fp16"], capsys)
    assert "inf in the output of 0 (float16), made by 0 (Linear)" in out
    out = run(
        ["find-overflow", f"{path}:exploding", "--input", "3,4", "--dtype", "bf16", "--json"],
        capsys,
    )
    assert json.loads(out)["found"] is False


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "models.py"
    path.write_text(FACTORY)
    parser = argparse.ArgumentParser(prog="mixprec")
    add_commands(parser.add_subparsers(dest="command", required=True))
    for argv, match in [
        (["lint", f"{path}:masked", "--level", "O7"], "level must be one of"),
        (["lint", f"{path}:masked", "--eps", "1e-8"], "--eps needs --optimizer"),
        (["find-overflow", f"{path}:masked"], "give at least one --input"),
        (["find-overflow", f"{path}:nothing", "--input", "2,4"], "has no attribute 'nothing'"),
    ]:
        args = parser.parse_args(argv)
        with pytest.raises(PlanError, match=match):
            args.handler(args)


def test_cli_module_does_not_import_rich() -> None:
    """The core install has only torch: the module and what it imports run without rich
    (the package's own ``__init__`` is bypassed: it is the command line's business)."""
    import subprocess
    import sys

    code = (
        "import sys, types, pathlib, mixprec\n"
        "sys.modules['rich'] = None\n"  # any import of rich now fails
        "cli = types.ModuleType('mixprec.cli')\n"
        "cli.__path__ = [str(pathlib.Path(mixprec.__file__).parent / 'cli')]\n"
        "sys.modules['mixprec.cli'] = cli\n"
        "import mixprec.cli.diagnose\n"
        "print('imported')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "imported", out.stderr


@pytest.mark.parametrize("lint", ["yes", 1, None])
def test_the_lint_option_must_be_a_bool(lint: object) -> None:
    with pytest.raises(TypeError, match=r"lint must be a bool \(True or False\); got "):
        mixprec.auto_mixed_precision(MLP(), "O2", "bf16", lint=lint)  # type: ignore[arg-type]
