"""How the demo and the benchmark report: medians, byte counts and the machine.

The counters themselves (casts, bytes saved for backward) are public in
:mod:`mixprec.inspect`.
"""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Iterable
from typing import Any

import torch

from mixprec.policy.hardware import cpu_name

__all__ = ["format_bytes", "machine_info", "median_ms"]


def median_ms(seconds: Iterable[float]) -> float:
    """The median of durations given in seconds, in milliseconds (NaN when empty)."""
    values = list(seconds)
    return statistics.median(values) * 1e3 if values else float("nan")


def format_bytes(count: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover


def machine_info() -> dict[str, Any]:
    """Where a measurement ran: CPU model, cores, torch threads and versions."""
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
