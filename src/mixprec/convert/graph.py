"""Graph conversion (O1 and the autocast level): capture, decide, insert, simplify, plan.

:func:`convert_graph` turns a structural copy of the model into a
:class:`MixedPrecisionGraphModule` whose generated code shows every cast. Parts that
cannot be traced are handled as the design says:

* an untraceable module that computes in low precision as a whole (an LSTM under O1)
  becomes a *low unit*: module-level cast-at-use (see :mod:`module_level`);
* an untraceable built-in that is one op (BatchNorm) is a single call decided by that op;
* any other untraceable module keeps its code, its children are converted recursively,
  and its own ops follow the lists at run time (:mod:`runtime`).
"""

from __future__ import annotations

import copy
import functools
import inspect
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from mixprec import lists, ops
from mixprec.convert.capture import capture
from mixprec.convert.infer import Info, infer
from mixprec.convert.insert import CAST_TAG, PRECISION_TAG, insert_casts, is_helper
from mixprec.convert.module_level import ExtraRepr, make_low_unit
from mixprec.convert.plan import CastPlan, Conversion, PlanRow, dtype_name
from mixprec.convert.runtime import RuntimeForward, stand_aside
from mixprec.convert.simplify import simplify
from mixprec.convert.structure import CONVERSION_ATTR, structural_copy
from mixprec.levels import Precision, Recipe

__all__ = ["MixedPrecisionGraphModule", "convert_graph"]

Scopes = tuple[tuple[str, nn.Module], ...]

_STATE = ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set")


class MixedPrecisionGraphModule(fx.GraphModule):
    """A ``GraphModule`` whose module tree is the original model's.

    ``fx.GraphModule`` keeps only the attributes its graph uses; this one keeps the whole
    tree (every Parameter, buffer and submodule of the original, at the same qualified
    names, non-persistent buffers included), so ``state_dict`` keys equal the original's,
    also after ``copy.deepcopy`` and pickling.

    A graph traced with some None-default arguments fixed to None (see
    :class:`~mixprec.convert.capture.Captured`) dispatches: calls that leave them None run
    the graph, others run ``_mixprec_fallback``, the same model handled at run time.
    """

    def __init__(self, root: nn.Module, graph: fx.Graph, class_name: str = "GraphModule") -> None:
        super().__init__(root, graph, class_name)
        _mirror(self, root)
        if not isinstance(root, fx.GraphModule):
            self.__dict__["extra_repr"] = ExtraRepr(self, "", cls=type(root))

    def specialize(
        self, names: tuple[str, ...], signature: inspect.Signature, fallback: nn.Module
    ) -> None:
        """Run the graph only when the arguments ``names`` are None, else ``fallback``."""
        self.__dict__.update(
            _mixprec_specialized=names, _mixprec_signature=signature, _mixprec_fallback=fallback
        )
        self.recompile()

    def recompile(self) -> Any:
        code = super().recompile()
        if self.__dict__.get("_mixprec_specialized"):
            cls = type(self)
            cls.forward = _dispatching(cls.forward)
        return code

    def __deepcopy__(self, memo: dict[int, Any]) -> MixedPrecisionGraphModule:
        result = super().__deepcopy__(memo)
        for key, value in self.__dict__.items():
            if key in _STATE or key not in result.__dict__:
                result.__dict__[key] = copy.deepcopy(value, memo)
        result.recompile()
        return result  # type: ignore[return-value]

    def __reduce__(self) -> tuple[Any, ...]:
        rebuild, args = super().__reduce__()
        state = {key: self.__dict__[key] for key in _STATE}
        state.update(
            {
                k: v
                for k, v in self.__dict__.items()
                if k.startswith("_mixprec") or k == "extra_repr"
            }
        )
        return (_rebuild, (rebuild, args, state))


