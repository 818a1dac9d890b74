"""How ``mixprec bench`` shows its results: rich tables for people, a dict for machines."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from rich.table import Table

from mixprec.cli.bench import BenchSettings, Result, goals
from mixprec.cli.measure import format_bytes
from mixprec.policy.dtypes import dtype_name

__all__ = ["BENCH_COLUMNS", "bench_dict", "goals_table", "results_table"]

#: The results table's column headers.
BENCH_COLUMNS: tuple[str, ...] = (
    "model",
    "variant",
    "train step",
    "train speed vs autocast",
    "train speed vs pure",
    "train speed vs fp32",
    "inference",
    "infer speed vs autocast",
    "infer speed vs pure",
    "casts/fwd train",
    "casts/fwd infer",
    "saved for backward",
    "saved / fp32's",
)


def _x(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}x"


def results_table(results: Sequence[Result], settings: BenchSettings) -> Table:
    """One row per (model, variant)."""
    dtype = dtype_name(settings.dtype)
    emulated = " emulated" if settings.emulate else ""
    table = Table(
        title=f"mixprec bench ({dtype}{emulated}, {settings.device}): median ms; "
        "speed vs X = t(X) / t(variant): above 1x is faster than X",
        caption=(
            f"{settings.repeats} timed rounds after {settings.warmup} warm-up calls, variants "
            "interleaved; 'pure' is model.to(" + dtype + "); saved for backward excludes "
            "the model's own Parameters"
        ),
    )
    for index, column in enumerate(BENCH_COLUMNS):
        table.add_column(column, justify="left" if index < 2 else "right")
    previous = None
    for r in results:
        if previous is not None and r.case != previous:
            table.add_section()
        previous = r.case
        table.add_row(
            r.case,
            r.variant,
            f"{r.train_ms:.1f} ms",
            _x(r.ratios["train_vs_autocast"]),
            _x(r.ratios["train_vs_pure"]),
            _x(r.ratios["train_vs_fp32"]),
            f"{r.infer_ms:.2f} ms",
            _x(r.ratios["infer_vs_autocast"]),
            _x(r.ratios["infer_vs_pure"]),
            str(r.casts_train),
            str(r.casts_infer),
            format_bytes(r.saved_bytes),
            _x(r.ratios["saved_vs_fp32"]),
        )
    return table


def goals_table(results: Sequence[Result]) -> Table:
    """mixprec's performance goals: target, measured value, met or not, per model."""
    table = Table(title="goals (low precision)")
    for column in ("model", "goal", "target", "measured", "met"):
        table.add_column(column, justify="right" if column in ("measured", "met") else "left")
    for check in goals(results):
        value = check["value"]
        shown = str(value) if isinstance(value, int) else f"{value:.3f}x"
        table.add_row(
            check["case"], check["goal"], check["target"], shown, "yes" if check["met"] else "NO"
        )
    return table


def bench_dict(
    results: Sequence[Result],
    settings: BenchSettings,
    described: Mapping[str, str],
    machine: Mapping[str, Any],
) -> dict[str, Any]:
    """Everything as a JSON-ready dict: machine, settings, models, results and goals."""
    chosen = asdict(settings)
    chosen["dtype"] = dtype_name(settings.dtype)
    return {
        "machine": dict(machine),
        "settings": chosen,
        "models": dict(described),
        "results": [asdict(r) for r in results],
        "goals": goals(results),
    }
