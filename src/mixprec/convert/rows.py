"""The cast-plan rows of a converted model, read from its modules' graphs.

One row per op or module call, in execution order, with each real cast attributed once:
a cast inserted after an op (O1's cast back to float32) to that op's "casts after", any
other cast to the first op that uses it, casts of the model's outputs to a final row. A
cast counts when, under the plan's assumption (floating inputs are float32 tensors), it
changes a dtype at run time. A child called from a graph contributes its own rows at
the place of the call, once per call, with the dtypes its caller passes it.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx, nn
from torch.fx.proxy import TraceError

from mixprec.convert.infer import Info, infer
from mixprec.convert.insert import CAST_TAG, PRECISION_TAG, is_helper
from mixprec.convert.plan import Cast, PlanRow, RowKind
from mixprec.convert.structure import qualified_name
from mixprec.policy import ops
from mixprec.policy.dtypes import dtype_name
from mixprec.policy.levels import Precision, Recipe

__all__ = ["RowSource", "child_output_info", "reason_in_words"]

UNKNOWN = Info("unknown")
OTHER = Info("other")
_FIRST_INPUT = frozenset(("batch_norm", "instance_norm"))


def reason_in_words(error: BaseException) -> str:
    """Why a forward is not a graph, in plain words."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    if isinstance(error, TraceError) and "control flow" in text:
        return "its forward branches or loops on tensor values (data-dependent control flow)"
    if isinstance(error, TraceError):
        return text if text.startswith(("it ", "forward ")) else f"tracing failed: {text}"
    if "keyword-only argument" in text:
        return f"its forward has a {text}"
    return f"its forward does something a graph cannot record ({type(error).__name__}: {text})"


def _placeholder_infos(
    graph: fx.Graph, node: fx.Node, infos: dict[fx.Node, Info]
) -> dict[str, Info]:
    def info(value: Any) -> Info:
        if isinstance(value, fx.Node):
            return infos.get(value, UNKNOWN)
        return OTHER if not isinstance(value, torch.Tensor) else Info("tensor", value.dtype, True)

    names = [
        str(n.target)
        for n in graph.nodes
        if n.op == "placeholder" and not str(n.target).startswith("*")
    ]
    found = {name: info(arg) for name, arg in zip(names, node.args, strict=False)}
    found.update({k: info(v) for k, v in node.kwargs.items()})
    return found


def _forward_of(module: nn.Module) -> Any:
    return module.__dict__.get("forward")


def child_output_info(
    parent: nn.Module, node: fx.Node, infos: dict[fx.Node, Info], low: torch.dtype
) -> Info:
    """What the child called by ``node`` returns, given its inputs (an assumption)."""
    from mixprec.convert.graph import GraphForward
    from mixprec.convert.runtime import RuntimeForward

    child = parent.get_submodule(str(node.target))
    forward = _forward_of(child)
    if isinstance(forward, GraphForward) and forward.current is not None:
        graph = forward.current.graph
        inner = infer(
            graph,
            child,
            inputs=_placeholder_infos(graph, node, infos),
            child=lambda n, i: child_output_info(child, n, i, low),
        )
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        result = output.args[0]
        return inner.get(result, UNKNOWN) if isinstance(result, fx.Node) else UNKNOWN
    if (
        isinstance(forward, RuntimeForward)
        and forward.default is Precision.LOW
        and not forward.back
    ):
        return Info("unknown", low)
    if node.meta.get("mixprec_op") in _FIRST_INPUT and node.args:
        first = node.args[0]
        return infos.get(first, UNKNOWN) if isinstance(first, fx.Node) else UNKNOWN
    return UNKNOWN


