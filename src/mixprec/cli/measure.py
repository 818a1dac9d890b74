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


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """Where a measurement ran: CPU model, cores, torch threads and versions."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
