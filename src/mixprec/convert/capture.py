"""Capture a model's graph with ``torch.fx``, tracing through every module it can.

:class:`CaptureTracer` traces into every submodule. When a submodule's ``forward`` cannot
be traced (data-dependent control flow, unsupported Python), the nodes it had emitted are
rolled back and the call is recorded as a single ``call_module`` leaf instead; the reason
is kept for the cast plan. Tracing failures are never the user's problem: at worst the
whole model becomes a leaf and is handled at run time.

Transformer fast paths (``torch.backends.mha``) are switched off while tracing: they are
inference-only shortcuts guarded by checks on tensor values, and the traced graph takes
the equivalent general path.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.fx._symbolic_trace import _assert_is_none
from torch.fx.proxy import TraceError

from mixprec.policy import ops

__all__ = ["CaptureTracer", "Captured", "capture"]


class CaptureTracer(fx.Tracer):
    """An fx tracer that treats only untraceable (or forced) modules as leaves.

    Args:
        autowrap_functions: user functions to keep as single calls in the graph.
        leaf: ``(module, qualified_name) -> bool``: modules to keep as leaves without
            trying to trace them.
    """

    def __init__(
        self,
        autowrap_functions: tuple[Callable[..., Any], ...] = (),
        leaf: Callable[[nn.Module, str], bool] | None = None,
    ) -> None:
        super().__init__(autowrap_functions=(ops.cast, ops.widest_dtype, *autowrap_functions))
        # buffers become graph values: in-place updates of running statistics, counters and
        # EMAs are recorded as ops instead of running on the real buffers while tracing
        self.proxy_buffer_attributes = True
        self.leaf = leaf
        self.untraceable: dict[str, str] = {}
        self._proxy_cache: dict[str, fx.Proxy] | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.untraceable:
            return True
        return self.leaf is not None and self.leaf(m, module_qualified_name)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        self._proxy_cache = parameter_proxy_cache
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def call_module(
        self,
        m: nn.Module,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        name = self.path_of_module(m)
        if self.is_leaf_module(m, name):
            return super().call_module(m, forward, args, kwargs)
        last = _last_node(self.graph)
        stack = self.module_stack.copy()
        calls = dict(self.num_calls)
        state = _attributes(m)
        try:
            result = super().call_module(m, forward, args, kwargs)
            _check_no_assignment(m, state)
            return result
        except Exception as error:  # any failure to trace makes this module a leaf
            self._roll_back(last)
            self.module_stack.clear()
            self.module_stack.update(stack)
            self.num_calls.clear()
            self.num_calls.update(calls)
            self.untraceable[name] = (
                f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            )
            return super().call_module(m, forward, args, kwargs)

    def _roll_back(self, last: fx.Node | None) -> None:
        doomed: list[fx.Node] = []
        for node in reversed(self.graph.nodes):
            if node is last:
                break
            doomed.append(node)
        erased = set(doomed)
        for node in doomed:
            self.graph.erase_node(node)
        if self._proxy_cache is not None:
            for key in [k for k, proxy in self._proxy_cache.items() if proxy.node in erased]:
                del self._proxy_cache[key]


_State = tuple[dict[str, Any], dict[str, Any], dict[str, Any]]


def _attributes(module: nn.Module) -> _State:
    return dict(module._parameters), dict(module._buffers), dict(module.__dict__)


def _check_no_assignment(module: nn.Module, state: _State) -> None:
    """A forward that assigns to its own attributes (``self.count += 1``) cannot be a
    graph: put the attributes back and refuse."""
    parameters, buffers, attributes = state
    changed = [
        name
        for now, before in ((module._parameters, parameters), (module._buffers, buffers))
        for name in now
        if now[name] is not before.get(name)
    ]
    changed += [
        k
        for k, v in module.__dict__.items()
        if isinstance(v, fx.Proxy) and attributes.get(k) is not v
    ]
    if changed:
        module._parameters.clear()
        module._parameters.update(parameters)
        module._buffers.clear()
        module._buffers.update(buffers)
        for key in [k for k in module.__dict__ if k not in attributes]:
            del module.__dict__[key]
        module.__dict__.update(
            {k: v for k, v in attributes.items() if k not in ("_parameters", "_buffers")}
        )
        raise TraceError(f"forward assigns to self.{changed[0]}, which a graph cannot record")


def _last_node(graph: fx.Graph) -> fx.Node | None:
    for node in reversed(graph.nodes):
        return node
    return None


def _refuse_grad_mode(mode: bool) -> None:
    raise TraceError(
        "forward changes the grad mode (torch.no_grad / enable_grad), which a graph cannot record"
    )


@contextlib.contextmanager
def _grad_mode_untraceable() -> Iterator[None]:
    """While tracing, a ``with torch.no_grad():`` inside a forward makes that module
    untraceable (it then runs its own code), instead of silently vanishing from the graph."""
    original = torch._C._set_grad_enabled
    torch._C._set_grad_enabled = _refuse_grad_mode  # type: ignore[assignment]
    try:
        yield
    finally:
        torch._C._set_grad_enabled = original


@contextlib.contextmanager
def _no_transformer_fastpath() -> Iterator[None]:
    mha = getattr(torch.backends, "mha", None)
    if mha is None or not hasattr(mha, "set_fastpath_enabled"):
        yield
        return
    before = mha.get_fastpath_enabled()
    mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        mha.set_fastpath_enabled(before)


@dataclass(frozen=True)
class Captured:
    """A traced graph.

    Attributes:
        graph: the graph.
        untraceable: ``{qualified_name: reason}`` for submodules kept as leaves because
            their forward could not be traced.
        specialized: arguments of ``forward`` whose default is None, which the graph was
            traced with as None; a call that passes one of them takes the run-time path.
    """

    graph: fx.Graph
    untraceable: dict[str, str]
    specialized: tuple[str, ...] = ()


def _none_defaults(root: nn.Module) -> dict[str, None]:
    parameters = inspect.signature(root.forward).parameters.values()
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
        return {}
    return {p.name: None for p in parameters if p.default is None}


def _unguard(graph: fx.Graph, root: nn.Module) -> None:
    """Drop fx's ``_assert_is_none`` guards and give placeholders their argument names
    back (the caller dispatches on the specialized arguments itself)."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is _assert_is_none:
            graph.erase_node(node)
    names = list(inspect.signature(root.forward).parameters)
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    for node, name in zip(placeholders, names, strict=False):
        node.target = name


