"""``mixprec fp8-check``: the factory contract, the report and the PNG."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from mixprec.cli import main
from mixprec.fp8 import Fp8Recipe


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def tiny_with_batches() -> tuple[nn.Module, object]:
    x = torch.randn(32, 16)
    labels = torch.randint(0, 4, (32,))
    return tiny(), lambda step: (x, labels)


def never_called() -> nn.Module:
    raise AssertionError("the factory ran before --out was checked")


def test_fp8_check_trains_every_recipe_and_writes_the_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "fp8.png"
    argv = ["fp8-check", f"{__file__}:tiny", "--input", "8,16", "--steps", "12", "--out", str(png)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0].split()
    assert header == ["step", "bf16", *[r.value for r in Fp8Recipe]]
    assert "final/bf16" in out
    assert "rowwise: 1 fp8 layer(s)" in out
    assert png.stat().st_size > 1000


def test_fp8_check_takes_a_batch_function(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["fp8-check", f"{__file__}:tiny_with_batches", "--steps", "6", "--out", "none"]
    argv += ["--recipes", "tensorwise", "--all-linears"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tensorwise: 3 fp8 layer(s)" in out


def test_fp8_check_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fp8-check", f"{__file__}:tiny", "--steps", "6"]) == 2
    assert "give --input SHAPE" in capsys.readouterr().err
    assert main(["fp8-check", f"{__file__}:tiny", "--input", "8,16", "--recipes", "fp4"]) == 2
    assert "'fp4'" in capsys.readouterr().err


def test_fp8_check_refuses_a_bad_out_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["fp8-check", f"{__file__}:never_called", "--input", "8,16"]
    assert main([*argv, "--out", str(tmp_path / "missing" / "fp8.png")]) == 2
    assert "no folder" in capsys.readouterr().err


def test_fp8_check_shows_progress_only_on_a_terminal() -> None:
    import io

    from mixprec.cli.fp8_check import check_fp8
    from mixprec.cli.terminal import ProgressLine

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    x, labels = torch.randn(8, 16), torch.randint(0, 4, (8,))
    for stream, shown in [(Terminal(), True), (io.StringIO(), False)]:
        with ProgressLine(stream, interval=0.0) as progress:
            check_fp8(tiny(), lambda step: (x, labels), [], steps=2, progress=progress)
        assert ("bf16: step 2/2" in stream.getvalue()) is shown
