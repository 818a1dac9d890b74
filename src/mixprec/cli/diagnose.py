"""``mixprec find-overflow`` and ``mixprec lint``: where a user's model breaks in low precision.

Both take a model factory ``MODULE:CALLABLE`` (loaded as ``mixprec plan`` loads it).
``find-overflow`` runs it once forward and backward on random inputs of the given shapes
and prints :func:`mixprec.find_overflow`'s report; ``lint`` prints
:func:`mixprec.lint`'s findings. A user mistake raises
:class:`~mixprec.cli.plan.PlanError` (one line; the command line exits with status 2).
Only torch is needed.

Example:
    >>> parser = argparse.ArgumentParser(prog="mixprec")
    >>> add_commands(parser.add_subparsers(dest="command"))
    >>> args = parser.parse_args(["lint", "mixprec.cli.models:lenet5", "--dtype", "fp16"])
    >>> args.handler(args)  # doctest: +SKIP
    0
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from mixprec.cli.plan import PlanError, build_model, parse_input, run_model
from mixprec.cli.terminal import dumps
from mixprec.diagnose import find_overflow, lint

__all__ = ["OPTIMIZERS", "add_commands", "run_find_overflow", "run_lint"]

_FIND_HELP = "run a model forward and backward; name the first module that is not finite"
_LINT_HELP = "list settings of a model that cannot work at a level and dtype"

#: ``--optimizer`` choices for ``mixprec lint``.
OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}


def add_commands(subparsers: Any) -> None:
    """Register ``find-overflow`` and ``lint`` on an ``add_subparsers()`` object; each
    parser's ``handler`` default is the function that runs it (``args.handler(args)``)."""
    find = subparsers.add_parser("find-overflow", help=_FIND_HELP, description=_FIND_HELP)
    _model_arguments(find)
    find.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="SHAPE",
        help="an input shape like 1,3,32,32 (int:1,16 for integer tokens); repeat per input",
    )
    find.add_argument(
        "--loss-scale", type=float, default=1.0, help="multiply the loss before backward (1)"
    )
    find.add_argument("--seed", type=int, default=0, help="seed of the random inputs (0)")
    find.set_defaults(handler=run_find_overflow)

    check = subparsers.add_parser("lint", help=_LINT_HELP, description=_LINT_HELP)
    _model_arguments(check)
    check.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZERS),
        default=None,
        help="also check this optimizer, built on the model's parameters",
    )
    check.add_argument("--eps", type=float, default=None, help="the optimizer's eps")
    check.add_argument(
        "--no-master-weights",
        action="store_true",
        help="the optimizer steps low-precision weights (its state in the low dtype)",
    )
    check.set_defaults(handler=run_lint)


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", metavar="MODULE:CALLABLE", help="e.g. mixprec.cli.models:lenet5 or file.py:make"
    )
    parser.add_argument("--level", default="O2", help="O1, O2, O3, autocast or auto (default O2)")
    parser.add_argument("--dtype", default=None, help="bf16 or fp16 (default: the device's)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _usage(call: Callable[[], Any]) -> Any:
    """Turn a bad level, dtype or value, or running out of memory, into a one-line
    :class:`PlanError`."""
    try:
        return call()
    except (TypeError, ValueError) as error:
        raise PlanError(str(error)) from error
    except MemoryError as error:
        raise PlanError("out of memory (is the model or an input too large?)") from error
    except RuntimeError as error:
        if "memory" not in str(error):
            raise
        first = str(error).strip().splitlines()[0]
        raise PlanError(f"out of memory (is the model or an input too large?): {first}") from error


def run_find_overflow(args: argparse.Namespace, write: Callable[[str], None] = print) -> int:
    """The ``mixprec find-overflow`` command; returns the exit status (0)."""
    if not args.input:
        raise PlanError("give at least one --input SHAPE (e.g. --input 1,3,32,32)")
    specs = [parse_input(text) for text in args.input]
    model = build_model(args.model)
    generator = torch.Generator().manual_seed(args.seed)
    inputs = [spec.make(generator) for spec in specs]
    training = model.training
    run_model(model, inputs, f"the model {args.model}", " ".join(map(str, specs)))
    model.train(training)
    report = _usage(
        lambda: find_overflow(
            model, *inputs, level=args.level, dtype=args.dtype, loss_scale=args.loss_scale
        )
    )
    write(dumps(report.to_dict()) if args.json else str(report))
    return 0


def run_lint(args: argparse.Namespace, write: Callable[[str], None] = print) -> int:
    """The ``mixprec lint`` command; returns the exit status (0)."""
    model = build_model(args.model)
    optimizer = None
    if args.optimizer is not None:
        options = {} if args.eps is None else {"eps": args.eps}
        optimizer = _usage(lambda: OPTIMIZERS[args.optimizer](model.parameters(), **options))
    elif args.eps is not None:
        raise PlanError("--eps needs --optimizer (adam or adamw)")
    report = _usage(
        lambda: lint(
            model,
            optimizer,
            level=args.level,
            dtype=args.dtype,
            master_weights=not args.no_master_weights,
        )
    )
    write(dumps(report.to_dict()) if args.json else str(report))
    return 0
