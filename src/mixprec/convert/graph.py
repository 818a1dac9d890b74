"""Graph conversion (O1 and the autocast level), module by module.

:func:`convert_graph` converts a *structural copy* of the model (same classes, same
Parameter objects, the user's hooks and methods) and gives every module a ``forward``
of its own, set on the instance, chosen in this order:

* a module with a built-in fast path decided on run-time values (``nn.TransformerEncoder``
  and its layer) runs its own code as written (:class:`~.runtime.PlainForward`): PyTorch
  picks the fast path exactly when it would for the original;
* a module whose own forward can be captured gets a :class:`GraphForward`: an fx graph
  of that forward alone, children kept as calls of the real children (so their hooks
  fire and their own converted forwards run), with the casts the lists ask for;
* otherwise its own ops follow the lists at run time (:class:`~.runtime.RuntimeForward`).

A module the level runs whole in low precision (a white-list module under O1, a
recurrent layer under the autocast level) is a *unit*: every op inside computes low and
its result stays low; the caller's graph casts it back where the level says so, which
lets redundant-cast removal join consecutive low units without a float32 round trip.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from mixprec.convert.capture import call_key, capture, state_key, state_keys
from mixprec.convert.infer import Info
from mixprec.convert.insert import INPLACE_TAG, insert_casts
from mixprec.convert.module_level import ExtraRepr
from mixprec.convert.plan import CastPlan, Conversion, PlanRow, RowKind
from mixprec.convert.rows import RowSource, reason_in_words
from mixprec.convert.runtime import (
    ForwardBase,
    PlainForward,
    RuntimeForward,
    any_nested,
    standing_aside,
)
from mixprec.convert.simplify import simplify
from mixprec.convert.structure import CONVERSION_ATTR, qualified_name, structural_copy
from mixprec.policy import lists, ops
from mixprec.policy.dtypes import dtype_name, is_castable
from mixprec.policy.levels import Level, Precision, Recipe

__all__ = ["FAST_PATH_MODULES", "GraphForward", "convert_graph"]

Scopes = tuple[tuple[str, nn.Module], ...]

#: Built-in modules whose forward picks a fused fast path from run-time values (eval
#: mode, no grad, a padding mask): they run their own code so the choice is PyTorch's.
FAST_PATH_MODULES: tuple[type[nn.Module], ...] = (nn.TransformerEncoder,)


def module_op(module: nn.Module) -> str | None:
    """The op a one-op built-in module is decided by (BatchNorm: ``batch_norm``)."""
    for cls, name in lists.MODULE_OPS:
        if type(module) is cls:
            return name
    return None


@dataclass(frozen=True)
class Spec:
    """How one module is converted (everything a re-specialisation needs)."""

    recipe: Recipe
    path: str
    scopes: Scopes
    output_dtype: torch.dtype | None
    unit: bool  # runs whole in low precision; its results stay low

    def decide(self, op: Any, scopes: Scopes) -> Precision:
        return Precision.LOW if self.unit else self.recipe.decide(op, scopes)

    def child_precision(self, child: nn.Module, path: str) -> Precision:
        """What the caller's graph does around a call of ``child``."""
        if self.unit:
            return Precision.FOLLOW  # the child is a unit too and casts its own inputs
        forward = child.__dict__.get("forward")
        if isinstance(forward, GraphForward) and forward.spec.unit:
            return Precision.LOW
        return self.recipe.decide(module_op(child), (*self.scopes, (path, child)))


@dataclass
class Entry:
    """One compiled specialisation."""

    graph: fx.Graph
    source: str
    scope: dict[str, Any]
    removed: int = 0
    function: Any = None

    def compiled(self) -> Any:
        if self.function is None:
            if not self.scope:  # unpickled: the generated code's globals are rebuilt
                self.scope = dict(self.graph.python_code("self").globals)
            namespace = dict(self.scope)
            exec(compile(self.source, "<mixprec graph>", "exec"), namespace)
            self.function = namespace["forward"]
        return self.function