def _dispatching(generated: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(generated)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        bound = self.__dict__["_mixprec_signature"].bind(*args, **kwargs)
        if all(bound.arguments.get(name) is None for name in self.__dict__["_mixprec_specialized"]):
            return generated(self, *args, **kwargs)
        return self.__dict__["_mixprec_fallback"](*args, **kwargs)

    return forward


def _rebuild(rebuild: Any, args: tuple[Any, ...], state: dict[str, Any]) -> fx.GraphModule:
    gm = rebuild(*args)
    result = MixedPrecisionGraphModule(gm, gm.graph)
    for key, value in gm.__dict__.items():
        result.__dict__.setdefault(key, value)
    result.__dict__.update(state)
    if isinstance(result.__dict__.get("extra_repr"), ExtraRepr):
        result.__dict__["extra_repr"].module = result
    result.recompile()
    return result


def _mirror(gm: fx.GraphModule, root: nn.Module) -> None:
    """Give ``gm`` the whole module tree and public attributes of ``root``.

    Tensors tracing created (``torch.tensor([...])`` constants in ``forward``) stay, as
    non-persistent buffers, so ``state_dict`` keys are exactly the original's.
    """
    constants = {k: v for k, v in gm._buffers.items() if k not in root._buffers}
    gm.__dict__["_modules"] = root._modules
    gm.__dict__["_parameters"] = root._parameters
    gm.__dict__["_buffers"] = {**root._buffers, **constants}
    gm.__dict__["_non_persistent_buffers_set"] = set(root._non_persistent_buffers_set) | set(
        constants
    )
    gm.training = root.training
    for key, value in root.__dict__.items():
        if "hooks" in key and isinstance(value, dict) and value:
            gm.__dict__[key] = type(value)(value)
        elif (
            not key.startswith("_")
            and key not in gm.__dict__
            and key not in ("forward", "extra_repr")
        ):
            gm.__dict__[key] = value


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _module_op(module: nn.Module) -> str | None:
    for cls, name in lists.MODULE_OPS:
        if type(module) is cls:
            return name
    return None


@dataclass
class _Plan:
    """Plan pieces gathered while converting (recursively)."""

    rows: list[PlanRow] = field(default_factory=list)
    removed: int = 0
    runtime: list[str] = field(default_factory=list)


def convert_graph(network: nn.Module, recipe: Recipe, *, copy: bool = True) -> nn.Module:
    """Convert ``network`` for O1 or the autocast level (see module docstring)."""
    root = structural_copy(network) if copy else network
    plan = _Plan()
    output = torch.float32 if recipe.casts_outputs_to_fp32 else None
    converted = _convert(root, recipe, "", (("", root),), output, plan)
    cast_plan = CastPlan(
        level=recipe.level.value,
        dtype=dtype_name(recipe.dtype),
        rows=tuple(plan.rows),
        casts_removed=plan.removed,
        runtime_parts=tuple(plan.runtime),
    )
    converted.__dict__[CONVERSION_ATTR] = Conversion(recipe, cast_plan)
    previous = converted.__dict__.get("extra_repr")
    cls = previous.cls if isinstance(previous, ExtraRepr) else type(converted)
    converted.__dict__["extra_repr"] = ExtraRepr(
        converted, f"mixprec: {recipe.describe()}", cls=cls
    )
    return converted


def _convert(
    module: nn.Module,
    recipe: Recipe,
    path: str,
    scopes: Scopes,
    output_dtype: torch.dtype | None,
    plan: _Plan,
) -> nn.Module:
    """Convert one module (already a structural copy) in place or into a graph module."""
    try:
        captured = capture(module, recipe.leaf_functions)
    except Exception as error:
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if recipe.decide(_module_op(module), scopes) is Precision.LOW:
            return _low_unit(module, recipe, path, plan)
        return _runtime_part(module, recipe, path, scopes, output_dtype, plan, reason)
    graph, untraceable = captured.graph, captured.untraceable
    pristine = structural_copy(module) if captured.specialized else None

    def scopes_of(node: fx.Node) -> Scopes:
        stack = node.meta.get("nn_module_stack") or {}
        inner = tuple((_join(path, name), module.get_submodule(name)) for name, _ in stack.values())
        return scopes + inner

    decisions: dict[fx.Node, Precision] = {}
    leaf_rows: dict[fx.Node, list[PlanRow]] = {}
    for node in list(graph.nodes):
        if node.op in ("call_function", "call_method"):
            decisions[node] = recipe.decide(ops.op_key(node.target), scopes_of(node))
        elif node.op == "call_module":
            decisions[node], leaf_rows[node] = _convert_leaf(
                node, module, recipe, path, scopes_of(node), untraceable, plan
            )

    infos = infer(graph, module)
    insert_casts(
        graph, recipe, lambda node: decisions.get(node, Precision.FOLLOW), infos, output_dtype
    )
    plan.removed += simplify(graph, module)
    gm = MixedPrecisionGraphModule(module, graph, class_name=type(module).__name__)
    plan.rows.extend(_rows(gm.graph, module, path, recipe, scopes_of, leaf_rows))
    if pristine is not None:
        names = ", ".join(f"{name}=None" for name in captured.specialized)
        plan.rows.append(
            PlanRow(
                path,
                type(module).__name__,
                "-",
                note=f"graph traced with {names}; other values run at run time",
            )
        )
        fallback = _runtime_part(
            pristine,
            recipe,
            path,
            scopes,
            output_dtype,
            _Plan(),
            "called with a specialized argument",
        )
        gm.specialize(captured.specialized, inspect.signature(module.forward), fallback)
    return gm


def _low_unit(module: nn.Module, recipe: Recipe, path: str, plan: _Plan) -> nn.Module:
    """An untraceable module that computes in low precision as a whole."""
    unit = make_low_unit(module, recipe, prefix=path)
    weights = [
        cast
        for row in unit.__dict__[CONVERSION_ATTR].plan.rows
        if row.note == "weights"
        for cast in row.casts_before
    ]
    plan.rows.append(
        PlanRow(path, type(module).__name__, dtype_name(recipe.dtype), tuple(weights), note="unit")
    )
    return unit


def _convert_leaf(
    node: fx.Node,
    parent: nn.Module,
    recipe: Recipe,
    parent_path: str,
    scopes: Scopes,
    untraceable: dict[str, str],
    plan: _Plan,
) -> tuple[Precision, list[PlanRow]]:
    """Decide and convert one ``call_module`` leaf of ``parent``'s graph."""
    name = str(node.target)
    path = _join(parent_path, name)
    sub = parent.get_submodule(name)
    op = _module_op(sub)
    node.meta["mixprec_op"] = op
    precision = recipe.decide(op, scopes)
    if precision is Precision.LOW:
        unit = make_low_unit(sub, recipe, prefix=path)
        node.meta["mixprec_out"] = Info("unknown", recipe.dtype, exact=False)
        unit_plan = unit.__dict__[CONVERSION_ATTR].plan
        weights = [
            cast for row in unit_plan.rows if row.note == "weights" for cast in row.casts_before
        ]
        return precision, [
            PlanRow(path, type(sub).__name__, dtype_name(recipe.dtype), tuple(weights), note="unit")
        ]
    if precision is not Precision.FOLLOW or op is not None:
        return precision, []
    start = len(plan.rows)
    reason = untraceable.get(name, "")
    _runtime_part(sub, recipe, path, scopes, None, plan, reason)
    rows = plan.rows[start:]
    del plan.rows[start:]
    return Precision.FOLLOW, rows


def _runtime_part(
    module: nn.Module,
    recipe: Recipe,
    path: str,
    scopes: Scopes,
    output_dtype: torch.dtype | None,
    plan: _Plan,
    reason: str,
) -> nn.Module:
    """Keep ``module``'s code, convert its children, apply the lists to its ops at run time."""
    plan.runtime.append(path)
    plan.rows.append(
        PlanRow(path, type(module).__name__, "at run time", note=f"not traceable ({reason})")
    )
    for name, child in list(module._modules.items()):
        if child is None:
            continue
        child_path = _join(path, name)
        child_scopes = (*scopes, (child_path, child))
        if (
            _module_op(child) is not None
            and recipe.decide(_module_op(child), child_scopes) is Precision.FOLLOW
        ):
            continue  # a one-op built-in the lists leave alone
        converted = _convert(child, recipe, child_path, child_scopes, None, plan)
        stand_aside(converted)
        module._modules[name] = converted
    module.__dict__["forward"] = RuntimeForward(module, recipe, scopes, output_dtype)
    return module


def _label(node: Any, path: str) -> str:
    if not isinstance(node, fx.Node):
        return repr(node)
    if node.op in ("get_attr", "call_module"):
        return _join(path, str(node.target))
    if node.op == "placeholder":
        return str(node.target)
    return node.name


def _rows(
    graph: fx.Graph,
    root: nn.Module,
    path: str,
    recipe: Recipe,
    scopes_of: Any,
    leaf_rows: dict[fx.Node, list[PlanRow]],
) -> list[PlanRow]:
    """The plan rows of a converted graph: one per op, with the casts attributed to it."""
    infos = infer(graph, root)
    before: dict[fx.Node, list[str]] = {}
    after: dict[fx.Node, list[str]] = {}
    outputs: list[str] = []
    for node in graph.nodes:
        if not (is_helper(node) and node.target is ops.cast):
            continue
        source, dtype = node.args[0], node.args[1]
        info = infos.get(source, Info("unknown"))
        if isinstance(dtype, fx.Node):
            inputs = [infos.get(n, Info("unknown")) for n in dtype.all_input_nodes]
            widest = ops.widest_dtype(
                *[torch.empty(0, dtype=i.dtype) for i in inputs if i.castable]
            )
            target = widest
        else:
            target = dtype
        if not info.castable or target is None or info.dtype == target:
            continue  # a no-op at run time under the plan's assumption
        text = f"{_label(source, path)} -> {dtype_name(target)}"
        users = [u for u in node.users if not is_helper(u)]
        tag = node.meta.get(CAST_TAG)
        if tag == "after" and isinstance(source, fx.Node):
            after.setdefault(source, []).append(text)
        elif users and users[0].op != "output":
            before.setdefault(users[0], []).append(text)
        else:
            outputs.append(text)
    rows: list[PlanRow] = []
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module") or is_helper(node):
            continue
        info = infos.get(node, Info("unknown"))
        precision = node.meta.get(PRECISION_TAG, Precision.FOLLOW)
        if info.kind == "other" or (
            node.target is operator.getitem and node not in before and node not in after
        ):
            continue  # shapes, sizes and plain indexing are not ops worth a row
        extra = leaf_rows.get(node)
        if (
            node.op == "call_module"
            and extra is not None
            and extra
            and extra[0].dtype == "at run time"
        ):
            rows.extend(extra)
            continue
        inner = scopes_of(node)
        where = inner[-1][0] if inner else path
        if node.op == "call_module":
            where = _join(path, str(node.target))
            op = type(root.get_submodule(str(node.target))).__name__
        else:
            op = ops.op_name(node.target)
        if precision is Precision.LOW:
            computes = dtype_name(recipe.dtype)
        elif precision is Precision.FP32:
            computes = "float32"
        else:
            computes = dtype_name(info.dtype) if info.dtype is not None else "follows inputs"
        unit_casts = tuple(extra[0].casts_before) if extra else ()
        rows.append(
            PlanRow(
                where,
                op,
                computes,
                tuple(before.get(node, ())) + unit_casts,
                tuple(after.get(node, ())),
                note="unit" if extra else "",
            )
        )
    if outputs:
        rows.append(PlanRow(path, "outputs", "float32", (), tuple(outputs)))
    return rows
