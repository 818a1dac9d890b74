"""The lists, applied at run time, to the ops of code that cannot be traced.

A module whose own ``forward`` cannot be traced keeps its class and code; its children
are converted like any other part of the model, and the ops of its own ``forward`` run
under :class:`RuntimeListMode`, a ``TorchFunctionMode`` that makes, call by call, the
decision the graph rewrite would have made ahead of time (the same
:meth:`mixprec.policy.levels.Recipe.decide`). The mode is entered with a ``with`` block, so it is
exited even when the forward raises, and it stands aside while a converted child runs
(the child has its own casts already).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mixprec.policy.levels import Level, Precision, Recipe
from mixprec.policy.ops import cast_tree, op_key, widest_dtype

__all__ = ["RuntimeForward", "RuntimeListMode", "stand_aside"]


class RuntimeListMode(TorchFunctionMode):
    """Applies a recipe's lists to each torch function call made while it is active."""

    def __init__(self, recipe: Recipe, scopes: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        self.recipe = recipe
        self.scopes = tuple(scopes)
        self.suspended = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.suspended:
            return func(*args, **kwargs)
        key = op_key(func)
        if isinstance(key, str) and key.endswith("_"):
            return func(*args, **kwargs)  # in-place: never cast the tensor being written
        precision = self.recipe.decide(key, self.scopes)
        if precision is Precision.FOLLOW:
            return func(*args, **kwargs)
        if precision is Precision.LOW:
            dtype: torch.dtype | None = self.recipe.dtype
        elif precision is Precision.FP32:
            dtype = torch.float32
        else:
            dtype = widest_dtype(args, kwargs)
        if dtype is not None:
            args, kwargs = cast_tree((args, kwargs), dtype)
        out = func(*args, **kwargs)
        if precision is Precision.LOW and self.recipe.level is Level.O1:
            out = cast_tree(out, torch.float32)
        return out


def _active_modes() -> list[RuntimeListMode]:
    stack = torch.overrides._get_current_function_mode_stack()
    return [mode for mode in stack if isinstance(mode, RuntimeListMode)]


def _suspend(module: nn.Module, args: Any) -> None:
    for mode in _active_modes():
        mode.suspended += 1


def _resume(module: nn.Module, args: Any, output: Any) -> None:
    for mode in _active_modes():
        mode.suspended -= 1


def stand_aside(child: nn.Module) -> None:
    """Make every active :class:`RuntimeListMode` ignore ops while ``child`` runs (the
    child is converted already). The resume hook runs even when the child raises."""
    child.register_forward_pre_hook(_suspend)
    child.register_forward_hook(_resume, always_call=True)


class RuntimeForward:
    """The ``forward`` of a module handled at run time (set on the instance)."""

    def __init__(
        self,
        module: nn.Module,
        recipe: Recipe,
        scopes: Sequence[tuple[str, nn.Module]],
        output_dtype: torch.dtype | None,
    ) -> None:
        self.module = module
        self.recipe = recipe
        self.scopes = tuple(scopes)
        self.output_dtype = output_dtype
        self.inner: Callable[..., Any] | None = module.__dict__.get("forward")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with RuntimeListMode(self.recipe, self.scopes):
            if self.inner is not None:
                out = self.inner(*args, **kwargs)
            else:
                out = type(self.module).forward(self.module, *args, **kwargs)
        return out if self.output_dtype is None else cast_tree(out, self.output_dtype)
