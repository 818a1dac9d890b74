"""The ``mixprec`` command line, every subcommand end to end on tiny settings, and how it
talks: one-line errors with status 2, one-line warnings, strict JSON, progress.

Nothing here is timed: the tests check structure (columns, files, JSON, exit codes,
messages), and the measurement helpers on cases small enough to count by hand.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import mixprec
from conftest import AVX2_ONLY, NATIVE_BF16, fake_cpu
from mixprec.cli import main
from mixprec.cli.bench import VARIANTS
from mixprec.cli.bench_report import BENCH_COLUMNS
from mixprec.cli.data import batch_order, load_digits
from mixprec.cli.demo import COLUMNS, JSON_NAME, PNG_NAME, parse_levels
from mixprec.cli.models import lenet5
from mixprec.cli.plan import InputSpec, PlanError, parse_input
from mixprec.inspect import CastCounter, SavedBytes

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ALL_RUNS = "O0,O1,O2,O3,autocast,auto,O2-fp16"


# ---------------------------------------------------------------------------- demo
def _run_demo(out: Path, *argv: str) -> tuple[int, str]:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main(["demo", "--out", str(out), *argv])
    return code, buffer.getvalue()


#: What the shared demo run gave: exit status, stdout, the --out folder, stderr.
DemoRun = tuple[int, str, Path, str]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """One tiny demo over every run (6 steps each) on a native-bf16 CPU, shared by the
    demo tests, into a folder that holds an earlier run's PNG; stderr is not a terminal."""
    out = tmp_path_factory.mktemp("demo")
    (out / PNG_NAME).write_bytes(b"an earlier run")
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(err):
        fake_cpu(patch, NATIVE_BF16)
        code, text = _run_demo(out, "--steps-limit", "6", "--levels", ALL_RUNS)
    return code, text, out, err.getvalue()


def test_demo_says_it_replaces_an_earlier_run_and_shows_no_progress_when_piped(
    demo_run: DemoRun,
) -> None:
    *_, out, err = demo_run
    assert err == (
        f"mixprec: warning: demo: {out} holds an earlier run's {PNG_NAME}; this run replaces "
        "them (--out DIR writes elsewhere)\n"
    )
    assert (out / PNG_NAME).read_bytes()[:8] == PNG_SIGNATURE


def test_demo_time_column_says_it_is_a_time_ratio(demo_run: DemoRun) -> None:
    text = demo_run[1]
    assert "time vs O0" in text
    assert "above 1x is slower" in text
    assert re.search(r"^O0 .* 1\.00x ", text, re.MULTILINE), text


