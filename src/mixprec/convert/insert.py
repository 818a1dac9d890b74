"""Cast insertion for O1 and the autocast level.

Each op of the graph gets a precision from :meth:`mixprec.policy.levels.Recipe.decide` and its
floating inputs are cast accordingly:

* LOW: floating inputs (weights included) cast to the low dtype; under O1 the result is
  cast back to float32 right after the op (MindSpore's insertion; :mod:`simplify` removes
  the round trips this creates between consecutive low-precision ops);
* FP32: low inputs cast up to float32;
* PROMOTE: every floating input cast to the widest floating input type, found at run time;
* FOLLOW: nothing.

Casts are :func:`mixprec.policy.ops.cast` calls, tagged in ``node.meta["mixprec_cast"]`` with
where they were inserted ("before" an op, "after" it, or at the "output").
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from mixprec.convert.infer import Info
from mixprec.policy import ops
from mixprec.policy.levels import Level, Precision, Recipe

__all__ = ["CAST_TAG", "PRECISION_TAG", "insert_casts", "is_helper", "is_mutation", "mutated"]

CAST_TAG = "mixprec_cast"
INPLACE_TAG = "mixprec_inplace"
PRECISION_TAG = "mixprec_precision"


def is_helper(node: Any) -> bool:
    """True for nodes mixprec inserted (casts and widest-dtype lookups)."""
    return (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and node.target in (ops.cast, ops.widest_dtype)
    )


def is_mutation(node: fx.Node) -> bool:
    """Does this call write into its first argument (``x.add_(y)``, ``x += y``,
    ``F.relu(x, inplace=True)``)?"""
    if node.op == "call_module":
        return bool(node.meta.get(INPLACE_TAG))  # a child built to write its input
    if node.op not in ("call_function", "call_method"):
        return False
    name = ops.op_name(node.target)
    return (name.endswith("_") and not name.endswith("__")) or node.kwargs.get("inplace") is True


def mutated(node: fx.Node) -> bool:
    """Is the value of ``node`` written into by one of its users?"""
    return any(is_mutation(user) and user.args and user.args[0] is node for user in node.users)


def _functionalize(graph: fx.Graph) -> None:
    """``F.relu(x, inplace=True)`` becomes ``F.relu(x)`` where nothing reads ``x`` after it
    (the usual ``out = self.relu(out)``), so it can be cast like any op; where the mutation
    is observed, the call stays in place and is never cast."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in graph.nodes:
        if (
            node.kwargs.get("inplace") is not True
            or not node.args
            or not isinstance(node.args[0], fx.Node)
        ):
            continue
        target = node.args[0]
        if target.op == "placeholder":
            continue  # the caller's tensor: the write is what the caller asked for
        if all(order[user] <= order[node] for user in target.users):
            node.kwargs = {**node.kwargs, "inplace": False}


def _cast_before(
    graph: fx.Graph, node: fx.Node, dtype: torch.dtype | fx.Node, infos: dict[fx.Node, Info]
) -> None:
    def rewrite(arg: fx.Node) -> fx.Node:
        if infos.get(arg, Info("unknown")).kind == "other":
            return arg
        with graph.inserting_before(node):
            cast = graph.call_function(ops.cast, (arg, dtype))
        cast.meta[CAST_TAG] = "before"
        return cast

    node.args = fx.node.map_arg(node.args, rewrite)
    node.kwargs = fx.node.map_arg(node.kwargs, rewrite)


def _cast_after(graph: fx.Graph, node: fx.Node, dtype: torch.dtype) -> None:
    users = list(node.users)
    if users and all(u.op == "call_function" and u.target is operator.getitem for u in users):
        for user in users:  # a tuple result (a recurrent unit's): cast the parts that are used
            _cast_after(graph, user, dtype)
        return
    with graph.inserting_after(node):
        cast = graph.call_function(ops.cast, (node, dtype))
    cast.meta[CAST_TAG] = "after"
    node.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)


def insert_casts(
    graph: fx.Graph,
    recipe: Recipe,
    decide: Callable[[fx.Node], Precision],
    infos: dict[fx.Node, Info],
    output_dtype: torch.dtype | None,
    *,
    cast_back: bool | None = None,
) -> None:
    """Insert the casts every op's precision needs, in place.

    Args:
        graph: the captured graph.
        recipe: the level's recipe.
        decide: the precision of one call node (the caller knows module scopes and leaves).
        infos: static dtype facts about the nodes (see :mod:`mixprec.convert.infer`).
        output_dtype: cast the graph's floating outputs to this (None: leave them).
        cast_back: cast a low op's result back to float32 (default: under O1).
    """
    back = recipe.level is Level.O1 if cast_back is None else cast_back
    _functionalize(graph)
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method", "call_module") or is_helper(node):
            continue
        precision = Precision.FOLLOW
        if infos.get(node, Info("unknown")).kind != "other" and not is_mutation(node):
            precision = decide(node)
        node.meta[PRECISION_TAG] = precision
        if precision is Precision.LOW:
            _cast_before(graph, node, recipe.dtype, infos)
            if back:
                _cast_after(graph, node, torch.float32)
        elif precision is Precision.FP32:
            _cast_before(graph, node, torch.float32, infos)
        elif precision is Precision.PROMOTE:
            with graph.inserting_before(node):
                widest = graph.call_function(ops.widest_dtype, (node.args, node.kwargs))
            _cast_before(graph, node, widest, infos)
    if output_dtype is not None:
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        _cast_before(graph, output, output_dtype, infos)
        for user in output.all_input_nodes:
            if user.meta.get(CAST_TAG) == "before":
                user.meta[CAST_TAG] = "output"
