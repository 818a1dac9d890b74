"""The ``mixprec`` command: ``demo``, ``plan``, ``bench``, ``doctor``, ``find-overflow``, ``lint``.

``main(argv)`` parses the arguments (argparse), runs one subcommand and returns the exit
status: 0 on success, 2 for a usage error (a bad flag, path, shape, level, ...), with a
one-line message on stderr. mixprec's warnings print as one ``mixprec: warning: ...`` line
on stderr; JSON output is strict (:mod:`mixprec.cli.terminal`). The subcommands live in
their own modules: :mod:`mixprec.cli.demo`, :mod:`mixprec.cli.plan`,
:mod:`mixprec.cli.bench`, :mod:`mixprec.cli.doctor` and :mod:`mixprec.cli.diagnose`
(``find-overflow``, ``lint``). All but ``demo`` and ``bench`` need only torch; those two
need the ``demo`` extra (rich, scikit-learn, matplotlib) and say so when it is missing.

Example:
    >>> from mixprec.cli import main
    >>> main(["plan", "mixprec.cli.models:lenet5", "--input", "1,1,32,32"])  # doctest: +SKIP
    0
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from mixprec.cli.demo_config import LEVEL_CHOICES, DemoConfig
from mixprec.cli.diagnose import add_commands as add_diagnose_commands
from mixprec.cli.fp8_check import add_command as add_fp8_check
from mixprec.cli.plan import PlanError
from mixprec.cli.terminal import (
    ProgressLine,
    check_out_dir,
    check_out_file,
    dumps,
    one_line_warnings,
)

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["build_parser", "main", "make_console"]

_DEMO_HELP = "train LeNet-5 on scikit-learn's digits at every level; print a table, write a PNG"
_PLAN_HELP = "print the cast plan of a model from a factory MODULE:CALLABLE"
_BENCH_HELP = "time mixprec's levels against torch.autocast and pure low precision"
_DOCTOR_HELP = (
    "what this machine runs natively (measured matmul speed per dtype) and the level to use"
)
#: What each command needs beyond torch: (import name, package name).
_EXTRAS = {
    "demo": (("rich", "rich"), ("sklearn", "scikit-learn"), ("matplotlib", "matplotlib")),
    "bench": (("rich", "rich"),),
}


class UsageError(ValueError):
    """A bad command-line value: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``mixprec`` command."""
    parser = argparse.ArgumentParser(
        prog="mixprec", description="mixprec: automatic mixed precision for PyTorch"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    defaults = DemoConfig()
    demo = commands.add_parser("demo", help=_DEMO_HELP, description=_DEMO_HELP)
    demo.add_argument(
        "--epochs", type=int, default=defaults.epochs, help=f"default {defaults.epochs}"
    )
    demo.add_argument(
        "--levels",
        default=",".join(LEVEL_CHOICES),
        help=f"comma-separated runs from {','.join(LEVEL_CHOICES)} (default: all)",
    )
    demo.add_argument("--dtype", default="bf16", help="low dtype: bf16 or fp16 (default bf16)")
    demo.add_argument(
        "--seed", type=int, default=defaults.seed, help="split, init and batch order (default 0)"
    )
    demo.add_argument("--out", default=str(defaults.out), help="folder for the PNG and JSON")
    demo.add_argument(
        "--batch-size", type=int, default=defaults.batch_size, help=f"default {defaults.batch_size}"
    )
    demo.add_argument(
        "--lr", type=float, default=defaults.lr, help=f"Adam's peak learning rate ({defaults.lr:g})"
    )
    demo.add_argument(
        "--steps-limit", type=int, default=None, help="stop each run after this many steps"
    )
    demo.add_argument(
        "--emulate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the low-precision levels emulated (float32 kernels, rounded results); "
        "default: where this CPU has no native support for the dtype",
    )

    plan = commands.add_parser("plan", help=_PLAN_HELP, description=_PLAN_HELP)
    plan.add_argument(
        "model", metavar="MODULE:CALLABLE", help="e.g. mixprec.cli.models:lenet5 or file.py:make"
    )
    plan.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="SHAPE",
        help="an input shape like 1,3,32,32 (int:1,16 for integer tokens); repeat per input",
    )
    plan.add_argument("--level", default="O1", help="O1, O2, O3, autocast or auto (default O1)")
    plan.add_argument("--dtype", default=None, help="bf16 or fp16 (default: the device's)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--emulate", action="store_true", help="convert with emulate=True")

    bench = commands.add_parser("bench", help=_BENCH_HELP, description=_BENCH_HELP)
    bench.add_argument("--json", action="store_true", help="print the results as JSON")
    bench.add_argument("--quick", action="store_true", help="tiny shapes, few repeats (for tests)")
    bench.add_argument("--models", default=None, help="comma-separated: mlp,cnn,transformer")
    bench.add_argument("--repeats", type=int, default=None, help="timed rounds (default 15)")
    bench.add_argument("--warmup", type=int, default=None, help="warm-up calls (default 3)")
    bench.add_argument("--dtype", default="bf16", help="low dtype: bf16 or fp16 (default bf16)")
    bench.add_argument("--out", default=None, help="also write the results as JSON to this file")
    bench.add_argument(
        "--emulate",
        action="store_true",
        help="mixprec levels emulated, timed against float32 (low-precision baselines left out)",
    )
    bench.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")

    doctor = commands.add_parser("doctor", help=_DOCTOR_HELP, description=_DOCTOR_HELP)
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument(
        "--no-measure", action="store_true", help="skip the timed matmuls (probes only)"
    )
    add_diagnose_commands(commands)  # find-overflow, lint
    add_fp8_check(commands)  # fp8-check
    return parser


def make_console(width: int = 100) -> Console:
    """A rich console on stdout, ``width`` columns wide when stdout is not a terminal."""
    from rich.console import Console

    console = Console(file=sys.stdout)
    if not console.is_terminal:  # a pipe, a file, a test
        console = Console(file=sys.stdout, width=width)
    return console


def _require_extra(command: str) -> None:
    missing = [package for module, package in _EXTRAS[command] if not _importable(module)]
    if missing:
        raise UsageError(
            f"needs the 'demo' extra (missing: {', '.join(missing)}); "
            "install it with: pip install 'mixprec[demo]'"
        )


def _importable(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def _demo(args: argparse.Namespace) -> int:
    _require_extra("demo")
    from mixprec.cli.demo import config_from_args, run_demo

    try:
        config = config_from_args(args)
        check_out_dir(config.out)
    except ValueError as error:
        raise UsageError(str(error)) from error
    run_demo(config, make_console())
    return 0


def _plan(args: argparse.Namespace) -> int:
    from mixprec.cli.plan import run_plan

    try:
        run_plan(args.model, args.input, args.level, args.dtype, args.json, emulate=args.emulate)
    except PlanError as error:
        raise UsageError(str(error)) from error
    return 0


def _bench(args: argparse.Namespace) -> int:
    _require_extra("bench")
    from mixprec.cli.bench import run_bench, settings_from_args
    from mixprec.cli.bench_report import bench_dict, goals_table, results_table
    from mixprec.cli.measure import machine_info

    try:
        settings = settings_from_args(args)
        if args.out is not None:
            check_out_file(Path(args.out))
    except ValueError as error:
        raise UsageError(str(error)) from error
    with ProgressLine() as progress:
        results, described = run_bench(
            settings, progress=lambda text: progress.update(f"mixprec bench: {text}", force=True)
        )
    machine = machine_info()
    data = bench_dict(results, settings, described, machine)
    if args.out is not None:
        Path(args.out).write_text(dumps(data) + "\n", encoding="utf-8")
    if args.json:
        print(dumps(data))
        return 0
    console = make_console(width=220)  # one row per model and variant, a dozen columns
    console.print(
        f"machine: {machine['cpu']}, {machine['cores']} cores, "
        f"{machine['torch_threads']} torch threads, torch {machine['torch']}"
    )
    for name, text in described.items():
        console.print(f"  {name}: {text}")
    console.print(results_table(results, settings))
    console.print(goals_table(results))
    if args.out is not None:
        console.print(f"wrote {args.out}")
    return 0


def _diagnose(args: argparse.Namespace) -> int:
    try:
        return int(args.handler(args))
    except PlanError as error:
        raise UsageError(str(error)) from error


def _doctor(args: argparse.Namespace) -> int:
    from mixprec.cli.doctor import run_doctor

    print(run_doctor(args.json, measure=not args.no_measure))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``mixprec`` command line; returns the exit status.

    Args:
        argv: the arguments after the program name (default ``sys.argv[1:]``).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help (0) or an argparse usage error (2)
        return exit_.code if isinstance(exit_.code, int) else 2
    handlers = {"demo": _demo, "plan": _plan, "bench": _bench, "doctor": _doctor}
    try:
        with one_line_warnings():
            return handlers.get(args.command, _diagnose)(args)
    except UsageError as error:
        print(f"mixprec {args.command}: error: {error}", file=sys.stderr)
        return 2
