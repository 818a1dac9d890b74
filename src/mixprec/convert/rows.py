"""The cast-plan rows of a converted graph.

One row per op or module call, in execution order, with each real cast attributed once:
a cast inserted after an op (O1's cast back to float32) to that op's "casts after", any
other cast to the first op that uses it, casts of the model's outputs to a final row. A
cast counts when, under the plan's assumption (floating inputs are float32 tensors), it
changes a dtype at run time.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn

from mixprec.convert.infer import Info, infer
from mixprec.convert.insert import CAST_TAG, PRECISION_TAG, is_helper
from mixprec.convert.plan import PlanRow, dtype_name
from mixprec.policy import ops
from mixprec.policy.levels import Precision, Recipe

__all__ = ["graph_rows"]

UNKNOWN = Info("unknown")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _label(node: Any, path: str) -> str:
    if not isinstance(node, fx.Node):
        return repr(node)
    if node.op in ("get_attr", "call_module"):
        return _join(path, str(node.target))
    if node.op == "placeholder":
        return str(node.target)
    return node.name


def _target_dtype(cast: fx.Node, infos: dict[fx.Node, Info]) -> torch.dtype | None:
    dtype = cast.args[1]
    if isinstance(dtype, fx.Node):  # promote: the widest floating input
        inputs = [infos.get(n, UNKNOWN) for n in dtype.all_input_nodes]
        return ops.widest_dtype(*[torch.empty(0, dtype=i.dtype) for i in inputs if i.castable])
    return dtype if isinstance(dtype, torch.dtype) else None


def _attribute_casts(
    graph: fx.Graph, infos: dict[fx.Node, Info], path: str
) -> tuple[dict[fx.Node, list[str]], dict[fx.Node, list[str]], list[str]]:
    before: dict[fx.Node, list[str]] = {}
    after: dict[fx.Node, list[str]] = {}
    outputs: list[str] = []
    for node in graph.nodes:
        if not (is_helper(node) and node.target is ops.cast):
            continue
        source = node.args[0]
        info = infos.get(source, UNKNOWN)
        target = _target_dtype(node, infos)
        if not info.castable or target is None or info.dtype == target:
            continue  # a no-op at run time under the plan's assumption
        text = f"{_label(source, path)} -> {dtype_name(target)}"
        users = [u for u in node.users if not is_helper(u)]
        if node.meta.get(CAST_TAG) == "after" and isinstance(source, fx.Node):
            after.setdefault(source, []).append(text)
        elif users and users[0].op != "output":
            before.setdefault(users[0], []).append(text)
        else:
            outputs.append(text)
    return before, after, outputs


def graph_rows(
    graph: fx.Graph,
    root: nn.Module,
    path: str,
    recipe: Recipe,
    scopes_of: Callable[[fx.Node], Sequence[tuple[str, nn.Module]]],
    leaf_rows: dict[fx.Node, list[PlanRow]],
) -> list[PlanRow]:
    """The rows of ``graph`` (converted from ``root``, at ``path`` in the model).

    ``leaf_rows`` holds, per ``call_module`` node, the rows its conversion produced: a low
    unit's row (whose weight casts join the call's row), or a run-time part's rows (which
    replace the call's row).
    """
    infos = infer(graph, root)
    before, after, outputs = _attribute_casts(graph, infos, path)
    rows: list[PlanRow] = []
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module") or is_helper(node):
            continue
        info = infos.get(node, UNKNOWN)
        plain_index = node.target is operator.getitem and node not in before and node not in after
        if info.kind == "other" or plain_index:
            continue  # shapes, sizes and plain indexing are not ops worth a row
        extra = leaf_rows.get(node) or []
        if extra and extra[0].dtype == "at run time":
            rows.extend(extra)
            continue
        if node.op == "call_module":
            where = _join(path, str(node.target))
            op = type(root.get_submodule(str(node.target))).__name__
        else:
            scopes = scopes_of(node)
            where = scopes[-1][0] if scopes else path
            op = ops.op_name(node.target)
        precision = node.meta.get(PRECISION_TAG, Precision.FOLLOW)
        if precision is Precision.LOW:
            computes = dtype_name(recipe.dtype)
        elif precision is Precision.FP32:
            computes = "float32"
        else:
            computes = dtype_name(info.dtype) if info.dtype is not None else "follows inputs"
        unit_casts = tuple(extra[0].casts_before) if extra else ()
        casts_before = tuple(before.get(node, ())) + unit_casts
        note = "unit" if extra else ""
        rows.append(
            PlanRow(where, op, computes, casts_before, tuple(after.get(node, ())), note=note)
        )
    if outputs:
        rows.append(PlanRow(path, "outputs", "float32", (), tuple(outputs)))
    return rows
