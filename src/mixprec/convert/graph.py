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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from mixprec.convert.capture import capture
from mixprec.convert.infer import Info, infer
from mixprec.convert.insert import insert_casts
from mixprec.convert.module_level import ExtraRepr, make_low_unit
from mixprec.convert.plan import CastPlan, Conversion, PlanRow, dtype_name
from mixprec.convert.rows import graph_rows
from mixprec.convert.runtime import RuntimeForward, stand_aside
from mixprec.convert.simplify import simplify
from mixprec.convert.structure import CONVERSION_ATTR, structural_copy
from mixprec.policy import lists, ops
from mixprec.policy.levels import Precision, Recipe

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

    def take_since(self, start: int) -> list[PlanRow]:
        taken = self.rows[start:]
        del self.rows[start:]
        return taken


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


def _reason(error: Exception) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}"


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
    except Exception as error:  # the module's own forward cannot be traced
        if recipe.decide(_module_op(module), scopes) is Precision.LOW:
            return _low_unit(module, recipe, path, plan)
        return _runtime_part(module, recipe, path, scopes, output_dtype, plan, _reason(error))
    graph = captured.graph
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
            start = len(plan.rows)
            decisions[node] = _convert_leaf(
                node, module, recipe, path, scopes_of(node), captured.untraceable, plan
            )
            leaf_rows[node] = plan.take_since(start)

    infos = infer(graph, module)
    insert_casts(
        graph, recipe, lambda node: decisions.get(node, Precision.FOLLOW), infos, output_dtype
    )
    plan.removed += simplify(graph, module)
    gm = MixedPrecisionGraphModule(module, graph, class_name=type(module).__name__)
    plan.rows.extend(graph_rows(gm.graph, module, path, recipe, scopes_of, leaf_rows))
    if pristine is not None:
        names = ", ".join(f"{name}=None" for name in captured.specialized)
        note = f"graph traced with {names}; other values run at run time"
        plan.rows.append(PlanRow(path, type(module).__name__, "-", note=note))
        reason = "called with a specialized argument"
        fallback = _runtime_part(pristine, recipe, path, scopes, output_dtype, _Plan(), reason)
        gm.specialize(captured.specialized, inspect.signature(module.forward), fallback)
    return gm


def _convert_leaf(
    node: fx.Node,
    parent: nn.Module,
    recipe: Recipe,
    parent_path: str,
    scopes: Scopes,
    untraceable: dict[str, str],
    plan: _Plan,
) -> Precision:
    """Decide and convert one ``call_module`` leaf of ``parent``'s graph (its plan rows go
    to ``plan``)."""
    name = str(node.target)
    path = _join(parent_path, name)
    sub = parent.get_submodule(name)
    op = _module_op(sub)
    node.meta["mixprec_op"] = op
    precision = recipe.decide(op, scopes)
    if precision is Precision.LOW:
        _low_unit(sub, recipe, path, plan)
        node.meta["mixprec_out"] = Info("unknown", recipe.dtype, exact=False)
    elif precision is Precision.FOLLOW and op is None:
        _runtime_part(sub, recipe, path, scopes, None, plan, untraceable.get(name, ""))
    return precision


def _low_unit(module: nn.Module, recipe: Recipe, path: str, plan: _Plan) -> nn.Module:
    """An untraceable module that computes in low precision as a whole."""
    unit = make_low_unit(module, recipe, prefix=path)
    rows = unit.__dict__[CONVERSION_ATTR].plan.rows
    weights = tuple(cast for row in rows if row.note == "weights" for cast in row.casts_before)
    plan.rows.append(
        PlanRow(path, type(module).__name__, dtype_name(recipe.dtype), weights, note="unit")
    )
    return unit


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
        op = _module_op(child)
        if op is not None and recipe.decide(op, child_scopes) is Precision.FOLLOW:
            continue  # a one-op built-in the lists leave alone
        converted = _convert(child, recipe, child_path, child_scopes, None, plan)
        stand_aside(converted)
        module._modules[name] = converted
    module.__dict__["forward"] = RuntimeForward(module, recipe, scopes, output_dtype)
    return module
