"""Capture one module's *own* ``forward`` as a ``torch.fx`` graph, children kept as calls.

The graph is traced on a *shell*: an object of the module's class (a subclass that
records calls) whose Parameters and buffers are graph values and whose children are
shells of their own. Calling a child shell records a ``call_module`` node, so in the
generated code ``self.fc(x)`` calls the real child through ``nn.Module.__call__``: its
hooks fire, its mode and its own converted ``forward`` are used. Nothing global is
replaced while tracing (``torch.fx.symbolic_trace`` swaps ``nn.Module.__call__`` and
``__getattr__`` for the whole process; this tracer does not), and the real module is
never touched: the shell has its own ``__dict__``.

A graph is a *specialisation*: arguments that are not tensors (None, flags, ints,
strings) are traced as the constants they are, and ``*args``/``**kwargs`` with the count
and names seen. :func:`call_key` gives the key a call must match to reuse it.

A forward cannot be a graph (the caller then runs it at run time) when tracing raises
(data-dependent control flow, unsupported Python), when it assigns to the module's own
attributes, or when an op is recorded with gradients off: a ``torch.no_grad()`` block,
or the inside of a custom ``torch.autograd.Function`` (whose own backward a graph would
drop).
"""

from __future__ import annotations

import enum
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.fx.proxy import TraceError

from mixprec.convert.structure import qualified_name

__all__ = ["Captured", "call_key", "capture", "forward_function", "state_key", "state_keys"]

#: Python values a graph may hold as constants (and a key may compare).
_SCALARS = (bool, int, float, str, type(None), torch.dtype, torch.device, enum.Enum)


def forward_function(module: nn.Module) -> Callable[..., Any]:
    """The plain function that is ``module``'s own forward (class attribute)."""
    return type(module).forward


def state_keys(module: nn.Module) -> tuple[str, ...]:
    """Names of the module's public plain-Python attributes (flags, sizes, modes): a
    graph traced with their values is only reused while they are unchanged."""
    return tuple(
        k for k, v in module.__dict__.items() if not k.startswith("_") and isinstance(v, _SCALARS)
    )


def state_key(module: nn.Module, names: tuple[str, ...]) -> tuple[Any, ...]:
    values = module.__dict__
    return (module.training, *[values.get(k) for k in names])


