"""Argument checks shared by the entry points."""

from __future__ import annotations

from torch import nn

__all__ = ["require_module"]


def require_module(value: object, argument: str = "network") -> nn.Module:
    """``value`` if it is a ``torch.nn.Module``; else a TypeError naming ``argument``."""
    if not isinstance(value, nn.Module):
        raise TypeError(
            f"{argument} must be a torch.nn.Module; got {type(value).__name__}: {value!r}"
        )
    return value
