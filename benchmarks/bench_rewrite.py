"""What converting costs: time to convert each benchmark model at each level, and the
casts its plan makes per forward (planned by ``explain`` and measured with a counter).

Uses the models of ``mixprec bench`` (:func:`mixprec.cli.bench.cases`).

Usage::

    python benchmarks/bench_rewrite.py [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from rich.table import Table

import mixprec
from mixprec.cli import make_console
from mixprec.cli.bench import MIXPREC_LEVELS, cases
from mixprec.cli.measure import machine_info
from mixprec.inspect import CastCounter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes")
    parser.add_argument("--repeats", type=int, default=5, help="conversions timed per level")
    args = parser.parse_args(argv)
    machine = machine_info()
    table = Table(
        title=f"conversion cost ({machine['cpu']}, {machine['cores']} cores, "
        f"torch {machine['torch']})"
    )
    for column in ("model", "level", "convert (median)", "planned casts", "measured casts"):
        table.add_column(column, justify="left" if column in ("model", "level") else "right")
    for case in cases(args.quick).values():
        torch.manual_seed(0)
        model = case.make_model()
        inputs, _ = case.make_batch(torch.Generator().manual_seed(0))
        for level in MIXPREC_LEVELS:
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                converted = mixprec.auto_mixed_precision(model, level, torch.bfloat16)
                times.append(time.perf_counter() - start)
            with CastCounter() as counter:
                converted(*inputs)
            table.add_row(
                case.name,
                level,
                f"{statistics.median(times) * 1e3:.1f} ms",
                str(mixprec.explain(converted, *inputs).num_casts),
                str(counter.total),
            )
    make_console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
