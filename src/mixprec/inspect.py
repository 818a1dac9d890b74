"""Measuring tools: how many casts a forward makes, how many bytes autograd keeps.

The tests, the benchmarks, the demo and ``mixprec bench`` count with these; use them to
check a conversion of your own model.

- :class:`CastCounter`: counts the dtype-changing copies (``aten._to_copy`` whose result
  has a new dtype) made while it is active, whoever makes them (mixprec's casts,
  ``torch.autocast``'s, the user's own ``.to()``).
- :class:`SavedBytes`: the bytes that autograd keeps alive for backward, through
  ``torch.autograd.graph.saved_tensors_hooks``; each storage counted once, the tensors
  you exclude (the model's own Parameters and buffers, alive anyway) not counted; a
  low-precision *copy* of a weight saved for backward is counted, because it is extra
  memory.

Example:
    >>> from mixprec.inspect import CastCounter
    >>> fast = mixprec.auto_mixed_precision(model, "O2")
    >>> with CastCounter() as counter:
    ...     fast(x)
    >>> counter.total, dict(counter.casts)  # doctest: +SKIP
    (8, {(torch.float32, torch.bfloat16): 7, (torch.bfloat16, torch.float32): 1})
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CastCounter", "SavedBytes"]


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
                self.record(source.dtype, out.dtype)
        return out

    def record(self, source: torch.dtype, target: torch.dtype) -> None:
        """Count one cast (a subclass may note more about it)."""
        self.casts[(source, target)] += 1

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