def _arg_kind(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return "T"
    if isinstance(value, _SCALARS):
        return ("C", type(value), value)
    return ("X", type(value))


def call_key(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, ...] | None:
    """The key of a call (tensors, constants by value, ``*args`` count, ``**kwargs``
    names), or None when the arguments do not fit ``signature``."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    key: list[Any] = []
    for name, param in signature.parameters.items():
        if name not in bound.arguments:
            default = param.default
            key.append(
                ("D",)
                if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
                else _arg_kind(default)
            )
            continue
        value = bound.arguments[name]
        if param.kind is param.VAR_POSITIONAL:
            key.append(("*", tuple(_arg_kind(v) for v in value)))
        elif param.kind is param.VAR_KEYWORD:
            key.append(("**", tuple(sorted((k, _arg_kind(v)) for k, v in value.items()))))
        else:
            key.append(_arg_kind(value))
    return tuple(key)


@dataclass(frozen=True)
class Captured:
    """A traced specialisation of one module's own forward.

    Attributes:
        graph: the graph; ``call_module`` nodes are calls of the real children.
        constants: tensors the forward made from Python values, by attribute name.
    """

    graph: fx.Graph
    constants: dict[str, torch.Tensor]


class _Tracer(fx.Tracer):
    def __init__(self, holder: nn.Module) -> None:
        super().__init__()
        self.graph = fx.Graph()
        self.root = holder
        self.tensor_attrs: dict[Any, str] = {}
        self.shells: dict[int, Any] = {}
        self.classes: dict[type, type] = {}

    def create_proxy(
        self, kind: str, target: Any, args: Any, kwargs: Any, *a: Any, **k: Any
    ) -> Any:
        if kind in ("call_function", "call_method") and not torch.is_grad_enabled():
            raise TraceError(
                "it computes with gradients off (a torch.no_grad() block or a custom "
                "autograd Function), which a graph cannot record"
            )
        return super().create_proxy(kind, target, args, kwargs, *a, **k)

    def create_arg(self, a: Any) -> Any:
        if (
            type(a) not in (dict, list, tuple)
            and isinstance(a, (dict, list, tuple))
            and not (isinstance(a, tuple) and hasattr(a, "_fields"))
        ):  # a ModelOutput or other container type: rebuilt as itself
            leaves, spec = pytree.tree_flatten(a)
            if not spec.is_leaf():
                return self.create_node(
                    "call_function", Rebuild(spec), tuple(self.create_arg(x) for x in leaves), {}
                )
        if isinstance(a, torch.Tensor) and not isinstance(a, fx.Proxy):
            name = self.tensor_attrs.get(a)
            if name is None:
                name = f"_mixprec_constant_{len(self.tensor_attrs)}"
                self.tensor_attrs[a] = name
                self.root.__dict__[name] = a
            return self.create_node("get_attr", name, (), {})
        return super().create_arg(a)

    def shell(self, module: nn.Module, path: str, *, calls_record: bool) -> Any:
        """A stand-in for ``module`` whose Parameters, buffers and children are graph
        values (see the module docstring)."""
        found = self.shells.get(id(module))
        if found is not None:
            return found
        cls = type(module)
        if calls_record:
            cls = self.classes.get(type(module)) or self._recording_class(type(module))
        shell = cls.__new__(cls)
        state = dict(module.__dict__)
        state["_parameters"] = {
            n: None if p is None else self._attr(qualified_name(path, n))
            for n, p in module._parameters.items()
        }
        state["_buffers"] = {
            n: None if b is None else self._attr(qualified_name(path, n))
            for n, b in module._buffers.items()
        }
        state["_modules"] = {
            n: None if c is None else self.shell(c, qualified_name(path, n), calls_record=True)
            for n, c in module._modules.items()
        }
        state.pop("forward", None)
        state["_mixprec_path"] = path
        shell.__dict__.update(state)
        self.shells[id(module)] = shell
        return shell

    def _attr(self, path: str) -> fx.Proxy:
        return fx.Proxy(self.create_node("get_attr", path, (), {}), self)

    def _recording_class(self, cls: type) -> type:
        tracer = self

        def __call__(shell: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
            return tracer.create_proxy("call_module", shell.__dict__["_mixprec_path"], args, kwargs)

        recording = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
        self.classes[cls] = recording
        return recording


class Rebuild:
    """A graph call that rebuilds a container of the model's own type (a transformers
    ``ModelOutput``) from its leaves, so a graph returns what the forward returned."""

    __module__ = __name__

    def __init__(self, spec: pytree.TreeSpec) -> None:
        self.spec = spec
        self.__name__ = f"rebuild_{type(self).__name__.lower()}"

    def __call__(self, *leaves: Any) -> Any:
        return pytree.tree_unflatten(list(leaves), self.spec)


def _placeholders(
    tracer: _Tracer, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    """One placeholder per parameter (so the generated code has the original signature);
    the values the traced function gets: proxies for tensors, the constants themselves."""
    bound = signature.bind(*args, **kwargs)
    call_args: list[Any] = []
    call_kwargs: dict[str, Any] = {}
    for name, param in signature.parameters.items():
        if param.kind is param.VAR_POSITIONAL:
            node = tracer.create_proxy("placeholder", f"*{name}", (), {})
            values = bound.arguments.get(name, ())
            call_args.extend(
                node[i] if isinstance(v, torch.Tensor) else v for i, v in enumerate(values)
            )
            continue
        if param.kind is param.VAR_KEYWORD:
            node = tracer.create_proxy("placeholder", f"**{name}", (), {})
            for key, v in bound.arguments.get(name, {}).items():
                call_kwargs[key] = node[key] if isinstance(v, torch.Tensor) else v
            continue
        default = () if param.default is inspect.Parameter.empty else (param.default,)
        node = tracer.create_proxy("placeholder", name, default, {})
        value = bound.arguments.get(name, param.default)
        passed = node if isinstance(value, torch.Tensor) else value
        if param.kind is param.POSITIONAL_ONLY:
            call_args.append(passed)
        else:  # by name: decorated forwards (``*args, **kwargs`` wrappers) bind it right
            call_kwargs[name] = passed
    return call_args, call_kwargs


def capture(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    leaf_functions: tuple[Callable[..., Any], ...] = (),
) -> Captured:
    """Trace ``module``'s own forward for a call like ``module(*args, **kwargs)``, whose
    tensors only lend their places (see the module docstring).

    Raises:
        Exception: whatever made the forward untraceable (the caller runs it at run time).
    """
    function = forward_function(module)
    if leaf_functions:
        function = _with_leaves(function, leaf_functions)
    holder = nn.Module()
    tracer = _Tracer(holder)
    shell = tracer.shell(module, "", calls_record=False)
    before = dict(shell.__dict__)
    signature = inspect.signature(function)
    params = list(signature.parameters.values())[1:]
    call_args, call_kwargs = _placeholders(
        tracer, signature.replace(parameters=params), args, kwargs
    )
    with torch.enable_grad():
        result = function(shell, *call_args, **call_kwargs)
    changed = [k for k, v in shell.__dict__.items() if k not in before or before[k] is not v]
    for table in ("_parameters", "_buffers", "_modules"):
        if shell.__dict__[table] != before[table]:
            changed.append(table)
    if changed:
        raise TraceError(f"forward assigns to self.{changed[0]}, which a graph cannot record")
    tracer.create_node("output", "output", (tracer.create_arg(result),), {})
    graph = tracer.graph
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    constants = {name: holder.__dict__[name] for name in tracer.tensor_attrs.values()}
    for node in graph.nodes:
        if isinstance(node.type, str):
            node.type = None
        if node.name == "self":  # a child called "self" must not shadow the module
            node.name = graph._graph_namespace.create_name("self_", None)
    return Captured(graph, constants)


def _with_leaves(function: Callable[..., Any], leaves: tuple[Callable[..., Any], ...]) -> Any:
    """A copy of ``function`` whose globals see each leaf function as one graph call (the
    function's own module globals are not touched)."""
    code = getattr(function, "__code__", None)
    scope = getattr(function, "__globals__", None)
    if not isinstance(code, types.CodeType) or scope is None:
        return function
    names = {name: value for name, value in scope.items() if any(value is f for f in leaves)}
    if not names:
        return function
    patched = dict(scope)
    for name, leaf in names.items():
        patched[name] = _leaf_call(leaf)
    copy = types.FunctionType(
        code, patched, function.__name__, function.__defaults__, function.__closure__
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


def _leaf_call(leaf: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        proxies = [a for a in (*args, *kwargs.values()) if isinstance(a, fx.Proxy)]
        if proxies:
            return proxies[0].tracer.create_proxy("call_function", leaf, args, kwargs)
        return leaf(*args, **kwargs)

    return call