def capture(
    root: nn.Module,
    autowrap_functions: tuple[Callable[..., Any], ...] = (),
    leaf: Callable[[nn.Module, str], bool] | None = None,
) -> Captured:
    """Trace ``root`` (see :class:`Captured`).

    Arguments that default to None are traced as None: a symbolic value would take every
    ``if mask is not None:`` branch (or fail on it), so the graph is the one for calls that
    leave them out, and calls that pass them run on the run-time path instead.

    Raises:
        Exception: whatever tracing ``root``'s own forward raised (the caller then handles
            the whole module at run time).
    """
    tracer = CaptureTracer(autowrap_functions, leaf)
    concrete = _none_defaults(root)
    with _no_transformer_fastpath(), _grad_mode_untraceable():
        state = _attributes(root)
        graph = tracer.trace(root, concrete_args=concrete or None)
        _check_no_assignment(root, state)
    if concrete:
        _unguard(graph, root)
    return Captured(_drop_string_annotations(graph), tracer.untraceable, tuple(concrete))


def _drop_string_annotations(graph: fx.Graph) -> fx.Graph:
    """Forget annotations that are strings (``from __future__ import annotations``): fx
    would put them in the generated code's globals, which then cannot be pickled."""
    for node in graph.nodes:
        if isinstance(node.type, str):
            node.type = None
    return graph
