"""Copies of a module tree that share its Parameters and buffers.

Converting never edits the user's module: it edits a *structural copy*, a new tree of
modules of the same classes whose ``_parameters`` and ``_buffers`` hold the very same
tensor objects. An optimizer built on the original keeps updating the weights the copy
computes with; hooks or children added to the copy do not reach the original.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

__all__ = ["CONVERSION_ATTR", "conversion_of", "find_converted", "structural_copy"]

#: The attribute a converted module carries (a :class:`mixprec.convert.plan.Conversion`).
CONVERSION_ATTR = "_mixprec_conversion"


def structural_copy(module: nn.Module, memo: dict[int, nn.Module] | None = None) -> nn.Module:
    """A new module tree of the same classes, sharing every Parameter and buffer.

    A submodule that appears twice in the tree (a shared block) is copied once and
    appears twice in the copy. Hook dictionaries are copied, so hooks registered on the
    copy stay on the copy.
    """
    memo = {} if memo is None else memo
    if id(module) in memo:
        return memo[id(module)]
    cls = type(module)
    new = cls.__new__(cls)
    state = dict(module.__dict__)
    for key, value in module.__dict__.items():
        if "hooks" in key and isinstance(value, dict):
            state[key] = type(value)(value)
    state["_parameters"] = dict(module._parameters)
    state["_buffers"] = dict(module._buffers)
    state["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
    new.__dict__.update(state)
    memo[id(module)] = new
    new._modules = {
        name: None if child is None else structural_copy(child, memo)
        for name, child in module._modules.items()
    }
    return new


def conversion_of(module: nn.Module) -> object | None:
    """The conversion record of a converted module, or None."""
    return module.__dict__.get(CONVERSION_ATTR)


def find_converted(module: nn.Module) -> Iterator[str]:
    """Qualified names of already-converted modules in a tree."""
    for name, sub in module.named_modules():
        if conversion_of(sub) is not None:
            yield name
