"""What the demo and the benchmark measure: time, casts, and memory kept for backward.

- :func:`median_ms`: the median of wall-clock times, in milliseconds.
- :class:`CastCounter`: counts the dtype-changing copies (``aten._to_copy`` whose result
  has a new dtype) made while it is active, whoever makes them (mixprec's casts,
  ``torch.autocast``'s, the user's own ``.to()``).
- :class:`SavedBytes`: the bytes that autograd keeps alive for backward, through
  ``torch.autograd.graph.saved_tensors_hooks``; each storage counted once, the model's
  own Parameters and buffers not counted (they are alive anyway; a low-precision *copy*
  of a weight saved for backward is counted, because it is extra memory).
"""

from __future__ import annotations

import os
import platform
import statistics
from collections import Counter
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CastCounter", "SavedBytes", "format_bytes", "machine_info", "median_ms"]


def median_ms(seconds: Iterable[float]) -> float:
    """The median of durations given in seconds, in milliseconds (NaN when empty)."""
    values = list(seconds)
    return statistics.median(values) * 1e3 if values else float("nan")


class CastCounter(TorchDispatchMode):
    """Counts dtype-changing copies while active.

    Example:
        >>> with CastCounter() as counter:
        ...     _ = torch.ones(2).to(torch.bfloat16)
        >>> counter.total
        1
    """

    def __init__(self) -> None:
        super().__init__()
        self.casts: Counter[tuple[torch.dtype, torch.dtype]] = Counter()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default:
            source = args[0]
            if isinstance(out, torch.Tensor) and out.dtype != source.dtype:
                self.casts[(source.dtype, out.dtype)] += 1
        return out

    @property
    def total(self) -> int:
        """All dtype-changing copies counted so far."""
        return sum(self.casts.values())


def _storage_key(tensor: torch.Tensor) -> tuple[int, int] | None:
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, ... tensors
        return None
    return storage.data_ptr(), storage.nbytes()


class SavedBytes:
    """Sums the bytes of the tensors saved for backward while active.

    Each storage is counted once, at its full size (a saved view keeps its whole storage
    alive). Storages of the tensors in ``exclude`` (pass the model's Parameters and
    buffers) are not counted.

    Example:
        >>> layer = torch.nn.Linear(4, 4)
        >>> with SavedBytes(exclude=layer.parameters()) as saved:
        ...     _ = layer(torch.randn(2, 4))
        >>> saved.total  # the input, 2 x 4 float32
        32
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {key for t in exclude if (key := _storage_key(t)) is not None}
        self._seen: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key is None:
            self._seen[id(tensor)] = tensor.numel() * tensor.element_size()
        elif key not in self._excluded and key[1] > 0:
            self._seen[key[0]] = max(self._seen.get(key[0], 0), key[1])
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._hooks.__exit__(kind, error, traceback)

    @property
    def total(self) -> int:
        """Bytes saved for backward so far."""
        return sum(self._seen.values())


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
