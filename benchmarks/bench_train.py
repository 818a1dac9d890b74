"""mixprec against torch.autocast and pure low precision: training step and inference.

The same code as ``mixprec bench`` (:mod:`mixprec.cli.bench`); with ``--out FILE`` it also
writes the results, with the machine they ran on, as JSON. ``RESULTS.md`` holds the last
results.

Usage::

    python benchmarks/bench_train.py                      # full size, about a minute on 2 cores
    python benchmarks/bench_train.py --quick              # tiny shapes, seconds
    python benchmarks/bench_train.py --out results.json   # also write JSON
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mixprec.cli import make_console
from mixprec.cli.bench import run_bench, settings_from_args
from mixprec.cli.bench_report import bench_dict, goals_table, results_table
from mixprec.cli.measure import machine_info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few repeats")
    parser.add_argument("--models", default=None, help="comma-separated: mlp,cnn,transformer")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--out", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    settings = settings_from_args(args)
    console = make_console()
    results, described = run_bench(settings, progress=lambda text: console.print(f"bench {text}"))
    machine = machine_info()
    console.print(
        f"machine: {machine['cpu']}, {machine['cores']} cores, "
        f"{machine['torch_threads']} torch threads, torch {machine['torch']}"
    )
    console.print(results_table(results, settings))
    console.print(goals_table(results))
    if args.out is not None:
        data = bench_dict(results, settings, described, machine)
        Path(args.out).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
