"""What a model declares must stay float32: transformers' ``_keep_in_fp32_modules``.

A transformers model class may name submodules that must not compute in low precision
(T5's ``wo``, whose activations overflow float16; about fifty model families declare
some). transformers itself keeps those weights in float32 when it loads a model in a low
dtype, with two meanings that mixprec keeps:

* ``_keep_in_fp32_modules``: float32 when the low dtype is float16;
* ``_keep_in_fp32_modules_strict``: float32 for float16 and bfloat16.

:func:`declared_fp32_pin` turns what every module of a network declares into one fp32
pin, which conversion adds to the user's pins at every level (``declared_fp32=False``
turns it off). A declared name matches a module when it is a whole dotted part of the
module's name below the declaring module, as transformers matches it (``"wo"`` pins
``encoder.block.0.layer.1.DenseReluDense.wo``, not ``word_embeddings``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
from torch import nn

from mixprec.policy.levels import Recipe, _either

__all__ = ["DeclaredPin", "declared_fp32_pin", "with_declared_pins"]

STRICT_ATTR = "_keep_in_fp32_modules_strict"
FP16_ATTR = "_keep_in_fp32_modules"


@dataclass(frozen=True)
class DeclaredPin:
    """Pins modules a model declares float32 (picklable).

    Attributes:
        entries: ``(prefix, name)``: the declaring module's qualified name and one declared
            name below it.
    """

    entries: tuple[tuple[str, str], ...]

    def __call__(self, module: nn.Module, name: str) -> bool:
        for prefix, declared in self.entries:
            if prefix:
                if not name.startswith(prefix + "."):
                    continue
                below = name[len(prefix) + 1 :]
            else:
                below = name
            if re.search(rf"(^|\.){re.escape(declared)}($|\.)", below):
                return True
        return False


def declared_fp32_pin(network: nn.Module, dtype: torch.dtype) -> DeclaredPin | None:
    """The fp32 pin for what ``network``'s modules declare at ``dtype``, or None.

    Example:
        >>> class Model(torch.nn.Module):
        ...     _keep_in_fp32_modules = ["wo"]
        >>> declared_fp32_pin(Model(), torch.float16)
        DeclaredPin(entries=(('', 'wo'),))
    """
    attrs = (STRICT_ATTR, FP16_ATTR) if dtype == torch.float16 else (STRICT_ATTR,)
    entries: list[tuple[str, str]] = []
    for prefix, module in network.named_modules():
        for attr in attrs:
            for declared in sorted(getattr(module, attr, None) or ()):
                if isinstance(declared, str) and (prefix, declared) not in entries:
                    entries.append((prefix, declared))
    return DeclaredPin(tuple(entries)) if entries else None


def with_declared_pins(network: nn.Module, recipe: Recipe) -> Recipe:
    """``recipe`` with the network's declared float32 modules added to its fp32 pin."""
    pin = declared_fp32_pin(network, recipe.dtype)
    if pin is None:
        return recipe
    return dataclasses.replace(recipe, fp32_pin=_either(recipe.fp32_pin, pin))