class GraphForward(ForwardBase):
    """The ``forward`` of a module captured as graphs: one per specialisation.

    A graph is reused while the module's mode (``training``), its public plain-Python
    attributes, and the kind of each argument (tensor, or the same constant) are those it
    was traced with; any other call traces a new specialisation first (a guard, as
    ``torch.compile`` has), or, while being compiled, runs at run time under the lists.
    """

    def __init__(
        self,
        module: nn.Module,
        spec: Spec,
        entry: Entry | None,
        key: Any,
        reason: str = "",
        tables: dict[Any, Any] | None = None,
    ) -> None:
        self.module = module
        self.spec = spec
        self.names = state_keys(module)
        self.signature = _signature(module)
        self.last_key = key  # the specialisation the plan shows: the latest one called
        self.entries: dict[Any, Entry | None] = {} if entry is None else {key: entry}
        self.reasons: dict[Any, str] = {} if entry is not None else {key: reason}
        self._lock = threading.Lock()
        # made now, not on the first call that needs it (which may run under torch.compile)
        force = Precision.LOW if spec.unit else None
        self._fallback = RuntimeForward(
            module, spec.recipe, spec.scopes, spec.output_dtype, force, tables=tables
        )

    @property
    def current(self) -> Entry | None:
        """The specialisation used by the latest call (at first: the one made when
        converting, with every optional argument left at its default)."""
        return self.entries.get(self.last_key)

    @property
    def reason(self) -> str:
        """Why the latest call ran at run time (empty when it ran a graph)."""
        if self.current is not None:
            return ""
        return self.reasons.get(self.last_key, "its forward could not be captured for this call")

    @property
    def graph(self) -> fx.Graph:
        """The graph of :attr:`current`."""
        if self.current is None:
            raise AttributeError(f"no graph for the latest call: {self.reason}")
        return self.current.graph

    @property
    def code(self) -> str:
        """The generated code of :attr:`current`: every cast shows."""
        if self.current is None:
            raise AttributeError(f"no graph for the latest call: {self.reason}")
        return self.current.source

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["entries"] = {
            k: None if e is None else Entry(e.graph, e.source, {}, e.removed)
            for k, e in self.entries.items()
        }
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        for entry in self.entries.values():
            if entry is not None:
                entry.compiled()

    def __deepcopy__(self, memo: dict[int, Any]) -> GraphForward:
        import copy

        new = GraphForward.__new__(GraphForward)
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return new

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if any_nested(args, kwargs):  # only a built-in fast path makes these: run as written
            with standing_aside():
                return type(self.module).forward(self.module, *args, **kwargs)
        key = (state_key(self.module, self.names), call_key(self.signature, args, kwargs))
        entry = self.entries[key] if key in self.entries else self._specialise(key, args, kwargs)
        if self.last_key != key:
            self.last_key = key
        with standing_aside():
            if entry is None:
                return self._runtime()(*args, **kwargs)
            return entry.compiled()(self.module, *args, **kwargs)

    def _runtime(self) -> RuntimeForward:
        return self._fallback

    def _specialise(self, key: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Entry | None:
        if torch.compiler.is_compiling() or key[1] is None:
            return None
        with self._lock:
            if key not in self.entries:
                try:
                    self.entries[key] = build_entry(self.module, self.spec, args, kwargs)
                except Exception as error:
                    self.entries[key] = None
                    self.reasons[key] = reason_in_words(error)
            return self.entries[key]


def build_entry(
    module: nn.Module, spec: Spec, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Entry:
    """Capture, decide, insert casts, simplify and generate code for one call shape."""
    captured = capture(module, args, kwargs, spec.recipe.leaf_functions)
    for name, value in captured.constants.items():
        module.__dict__[name] = value
    graph = captured.graph
    decisions = decide_nodes(graph, module, spec)
    insert_casts(
        graph,
        spec.recipe,
        lambda node: decisions.get(node, Precision.FOLLOW),
        infos_for(graph, module, spec),
        spec.output_dtype,
        cast_back=spec.recipe.level is Level.O1 and not spec.unit,
    )
    removed = simplify(graph, module, child_info(module, spec))
    code = graph.python_code("self")
    entry = Entry(graph, code.src, dict(code.globals), removed)
    entry.compiled()  # now, not on a first call that may run under torch.compile
    return entry


def decide_nodes(graph: fx.Graph, module: nn.Module, spec: Spec) -> dict[fx.Node, Precision]:
    decisions: dict[fx.Node, Precision] = {}
    for node in graph.nodes:
        if node.op in ("call_function", "call_method"):
            decisions[node] = spec.decide(ops.op_key(node.target), spec.scopes)
        elif node.op == "call_module":
            child = module.get_submodule(str(node.target))
            decisions[node] = spec.child_precision(
                child, qualified_name(spec.path, str(node.target))
            )
            node.meta["mixprec_op"] = module_op(child)
            node.meta[INPLACE_TAG] = getattr(child, "inplace", False) is True
    return decisions


def child_info(module: nn.Module, spec: Spec) -> Any:
    """``(call_module node, input infos) -> Info`` of what a child returns (assumed)."""
    from mixprec.convert.rows import child_output_info

    return lambda node, inputs: child_output_info(module, node, inputs, spec.recipe.dtype)


def infos_for(graph: fx.Graph, module: nn.Module, spec: Spec) -> dict[fx.Node, Info]:
    from mixprec.convert.infer import infer

    return infer(graph, module, child=child_info(module, spec))


# ---------------------------------------------------------------------------- conversion


@dataclass
class _Converter:
    recipe: Recipe
    seen: set[int] = field(default_factory=set)
    tables: dict[Any, Any] = field(default_factory=dict)

    def convert(
        self, module: nn.Module, path: str, scopes: Scopes, output: Any, unit: bool
    ) -> None:
        if id(module) in self.seen:
            return
        self.seen.add(id(module))
        recipe = self.recipe
        unit = unit or (
            recipe.decide(module_op(module), scopes) is Precision.LOW
            and (module_op(module) is None or recipe.level is Level.O1)
        )
        for name, child in module._modules.items():
            if child is not None:
                child_path = qualified_name(path, name)
                self.convert(child, child_path, (*scopes, (child_path, child)), None, unit)
        spec = Spec(recipe, path, scopes, output, unit)
        if isinstance(module, FAST_PATH_MODULES) and not unit:
            reason = "has a built-in fast path chosen from run-time values; runs its own code"
            module.__dict__["forward"] = PlainForward(module, output, reason)
            return
        if type(module).forward is nn.Module.forward:
            return  # a container (ModuleList, ModuleDict): nothing of its own to run
        args, kwargs = _example_args(module)
        key = (state_key(module, state_keys(module)), call_key(_signature(module), args, kwargs))
        try:
            entry = build_entry(module, spec, args, kwargs)
            if not unit and _one_low_op(entry.graph):  # ReLU: a unit of one listed op
                spec = Spec(recipe, path, scopes, output, True)
                entry = build_entry(module, spec, args, kwargs)
            module.__dict__["forward"] = GraphForward(module, spec, entry, key, tables=self.tables)
        except Exception as error:
            reason = reason_in_words(error)
            if unit or module_op(module) is not None:  # a whole-low unit, or one op
                force = Precision.LOW if unit else None
                forward = RuntimeForward(
                    module, recipe, scopes, output, force, reason, tables=self.tables
                )
                module.__dict__["forward"] = forward
            else:  # tried again with the arguments of each new kind of call
                module.__dict__["forward"] = GraphForward(
                    module, spec, None, key, reason, tables=self.tables
                )


def _one_low_op(graph: fx.Graph) -> bool:
    from mixprec.convert.insert import PRECISION_TAG, is_helper

    calls = [
        n
        for n in graph.nodes
        if n.op in ("call_function", "call_method", "call_module") and not is_helper(n)
    ]
    return len(calls) == 1 and calls[0].meta.get(PRECISION_TAG) is Precision.LOW


def _signature(module: nn.Module) -> inspect.Signature:
    full = inspect.signature(type(module).forward)
    return full.replace(parameters=list(full.parameters.values())[1:])


def _example_args(module: nn.Module) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call made at conversion: a tensor for each required argument, every other
    argument left at its default."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for param in _signature(module).parameters.values():
        if param.default is not param.empty or param.kind in (
            param.VAR_POSITIONAL,
            param.VAR_KEYWORD,
        ):
            continue
        if param.kind is param.KEYWORD_ONLY:
            kwargs[param.name] = torch.empty(0)
        else:
            args.append(torch.empty(0))
    return tuple(args), kwargs


def convert_graph(network: nn.Module, recipe: Recipe, *, copy: bool = True) -> nn.Module:
    """Convert ``network`` for O1 or the autocast level (see module docstring).

    Returns the structural copy (the original's class, Parameters and hooks) whose
    modules carry converted forwards; :func:`mixprec.explain` reads its plan.
    """
    root = structural_copy(network) if copy else network
    output = torch.float32 if recipe.casts_outputs_to_fp32 else None
    converter = _Converter(recipe)
    converter.convert(root, "", (("", root),), output, False)
    plan_of = PlanOf(root, recipe)
    root.__dict__[CONVERSION_ATTR] = Conversion(recipe, plan_of(), refresh=plan_of)
    root.__dict__["extra_repr"] = ExtraRepr(root, f"mixprec: {recipe.describe()}")
    return root


class PlanOf:
    """Reads the plan of a converted model from the specialisations its modules used
    last (at first: those made when converting)."""

    def __init__(self, root: nn.Module, recipe: Recipe) -> None:
        self.root = root
        self.recipe = recipe

    def __call__(self) -> CastPlan:
        source = RowSource(self.recipe)
        rows, removed = source.module_rows(self.root, "", None)
        return CastPlan(
            level=self.recipe.level.value,
            dtype=dtype_name(self.recipe.dtype),
            rows=tuple(rows),
            casts_removed=removed,
            runtime_parts=tuple(path for path, _ in source.runtime),
            runtime_reasons=tuple(reason for _, reason in source.runtime),
        )


def unit_weight_rows(module: nn.Module, path: str, recipe: Recipe, inputs: bool) -> PlanRow:
    """The row of a unit run at run time: every floating weight cast once per call (and
    its floating inputs, when its caller does not cast them)."""
    seen: set[int] = set()
    casts = [("floating inputs", recipe.dtype)] if inputs else []
    for name, tensor in module.named_parameters():
        if is_castable(tensor) and tensor.dtype != recipe.dtype and id(tensor) not in seen:
            seen.add(id(tensor))
            casts.append((qualified_name(path, name), recipe.dtype))
    return PlanRow.make(path, type(module).__name__, recipe.dtype, casts, kind=RowKind.UNIT)
