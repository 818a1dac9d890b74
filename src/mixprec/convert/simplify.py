"""Redundant-cast removal.

Four rewrites, repeated until nothing changes, each valid whatever the model's inputs are:

1. **round trip**: ``cast(cast(v, float32), D)`` is ``cast(v, D)``: float32 holds every
   16-bit value exactly, so going through it changes nothing. This is what keeps
   ``conv -> relu -> conv`` under O1 entirely in low precision.
2. **no-op**: ``cast(v, D)`` is ``v`` when ``v`` is known to be ``D`` (or not castable)
   whatever the inputs are (see :class:`mixprec.convert.infer.Info.exact`).
3. **one cast per value and dtype**: two casts of one value to one dtype are one.
4. **dead casts**: a cast nobody uses is removed (so a float32 cast whose users were all
   casts back to the low dtype disappears, MindSpore's rule; a branch that needs float32,
   such as a BatchNorm after a conv, keeps its own float32 copy).
"""

from __future__ import annotations

import torch
from torch import fx, nn

from mixprec import ops
from mixprec.convert.infer import infer
from mixprec.convert.insert import is_helper

__all__ = ["count_casts", "simplify"]


def _is_cast(node: object) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is ops.cast


def count_casts(graph: fx.Graph) -> int:
    return sum(1 for node in graph.nodes if _is_cast(node))


def _bypass(node: fx.Node, replacement: fx.Node) -> None:
    node.replace_all_uses_with(replacement)
    node.graph.erase_node(node)


def simplify(graph: fx.Graph, root: nn.Module) -> int:
    """Remove redundant casts from ``graph`` in place; returns how many were removed."""
    before = count_casts(graph)
    changed = True
    while changed:
        changed = False
        infos = infer(graph, root)
        for node in list(graph.nodes):
            if not _is_cast(node):
                continue
            source, dtype = node.args[0], node.args[1]
            if (
                _is_cast(source)
                and source.args[1] == torch.float32
                and isinstance(dtype, torch.dtype)
            ):
                node.args = (source.args[0], dtype)
                source = node.args[0]
                changed = True
            info = infos.get(source)
            known = info is not None and info.exact and isinstance(dtype, torch.dtype)
            if known and (info.dtype == dtype or (info.dtype is not None and not info.castable)):  # type: ignore[union-attr]
                _bypass(node, source)
                changed = True
        seen: dict[tuple[object, object], fx.Node] = {}
        for node in list(graph.nodes):
            if not _is_cast(node):
                continue
            key = (node.args[0], node.args[1])
            if key in seen:
                _bypass(node, seen[key])
                changed = True
            else:
                seen[key] = node
        for node in reversed(list(graph.nodes)):
            if is_helper(node) and not node.users:
                graph.erase_node(node)
                changed = True
    return before - count_casts(graph)