class RowSource:
    """Builds the rows of a converted model (see module docstring)."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.removed = 0
        self.runtime: list[tuple[str, str]] = []

    def module_rows(
        self, module: nn.Module, path: str, inputs: dict[str, Info] | None
    ) -> tuple[list[PlanRow], int]:
        rows = self._rows(module, path, inputs)
        return rows, self.removed

    def _rows(self, module: nn.Module, path: str, inputs: dict[str, Info] | None) -> list[PlanRow]:
        from mixprec.convert.graph import GraphForward, unit_weight_rows
        from mixprec.convert.runtime import PlainForward, RuntimeForward

        forward = _forward_of(module)
        if isinstance(forward, GraphForward) and forward.current is not None:
            self.removed += forward.current.removed
            return self._graph_rows(forward.current.graph, module, path, inputs)
        if (
            isinstance(forward, RuntimeForward)
            and forward.default is Precision.LOW
            and not forward.back
        ):
            return [unit_weight_rows(module, path, self.recipe, inputs is None)]
        rows: list[PlanRow] = []
        if isinstance(forward, (RuntimeForward, PlainForward, GraphForward)):
            if isinstance(forward, RuntimeForward) and module_op_of(module) is not None:
                return rows  # a one-op module: its caller's row says it all
            self.runtime.append((path, forward.reason))
            rows.append(
                PlanRow.make(
                    path,
                    type(module).__name__,
                    "at run time",
                    kind=RowKind.RUNTIME,
                    note=forward.reason,
                )
            )
        for name, child in module._modules.items():
            if child is not None:
                rows += self._rows(child, qualified_name(path, name), None)
        return rows

    def _graph_rows(
        self, graph: fx.Graph, module: nn.Module, path: str, inputs: dict[str, Info] | None
    ) -> list[PlanRow]:
        low = self.recipe.dtype
        infos = infer(
            graph, module, inputs=inputs, child=lambda n, i: child_output_info(module, n, i, low)
        )
        before, after, outputs = _attribute_casts(graph, infos, path)
        rows: list[PlanRow] = []
        for node in graph.nodes:
            if node.op not in ("call_function", "call_method", "call_module") or is_helper(node):
                continue
            info = infos.get(node, UNKNOWN)
            plain_index = (
                node.target is operator.getitem and node not in before and node not in after
            )
            if node.op != "call_module" and (info.kind == "other" or plain_index):
                continue  # shapes, sizes and plain indexing are not ops worth a row
            precision = node.meta.get(PRECISION_TAG, Precision.FOLLOW)
            if precision is Precision.LOW:
                computes = dtype_name(low)
            elif precision is Precision.FP32:
                computes = "float32"
            else:
                computes = dtype_name(info.dtype) if info.dtype is not None else "follows inputs"
            casts = (tuple(before.get(node, ())), tuple(after.get(node, ())))
            if node.op == "call_module":
                target = str(node.target)
                child = module.get_submodule(target)
                where = qualified_name(path, target)
                if casts[0] or casts[1] or module_op_of(child) is not None:
                    kind = RowKind.MODULE if module_op_of(child) else RowKind.UNIT
                    rows.append(
                        PlanRow.make(where, type(child).__name__, computes, *casts, kind=kind)
                    )
                rows += self._rows(child, where, _placeholder_infos_of(child, node, infos))
                continue
            rows.append(PlanRow.make(path, ops.op_name(node.target), computes, *casts))
        if outputs:
            rows.append(PlanRow.make(path, "outputs", "float32", (), outputs, kind=RowKind.OUTPUTS))
        return rows


def module_op_of(module: nn.Module) -> str | None:
    from mixprec.convert.graph import module_op

    return module_op(module)


def _placeholder_infos_of(
    child: nn.Module, node: fx.Node, infos: dict[fx.Node, Info]
) -> dict[str, Info] | None:
    from mixprec.convert.graph import GraphForward

    forward = _forward_of(child)
    if not isinstance(forward, GraphForward) or forward.current is None:
        return {}  # called from a graph: its caller cast its inputs
    return _placeholder_infos(forward.current.graph, node, infos)


def _label(node: Any, path: str) -> str:
    if not isinstance(node, fx.Node):
        return repr(node)
    if node.op in ("get_attr", "call_module"):
        return qualified_name(path, str(node.target))
    if node.op == "placeholder":
        return str(node.target)
    return node.name


def _target_dtype(cast: fx.Node, infos: dict[fx.Node, Info]) -> torch.dtype | None:
    dtype = cast.args[1]
    if isinstance(dtype, fx.Node):  # promote: the widest floating input
        inputs = [infos.get(n, UNKNOWN) for n in dtype.all_input_nodes]
        return ops.widest_of(i.dtype for i in inputs if i.castable and i.dtype is not None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _attribute_casts(
    graph: fx.Graph, infos: dict[fx.Node, Info], path: str
) -> tuple[dict[fx.Node, list[Cast]], dict[fx.Node, list[Cast]], list[Cast]]:
    before: dict[fx.Node, list[Cast]] = {}
    after: dict[fx.Node, list[Cast]] = {}
    outputs: list[Cast] = []
    for node in graph.nodes:
        if not (is_helper(node) and node.target is ops.cast):
            continue
        source = node.args[0]
        info = infos.get(source, UNKNOWN)
        target = _target_dtype(node, infos)
        if not info.castable or target is None or info.dtype == target:
            continue  # a no-op at run time under the plan's assumption
        cast = Cast(_label(source, path), target)
        users = [u for u in node.users if not is_helper(u)]
        if node.meta.get(CAST_TAG) == "after" and isinstance(source, fx.Node):
            after.setdefault(source, []).append(cast)
        elif users and users[0].op != "output":
            before.setdefault(users[0], []).append(cast)
        else:
            outputs.append(cast)
    return before, after, outputs
