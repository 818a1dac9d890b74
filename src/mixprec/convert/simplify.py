"""Redundant-cast removal.

Five rewrites, repeated until nothing changes, each valid whatever the model's inputs are:

1. **round trip**: ``cast(cast(v, float32), D)`` is ``cast(v, D)``: float32 holds every
   16-bit value exactly, so going through it changes nothing. This is what keeps
   ``conv -> relu -> conv`` under O1 entirely in low precision.
2. **no-op**: ``cast(v, D)`` is ``v`` when ``v`` is known to be ``D`` (or not castable)
   whatever the inputs are (see :class:`mixprec.convert.infer.Info.exact`).
3. **sinking through value-preserving ops**: ``reshape(cast(v, float32))`` is
   ``cast(reshape(v), float32)`` (for any ``v``) for ops whose outputs are some of their input's values
   (view, reshape, permute, transpose, indexing, unbind, split, max pooling, ...): the
   results are the same bits in either order. Moving the cast below them lets rule 1 remove
   a round trip between two low ops that a reshape or a max-pool separates (attention
   heads, conv-relu-pool-conv), where MindSpore's insertion would cast up and down again.
4. **one cast per value and dtype**: two casts of one value to one dtype are one.
5. **dead casts**: a cast nobody uses is removed (so a float32 cast whose users were all
   casts back to the low dtype disappears, MindSpore's rule; a branch that needs float32,
   such as a BatchNorm after a conv, keeps its own float32 copy).
"""

from __future__ import annotations

import torch
from torch import fx, nn

from mixprec.convert.infer import ChildInfo, Info, infer
from mixprec.convert.insert import CAST_TAG, is_helper, mutated
from mixprec.policy import ops

__all__ = ["VALUE_PRESERVING", "count_casts", "simplify"]

#: Ops whose outputs are some of their input's values (data movement and max selection):
#: they give the same values in any floating dtype.
VALUE_PRESERVING = frozenset(
    (
        "view",
        "reshape",
        "permute",
        "transpose",
        "t",
        "swapaxes",
        "movedim",
        "flatten",
        "unflatten",
        "squeeze",
        "unsqueeze",
        "contiguous",
        "expand",
        "getitem",
        "unbind",
        "split",
        "chunk",
        "narrow",
        "select",
        "flip",
        "roll",
        "repeat",
        "tile",
        "max_pool1d",
        "max_pool2d",
        "max_pool3d",
        "adaptive_max_pool1d",
        "adaptive_max_pool2d",
        "adaptive_max_pool3d",
    )
)


def _is_cast(node: object) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is ops.cast


def count_casts(graph: fx.Graph) -> int:
    return sum(1 for node in graph.nodes if _is_cast(node))


def _bypass(node: fx.Node, replacement: fx.Node) -> None:
    node.replace_all_uses_with(replacement)
    node.graph.erase_node(node)


def _fold(graph: fx.Graph, infos: dict[fx.Node, Info]) -> bool:
    """Rules 1 and 2."""
    changed = False
    for node in list(graph.nodes):
        if not _is_cast(node):
            continue
        source, dtype = node.args[0], node.args[1]
        if (
            _is_cast(source)
            and source.args[1] == torch.float32
            and isinstance(dtype, torch.dtype)
            and not _written(source, source.args[0])
        ):
            node.args = (source.args[0], dtype)
            source = node.args[0]
            changed = True
        info = infos.get(source)
        if info is None or not info.exact or not isinstance(dtype, torch.dtype):
            continue
        if info.dtype == dtype or (info.dtype is not None and not info.castable):
            _bypass(node, source)
            changed = True
    return changed


def _written(*nodes: object) -> bool:
    """Is any of these values written in place somewhere? Then its casts stay where they are:
    moving, merging or skipping one would read the value before or after the write."""
    return any(isinstance(n, fx.Node) and mutated(n) for n in nodes)


def _moves_only(node: fx.Node, cast: fx.Node, infos: dict[fx.Node, Info]) -> bool:
    """Is ``node`` a value-preserving op whose only floating input is ``cast``?"""
    if node.op not in ("call_function", "call_method") or is_helper(node):
        return False
    if ops.op_name(node.target) not in VALUE_PRESERVING:
        return False
    others = [n for n in node.all_input_nodes if n is not cast]
    return all(
        infos.get(n, Info("unknown")).kind == "other" or _exact_non_float(infos.get(n))
        for n in others
    )


def _exact_non_float(info: Info | None) -> bool:
    return (
        info is not None
        and info.exact
        and info.dtype is not None
        and not info.dtype.is_floating_point
    )


def _sink(graph: fx.Graph, infos: dict[fx.Node, Info]) -> bool:
    """Rule 3: move float32 casts of exact low values below data-movement ops."""
    changed = False
    for cast in list(graph.nodes):
        if not _is_cast(cast) or cast.args[1] != torch.float32:
            continue
        source = cast.args[0]
        info = infos.get(source)
        # valid for any source (the moved ops preserve values in every dtype); worth it
        # only for a value assumed low, whose float32 round trip it then removes
        if info is None or not info.castable or info.dtype == torch.float32:
            continue
        if _written(cast, source):
            continue
        for user in list(cast.users):
            if not _moves_only(user, cast, infos) or _written(user):
                continue
            user.replace_input_with(cast, source)
            with graph.inserting_after(user):
                below = graph.call_function(ops.cast, (user, torch.float32))
            below.meta[CAST_TAG] = "after"
            user.replace_all_uses_with(below, delete_user_cb=lambda u, below=below: u is not below)
            changed = True
    return changed


def _dedupe_and_sweep(graph: fx.Graph) -> bool:
    """Rules 4 and 5."""
    changed = False
    seen: dict[tuple[object, object], fx.Node] = {}
    for node in list(graph.nodes):
        if not _is_cast(node):
            continue
        key = (node.args[0], node.args[1])
        if _written(node, node.args[0]):
            continue
        if key in seen:
            _bypass(node, seen[key])
            changed = True
        else:
            seen[key] = node
    for node in reversed(list(graph.nodes)):
        if is_helper(node) and not node.users:
            graph.erase_node(node)
            changed = True
    return changed


def simplify(graph: fx.Graph, root: nn.Module, child: ChildInfo | None = None) -> int:
    """Remove redundant casts from ``graph`` in place; returns how many were removed
    (casts moved by rule 3 are counted where they end up). ``child`` says what a child
    module call returns (see :func:`~mixprec.convert.infer.infer`)."""
    before = count_casts(graph)
    while True:
        changed = _fold(graph, infer(graph, root, child=child))
        changed |= _sink(graph, infer(graph, root, child=child))
        changed |= _dedupe_and_sweep(graph)
        if not changed:
            break
    return max(before - count_casts(graph), 0)