@pytest.mark.parametrize("kind", ["file", "inside-a-file"])
def test_demo_checks_out_before_training(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import mixprec.cli.demo

    monkeypatch.setattr(mixprec.cli.demo, "run_demo", _must_not_run)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = blocker if kind == "file" else blocker / "sub"
    assert main(["demo", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mixprec demo: error: --out {str(out)!r}")
    assert err.count("\n") == 1


def _must_not_run(*args: object, **kwargs: object) -> None:
    raise AssertionError("ran before checking --out")


def test_demo_runs_and_prints_every_column(demo_run: DemoRun) -> None:
    code, text, *_ = demo_run
    assert code == 0
    for column in COLUMNS:
        assert column in text, column
    for row in ("O0", "O1", "O2", "O3", "autocast", "auto -> O2", "O2-fp16"):
        assert re.search(rf"^{re.escape(row)} ", text, re.MULTILINE), row


def test_demo_output_fits_100_columns(demo_run: DemoRun) -> None:
    lines = demo_run[1].splitlines()
    assert len(lines) > 8
    too_wide = [line for line in lines if len(line) > 100 and not line.startswith("wrote ")]
    assert not too_wide, too_wide


def test_demo_auto_row_on_a_cpu_without_native_bf16(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_cpu(monkeypatch, AVX2_ONLY)
    code, text = _run_demo(tmp_path, "--steps-limit", "2", "--levels", "auto")
    assert code == 0
    assert capsys.readouterr().err.startswith("mixprec: warning: level 'auto' chose O0")
    assert re.search(r"^auto -> O0 +float32 ", text, re.MULTILINE), text
    rows = json.loads((tmp_path / JSON_NAME).read_text())
    assert [(row["name"], row["level"], row["casts"]) for row in rows] == [("auto", "O0", 0)]


def test_demo_rows_report_dtypes_and_loss_scale(demo_run: DemoRun) -> None:
    rows = json.loads((demo_run[2] / JSON_NAME).read_text())
    by_name = {row["name"]: row for row in rows}
    assert by_name["O0"]["dtype"] == "float32"
    assert by_name["O0"]["casts"] == 0
    assert by_name["O2"]["dtype"] == "bfloat16"
    assert by_name["auto"]["level"] == "O2"
    fp16 = by_name["O2-fp16"]
    assert fp16["dtype"] == "float16"
    assert fp16["loss_scale"] >= 1
    assert all(row["steps"] == 6 for row in rows)
    assert all(0 <= row["accuracy"] <= 100 for row in rows)
    # low-precision activations: O2 keeps less for backward than float32
    assert 0 < by_name["O2"]["saved_bytes"] < by_name["O0"]["saved_bytes"]


def test_demo_writes_a_valid_png(demo_run: DemoRun) -> None:
    import matplotlib.image

    png = demo_run[2] / PNG_NAME
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(png)
    assert image.ndim == 3
    assert image.shape[0] > 100
    assert image.shape[1] > 100


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--levels", "O0,O9"], "--levels names 'O9', which is not a level; choose from O0"),
        (["--dtype", "fp8"], "--dtype: dtype must be one of"),
        (["--epochs", "0"], "--epochs must be >= 1; got 0"),
        (["--steps-limit", "-1"], "--steps-limit must be >= 1; got -1"),
        (["--lr", "0"], "--lr must be > 0; got 0.0"),
    ],
    ids=["level", "dtype", "epochs", "steps-limit", "lr"],
)
def test_demo_rejects_bad_flags(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["demo", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1


def test_parse_levels_normalises_and_dedupes() -> None:
    assert parse_levels("o0, AUTOCAST,o0,o2-FP16") == ("O0", "autocast", "O2-fp16")


def test_digits_split_and_batch_order_are_fixed() -> None:
    data = load_digits(seed=0)
    assert data.x_train.shape[1:] == (1, 32, 32)
    assert len(data.y_train) + len(data.y_test) == 1797
    first = batch_order(len(data.y_train), 32, 2, seed=0)
    again = batch_order(len(data.y_train), 32, 2, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert len(first) == 2 * (len(data.y_train) // 32)


# ---------------------------------------------------------------------------- plan
def test_plan_prints_the_table_and_totals(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "mixprec.cli.models:lenet5", "--input", "1,1,32,32"]) == 0
    out = capsys.readouterr().out
    converted = mixprec.auto_mixed_precision(lenet5(), "O1")
    expected = mixprec.explain(converted, torch.randn(1, 1, 32, 32))
    assert "output (1, 10) float32" in out
    assert str(expected) in out


@pytest.mark.parametrize("level", ["O1", "O2", "O3", "autocast"])
def test_plan_json_matches_explain(level: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "mixprec.cli.models:lenet5", "--input", "2,1,32,32", "--level", level]
    assert main([*argv, "--dtype", "bf16", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    converted = mixprec.auto_mixed_precision(lenet5(), level, "bf16")
    expected = mixprec.explain(converted, torch.randn(2, 1, 32, 32))  # the CLI's inputs' dtypes
    assert printed["totals"]["casts_per_forward"] == expected.num_casts
    assert printed == expected.to_dict()


FACTORIES = textwrap.dedent(
    """
    import torch
    from torch import nn

    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.proj = nn.Linear(8, 8)

        def forward(self, tokens, features):
            return self.proj(self.embed(tokens) + features)

    def two_inputs():
        return TwoInputs()

    def broken():
        raise RuntimeError("no weights here")

    def not_a_model():
        return 42

    def exits():
        raise SystemExit(3)

    def mlp():
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    class NaNOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x) * float("nan")

    def nan_out():
        return NaNOut()

    def huge_norm():  # 2**40 features: an input for it cannot be allocated
        norm = nn.LayerNorm((2**20, 2**20), eps=1e-9, elementwise_affine=False)
        return nn.Sequential(nn.Linear(4, 4), norm)

    VALUE = 3
    """
)


@pytest.fixture
def factories(tmp_path: Path) -> Path:
    path = tmp_path / "factories.py"
    path.write_text(FACTORIES)
    return path


def test_plan_loads_a_file_with_integer_and_float_inputs(
    factories: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", f"{factories}:two_inputs", "--input", "int:2,5", "--input", "2,5,8", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["level"] == "O1"
    assert plan["totals"]["casts_per_forward"] > 0


@pytest.mark.parametrize(
    ("target", "inputs", "extra", "message"),
    [
        ("lenet5", ["1,1,32,32"], [], "must be MODULE:CALLABLE"),
        ("no/such/file.py:make", ["1,1,32,32"], [], "no such file: 'no/such/file.py'"),
        ("no_such_module_xyz:make", ["1,1"], [], "cannot import module 'no_such_module_xyz'"),
        ("mixprec.cli.models:lenet6", ["1,1,32,32"], [], "has no attribute 'lenet6'; it has"),
        ("{file}:missing", ["1,1"], [], "has no attribute 'missing'"),
        ("{file}:VALUE", ["1,1"], [], "is a int, not a callable model factory"),
        ("{file}:broken", ["1,1"], [], "calling {file}:broken() failed: RuntimeError: no weights"),
        ("{file}:not_a_model", ["1,1"], [], "must return a torch.nn.Module; got int: 42"),
        ("mixprec.cli.models:lenet5", ["1,x,32,32"], [], "--input '1,x,32,32': a shape is"),
        ("mixprec.cli.models:lenet5", ["1,0,32"], [], "--input '1,0,32': a shape is"),
        ("mixprec.cli.models:lenet5", ["half:1,1"], [], "unknown element type 'half'"),
        ("mixprec.cli.models:lenet5", [], [], "give at least one --input SHAPE"),
        ("mixprec.cli.models:lenet5", ["1,3,32,32"], [], "failed to run on inputs float:1,3,32,32"),
        ("mixprec.cli.models:lenet5", ["1,1,32,32"], ["--level", "O7"], "--level must be one of"),
        ("mixprec.cli.models:lenet5", ["1,1,32,32"], ["--level", "O0"], "converts nothing"),
        ("mixprec.cli.models:lenet5", ["1,1,32,32"], ["--dtype", "int8"], "--dtype: dtype must"),
    ],
    ids=[
        "no-colon",
        "no-file",
        "no-module",
        "no-attribute",
        "no-attribute-in-file",
        "not-callable",
        "factory-raises",
        "not-a-module",
        "shape-not-int",
        "shape-zero",
        "shape-kind",
        "no-input",
        "fails-to-run",
        "bad-level",
        "level-O0",
        "bad-dtype",
    ],
)
def test_plan_errors_are_one_line_with_status_2(
    target: str,
    inputs: list[str],
    extra: list[str],
    message: str,
    factories: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    target = target.format(file=factories)
    argv = ["plan", target, *(a for i in inputs for a in ("--input", i)), *extra]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("mixprec plan: error: ")
    assert message.format(file=factories) in captured.err
    assert captured.err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["find-overflow", "{file}:mlp", "--input", "3,5"], "failed to run on inputs float:3,5"),
        (["find-overflow", "{file}:mlp", "--input", "int:3,4"], "failed to run on inputs int:3,4"),
        (["find-overflow", "{file}:mlp", "--input", "10000,10000,100000"], "cannot allocate"),
        (["plan", "{file}:mlp", "--input", "10000,10000,100000"], "cannot allocate 37,252.9 GiB"),
        (["plan", "{file}:mlp", "--input", "99999999999999999999,4"], "more than a tensor"),
        (["find-overflow", "{file}:mlp", "--input", "3,4", "--loss-scale", "inf"], "got inf"),
        (["find-overflow", "{file}:mlp", "--input", "3,4", "--loss-scale", "1e39"], "got 1e+39"),
        (["plan", "{file}:exits", "--input", "3,4"], "failed: it raised SystemExit(3)"),
        (["find-overflow", "{file}:exits", "--input", "3,4"], "failed: it raised SystemExit(3)"),
        (["lint", "{file}:exits"], "calling {file}:exits() failed: it raised SystemExit(3)"),
        (["lint", "{exits}:mlp"], "importing '{exits}' failed: it raised SystemExit(0)"),
    ],
    ids=[
        "find-shape",
        "find-int",
        "find-huge",
        "plan-huge",
        "plan-beyond-int64",
        "find-scale-inf",
        "find-scale-beyond-fp32",
        "plan-exit",
        "find-exit",
        "lint-exit",
        "import-exit",
    ],
)
def test_every_command_mistake_is_one_line_with_status_2(
    argv: list[str], message: str, factories: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    exits = factories.parent / "exits_on_import.py"
    exits.write_text("raise SystemExit(0)\n")
    argv = [a.format(file=factories, exits=exits) for a in argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"mixprec {argv[0]}: error: "), captured.err
    assert message.format(file=factories, exits=exits) in captured.err
    assert captured.err.count("\n") == 1


def test_lint_of_a_layer_too_large_to_run_still_answers(
    factories: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["lint", f"{factories}:huge_norm", "--level", "O3", "--dtype", "fp16", "--json"]
    assert main(argv) == 0
    findings = json.loads(capsys.readouterr().out)["findings"]
    assert [f["kind"] for f in findings] == ["norm eps"]


def _strict_json(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise AssertionError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_find_overflow_json_is_strict_for_a_nan_loss(
    factories: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["find-overflow", f"{factories}:nan_out", "--input", "2,4", "--dtype", "bf16"]
    assert main([*argv, "--json"]) == 0
    report = _strict_json(capsys.readouterr().out)
    assert report["loss"] == "nan"
    assert report["forward"]["kind"] == "nan"


def test_mixprec_warnings_are_one_line_on_stderr(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_cpu(monkeypatch, AVX2_ONLY)  # bf16 is slow here: conversion warns
    argv = ["plan", "mixprec.cli.models:lenet5", "--input", "1,1,32,32", "--dtype", "bf16"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.startswith("mixprec: warning: computing in bfloat16 on cpu, but this CPU (AVX2)")
    assert err.count("\n") == 1
    assert "UserWarning" not in err


def test_other_warnings_keep_their_format(capsys: pytest.CaptureFixture[str]) -> None:
    import warnings

    from mixprec.cli.terminal import one_line_warnings

    with pytest.warns(UserWarning, match="not ours"), one_line_warnings():
        warnings.warn_explicit("not ours", UserWarning, "lib.py", 7)  # to the handler before
    assert capsys.readouterr().err == ""


def test_parse_input_kinds() -> None:
    assert parse_input("1, 3,4") == InputSpec((1, 3, 4), torch.float32)
    assert parse_input("int:2,8") == InputSpec((2, 8), torch.int64)
    with pytest.raises(PlanError, match="a shape is positive integers"):
        parse_input("int:")


# ---------------------------------------------------------------------------- bench
@pytest.fixture(scope="module")
def bench_json() -> dict[str, Any]:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(["bench", "--quick", "--json"]) == 0
    data: dict[str, Any] = json.loads(buffer.getvalue())
    return data


def test_bench_json_has_every_model_and_variant(bench_json: dict[str, Any]) -> None:
    results = bench_json["results"]
    assert isinstance(results, list)
    pairs = {(r["case"], r["variant"]) for r in results}
    assert pairs == {(c, v) for c in ("mlp", "cnn", "transformer") for v in VARIANTS}
    for r in results:
        assert r["train_ms"] > 0
        assert r["infer_ms"] > 0
        assert set(r["ratios"]) == {
            "train_vs_autocast",
            "train_vs_pure",
            "infer_vs_autocast",
            "infer_vs_pure",
            "train_vs_fp32",
            "saved_vs_fp32",
        }
    by = {(r["case"], r["variant"]): r for r in results}
    for case in ("mlp", "cnn", "transformer"):
        assert by[(case, "fp32")]["casts_train"] == 0
        assert by[(case, "torch.autocast")]["ratios"]["train_vs_autocast"] == pytest.approx(1.0)
        assert by[(case, "mixprec O2")]["casts_train"] > 0
    assert {"cpu", "cores", "torch"} <= set(bench_json["machine"])
    goals = bench_json["goals"]
    assert isinstance(goals, list)
    assert len(goals) == 3 * 6
    assert all(isinstance(goal["met"], bool) for goal in goals)


def test_bench_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--quick", "--models", "mlp", "--repeats", "1", "--warmup", "0"]) == 0
    out, err = capsys.readouterr()
    assert err == ""  # no progress when stderr is not a terminal
    for column in BENCH_COLUMNS:  # a header may wrap over two lines
        assert all(word in out for word in column.split()), column
    for variant in VARIANTS:
        assert variant in out, variant
    assert "goals" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--models", "mlp,vit"],
            "--models must name some of mlp, cnn, transformer; got 'mlp,vit'",
        ),
        (["--repeats", "0"], "--repeats must be >= 1; got 0"),
        (["--dtype", "fp64"], "--dtype: dtype must be one of"),
    ],
    ids=["models", "repeats", "dtype"],
)
def test_bench_rejects_bad_flags(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--quick", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["folder", "no-folder"])
def test_bench_checks_out_before_measuring(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import mixprec.cli.bench

    monkeypatch.setattr(mixprec.cli.bench, "run_bench", _must_not_run)
    out = tmp_path if kind == "folder" else tmp_path / "missing" / "bench.json"
    assert main(["bench", "--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    expected = "is a folder; give a file name" if kind == "folder" else "no folder"
    assert err.startswith(f"mixprec bench: error: --out {str(out)!r}")
    assert expected in err
    assert err.count("\n") == 1


def test_ratio_headers_say_what_they_compare() -> None:
    for column in (*COLUMNS, *BENCH_COLUMNS):
        if " vs " in column:
            assert column.split(" vs ")[0].endswith(("time", "speed")), column


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_on_a_terminal_only() -> None:
    from mixprec.cli.terminal import ProgressLine

    terminal = _Terminal()
    with ProgressLine(terminal, interval=0) as progress:
        progress.update("run 1/2: step 10/624")
        progress.update("run 2/2")
    assert terminal.getvalue() == (
        "\rrun 1/2: step 10/624\rrun 2/2             " + "\r" + " " * 7 + "\r"
    )
    pipe = io.StringIO()
    with ProgressLine(pipe, interval=0) as progress:
        progress.update("run 1/2")
    assert pipe.getvalue() == ""


# ---------------------------------------------------------------------------- main
def test_main_usage_errors_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out


# ---------------------------------------------------------------------------- measure
def test_cast_counter_counts_dtype_changes_only() -> None:
    x = torch.ones(3)
    with CastCounter() as counter:
        x.to(torch.bfloat16).to(torch.float32)
        x.to(torch.float32)  # no change: no copy
        x.clone()
    assert counter.total == 2
    assert counter.casts[(torch.float32, torch.bfloat16)] == 1


def test_saved_bytes_counts_each_storage_once_and_skips_parameters() -> None:
    layer = nn.Linear(4, 4, bias=False)
    x = torch.randn(2, 4, requires_grad=True)
    with SavedBytes(exclude=layer.parameters()) as saved:
        y = layer(x)  # saves x (32 bytes) and the weight (excluded)
        (y * y).sum()  # saves y twice: one storage, 32 bytes
    assert saved.total == 32 + 32
    with SavedBytes() as everything:
        layer(x)
    assert everything.total == 32 + 64


# -------------------------------------------------------------------------- doctor
def test_doctor_json_names_every_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["torch"] == torch.__version__
    cpu = report["devices"][0]
    assert cpu["device"] == "cpu"
    assert set(cpu["gemm"]) == {"float32", "bfloat16", "float16"}
    assert all(result["gflops"] > 0 for result in cpu["gemm"].values())
    assert set(cpu["native"]) == {"bfloat16", "float16"}
    assert cpu["features"] == dataclasses.asdict(NATIVE_BF16)  # what the probe answers
    assert cpu["recommended"]["level"] in ("O0", "O2")


def test_doctor_text_per_cpu_kind(cpu_kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--no-measure"]) == 0
    text = capsys.readouterr().out
    assert max(len(line) for line in text.splitlines()) <= 100
    if cpu_kind == "native-bf16":
        assert "native: bfloat16 yes, float16 no" in text
        assert "recommended: level 'O2', dtype bfloat16\n" in text
    else:
        assert "native: bfloat16 no, float16 no" in text
        assert "recommended: level 'O0', dtype -\n    why: O0: cpu has no native" in text


def test_cli_starts_with_the_core_install() -> None:
    """plan and doctor work without the demo extra; demo and bench name it."""
    script = textwrap.dedent(
        """
        import sys
        for name in ("rich", "sklearn", "matplotlib"):
            sys.modules[name] = None  # import fails, as when the package is missing
        from mixprec.cli import main
        assert main(["doctor", "--no-measure"]) == 0
        assert main(["plan", "mixprec.cli.models:lenet5", "--input", "1,1,32,32"]) == 0
        assert main(["lint", "mixprec.cli.models:lenet5", "--dtype", "fp16"]) == 0
        assert main(["demo"]) == 2
        assert main(["bench", "--quick"]) == 2
        assert not any(m.startswith(("rich", "sklearn", "matplotlib"))
                       for m, v in sys.modules.items() if v is not None)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "recommended: level" in done.stdout
    assert "cast plan: level O1" in done.stdout
    expected = "needs the 'demo' extra (missing: rich, scikit-learn, matplotlib); install it with"
    assert f"mixprec demo: error: {expected}" in done.stderr
    assert "mixprec bench: error: needs the 'demo' extra (missing: rich)" in done.stderr


def test_diagnose_commands_run_through_main(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["find-overflow", "mixprec.cli.models:lenet5", "--input", "2,1,32,32", "--level", "O2"]
    assert main([*argv, "--dtype", "bf16"]) == 0
    assert "every module output, gradient and the loss are finite" in capsys.readouterr().out
    assert main(["lint", "mixprec.cli.models:nowhere"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mixprec lint: error: ")
    assert err.count("\n") == 1


def test_bench_emulate_times_emulated_levels_against_fp32(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "--quick", "--models", "mlp", "--repeats", "1", "--warmup", "0"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*argv, "--emulate", "--out", str(out)]) == 0
    data = _strict_json(out.read_text())  # no NaN for the ratios it cannot measure
    assert data["results"][0]["ratios"]["train_vs_autocast"] is None
    assert data["settings"]["emulate"] is True
    assert [r["variant"] for r in data["results"]] == [
        v for v in VARIANTS if v not in ("torch.autocast", "pure")
    ]
    assert [g["goal"] for g in data["goals"]] == ["O2 emulated train time vs fp32"]


def test_bench_device_must_be_cpu_or_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--quick", "--device", "tpu"]) == 2
    assert "--device must be cpu or cuda; got 'tpu'" in capsys.readouterr().err


def test_plan_emulate_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "mixprec.cli.models:lenet5", "--input", "1,1,32,32", "--level", "O2"]
    assert main([*argv, "--dtype", "bf16", "--emulate"]) == 0
    assert "bfloat16 emulated" in capsys.readouterr().out


def test_demo_emulates_where_the_cpu_is_not_native_with_progress_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake_cpu(monkeypatch, AVX2_ONLY)
    terminal = _Terminal()
    with monkeypatch.context() as patch:
        patch.setattr(sys, "stderr", terminal)
        code, text = _run_demo(tmp_path, "--steps-limit", "2", "--levels", "O0,O2,O2-fp16")
    assert code == 0
    assert "\rmixprec demo: run 1/3, O0: step 1/2" in terminal.getvalue()  # a terminal: progress
    assert terminal.getvalue().endswith("\r")  # the line cleared at the end
    assert re.search(r"^O2 +bfloat16\* ", text, re.MULTILINE), text
    assert re.search(r"^O2-fp16 +float16\* ", text, re.MULTILINE), text
    assert "*: emulated" in text
    rows = {row["name"]: row for row in json.loads((tmp_path / JSON_NAME).read_text())}
    assert rows["O2"]["emulated"]
    assert not rows["O0"]["emulated"]
    assert rows["O2"]["casts"] == 2  # the level's casts, as a native step makes them
    assert 0 < rows["O2"]["saved_bytes"] < rows["O0"]["saved_bytes"]
    fake_cpu(monkeypatch, NATIVE_BF16)
    code, text = _run_demo(tmp_path, "--steps-limit", "2", "--levels", "O2")
    assert re.search(r"^O2 +bfloat16 ", text, re.MULTILINE), text
    code, text = _run_demo(tmp_path, "--steps-limit", "2", "--levels", "O2", "--emulate")
    assert re.search(r"^O2 +bfloat16\* ", text, re.MULTILINE), text
