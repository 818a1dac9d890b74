"""``mixprec fp8-check MODULE:FACTORY``: will this model train in fp8? Checked on any machine.

It trains the model a few hundred steps at O2 bfloat16 (emulated where the CPU has no
native bfloat16) and, from the same initial weights, with each fp8 recipe on top
(emulated, bit-identical to torchao's emulation), then prints the loss curves side by
side, each recipe's worst layers' fp8 statistics (from its last step), and writes a PNG.

The factory's contract (``FACTORY()`` is called once, with no arguments):

- it returns a model: the data is a synthetic regression, ``--input`` shaped random
  inputs (8 fixed batches, cycled) onto fixed random targets of the output's shape, MSE;
- or it returns ``(model, batch_fn)``: ``batch_fn(step)`` gives the step's batch, either
  a tuple ``(*inputs, target)`` (cross-entropy for an integer target, MSE otherwise) or a
  dict of keyword inputs for a model that returns its own loss (``input_ids=``,
  ``labels=`` for a Hugging Face causal LM).

Example:
    >>> main(["fp8-check", "mixprec.cli.models:mlp", "--input", "64,1024", "--steps", "50"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.cli.plan import PlanError, load_factory, parse_input
from mixprec.cli.terminal import ProgressLine, check_out_file
from mixprec.fp8 import Fp8Recipe, Fp8StatsRow, fp8_layers, fp8_stats
from mixprec.policy.hardware import is_native

__all__ = ["Fp8Run", "add_command", "check_fp8", "run_fp8_check"]

_HELP = "train a model in bf16 and in each fp8 recipe (emulated); compare the loss curves"
BatchFn = Callable[[int], Any]


def add_command(subparsers: Any) -> None:
    """Register ``fp8-check`` (its ``handler`` runs it)."""
    parser = subparsers.add_parser("fp8-check", help=_HELP, description=_HELP)
    parser.add_argument(
        "model", help="a factory MODULE:CALLABLE returning a model or (model, batch_fn)"
    )
    parser.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="SHAPE",
        help="input shape(s) for the synthetic regression, e.g. 32,1024",
    )
    parser.add_argument("--steps", type=int, default=200, help="training steps per run (200)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (1e-3)")
    parser.add_argument(
        "--recipes",
        default=",".join(r.value for r in Fp8Recipe),
        help="comma-separated fp8 recipes (all)",
    )
    parser.add_argument(
        "--all-linears",
        action="store_true",
        help="every nn.Linear in fp8 (default: dims multiples of 16, not the first and last)",
    )
    parser.add_argument("--top", type=int, default=3, help="worst layers shown per recipe (3)")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("fp8_check.png"),
        help="the PNG (fp8_check.png); 'none' for no plot",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and data (0)")
    parser.set_defaults(handler=run_fp8_check)


@dataclass(frozen=True)
class Fp8Run:
    """One run: its name (``bf16`` or a recipe), losses, seconds and worst fp8 rows."""

    name: str
    losses: tuple[float, ...]
    seconds: float
    worst: tuple[Fp8StatsRow, ...]
    fp8_layers: int


def _synthetic(model: nn.Module, shapes: list[str], seed: int) -> BatchFn:
    if not shapes:
        raise PlanError(
            "the factory returned a model alone: give --input SHAPE for its synthetic data"
        )
    specs = [parse_input(text) for text in shapes]
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(8):
        inputs = tuple(spec.make(generator) for spec in specs)
        with torch.no_grad():
            out = model(*inputs)
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            raise PlanError(
                "the synthetic regression needs a model returning one float tensor; return (model, batch_fn) instead"
            )
        batches.append((*inputs, torch.randn(out.shape, generator=generator)))
    return lambda step: batches[step % len(batches)]


def _run(step: Any, batch: Any) -> float:
    return float(step(**batch) if isinstance(batch, dict) else step(*batch))


def _loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    if target.dtype in (torch.int64, torch.int32):
        return F.cross_entropy(output, target)
    return F.mse_loss(output, target)


def check_fp8(
    model: nn.Module,
    batch_fn: BatchFn,
    recipes: list[Fp8Recipe],
    *,
    steps: int,
    lr: float = 1e-3,
    fp8_filter: Callable[[nn.Module, str], bool] | None = None,
    top: int = 3,
    progress: ProgressLine | None = None,
) -> list[Fp8Run]:
    """Train copies of ``model`` in bf16 and in each recipe; the runs, bf16 first
    (``progress`` shows the run and step on a terminal)."""
    emulate = not is_native(torch.bfloat16, "cpu")
    runs = []
    for recipe in [None, *recipes]:
        torch.manual_seed(0)
        net = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(net.parameters(), lr=lr)
        first = batch_fn(0)
        loss_fn = None if isinstance(first, dict) else _loss
        step = mixprec.build_train_network(
            net,
            optimizer,
            loss_fn,
            "O2",
            dtype="bf16",
            emulate=emulate,
            fp8=None if recipe is None else recipe.value,
            fp8_filter=fp8_filter,
        )
        layers = len(fp8_layers(step.network))
        losses: list[float] = []
        worst: tuple[Fp8StatsRow, ...] = ()
        start = time.perf_counter()
        name = "bf16" if recipe is None else recipe.value
        for i in range(steps):
            if progress is not None:
                progress.update(f"{name}: step {i + 1}/{steps}")
            batch = batch_fn(i)
            if i == steps - 1 and layers:
                with fp8_stats(step) as stats:
                    losses.append(_run(step, batch))
                worst = tuple(stats.worst(top))
            else:
                losses.append(_run(step, batch))
        seconds = time.perf_counter() - start
        runs.append(
            Fp8Run(
                "bf16" if recipe is None else recipe.value, tuple(losses), seconds, worst, layers
            )
        )
    return runs


def report(runs: list[Fp8Run]) -> str:
    """The loss curves side by side (about ten rows), then each recipe's worst layers."""
    steps = len(runs[0].losses)
    marks = sorted({0, *range(steps // 10 or 1, steps, steps // 10 or 1), steps - 1})
    header = ["step", *[run.name for run in runs]]
    body = [[str(i), *[f"{run.losses[i]:.4g}" for run in runs]] for i in marks]
    body.append(["time (s)", *[f"{run.seconds:.1f}" for run in runs]])
    base = runs[0].losses[-1]
    body.append(["final/bf16", *[f"{run.losses[-1] / base:.3f}" if base else "-" for run in runs]])
    widths = [max(len(line[c]) for line in [header, *body]) for c in range(len(header))]
    lines = [
        "  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True))
        for line in [header, *body]
    ]
    for run in runs[1:]:
        lines.append("")
        if not run.fp8_layers:
            lines.append(
                f"{run.name}: no layer in fp8 (pass --all-linears, or a model whose linears fit)"
            )
            continue
        lines.append(f"{run.name}: {run.fp8_layers} fp8 layer(s); worst casts of the last step:")
        for row in run.worst:
            lines.append(
                f"  {row.layer} {row.gemm.value} {row.operand}: amax {row.amax:.3g}, "
                f"scale {row.scale:.3g}, saturated {row.saturated:.2%}, flushed {row.flushed:.2%}"
            )
    return "\n".join(lines)


def plot(runs: list[Fp8Run], path: Path) -> None:
    """The loss curves, one line per run, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for run in runs:
        axes.plot(run.losses, label=run.name)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_yscale("log")
    axes.legend()
    axes.set_title("bf16 against emulated fp8")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def run_fp8_check(args: argparse.Namespace) -> int:
    """``mixprec fp8-check``: parse, load, train, print, plot."""
    if args.steps < 2:
        raise PlanError(f"--steps must be at least 2; got {args.steps}")
    try:
        recipes = [Fp8Recipe.parse(n, "--recipes") for n in args.recipes.split(",") if n.strip()]
    except ValueError as error:
        raise PlanError(str(error)) from None
    if str(args.out) != "none":
        try:
            check_out_file(Path(args.out))
        except ValueError as error:
            raise PlanError(str(error)) from None
    torch.manual_seed(args.seed)
    made = load_factory(args.model)()
    if (
        isinstance(made, tuple)
        and len(made) == 2
        and isinstance(made[0], nn.Module)
        and callable(made[1])
    ):
        model, batch_fn = made
    elif isinstance(made, nn.Module):
        model, batch_fn = made, _synthetic(made, args.input, args.seed)
    else:
        raise PlanError(
            f"{args.model} returned {type(made).__name__}: return a model or (model, batch_fn)"
        )
    fp8_filter = (lambda module, name: True) if args.all_linears else None
    with ProgressLine() as progress:
        runs = check_fp8(
            model,
            batch_fn,
            recipes,
            steps=args.steps,
            lr=args.lr,
            fp8_filter=fp8_filter,
            top=args.top,
            progress=progress,
        )
    print(report(runs))
    if str(args.out) != "none":
        plot(runs, args.out)
        print(f"\nwrote {args.out}")
    return 0
