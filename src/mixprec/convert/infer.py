"""Static dtype inference over a traced graph, without running it.

For every node, :func:`infer` says what kind of value it produces (a tensor, something
else, or unknown) and its floating dtype in two senses:

* ``dtype``: the dtype it has when every floating model input is a float32 tensor (the
  assumption the cast plan's counts are made under);
* ``exact``: whether that dtype holds *whatever* the inputs are, in the sense "if this
  value is a castable floating tensor, it has ``dtype``". Only exact facts may remove a
  cast; the assumption only feeds the plan.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from mixprec.policy import ops

__all__ = ["Info", "infer"]


@dataclass(frozen=True)
class Info:
    """What a node produces. ``kind`` is "tensor", "other" (not a tensor) or "unknown"."""

    kind: str
    dtype: torch.dtype | None = None
    exact: bool = False

    @property
    def castable(self) -> bool:
        """Assumed to be a floating tensor mixprec would cast."""
        return self.kind != "other" and self.dtype is not None and self.dtype != torch.float64


OTHER = Info("other")
UNKNOWN = Info("unknown")

_DTYPE_METHODS = {
    "float": torch.float32,
    "double": torch.float64,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "int": torch.int32,
    "long": torch.int64,
    "short": torch.int16,
    "bool": torch.bool,
    "byte": torch.uint8,
    "char": torch.int8,
}
_NON_TENSOR = frozenset(
    ("size", "dim", "numel", "item", "tolist", "ndimension", "nelement", "stride", "getattr")
)
_BOOL_OUT = frozenset(
    (
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "logical_and",
        "logical_or",
        "logical_not",
        "logical_xor",
        "isnan",
        "isinf",
        "isfinite",
        "isclose",
        "not_",
        "invert",
        "and_",
        "or_",
        "xor",
        "eq_",
    )
)
# ops whose result has the dtype of their first (data) input even when their other inputs
# (weights, running statistics) are float32: the mixed-dtype normalisation kernels
_FIRST_INPUT = frozenset(
    ("layer_norm", "group_norm", "batch_norm", "instance_norm", "rms_norm", "local_response_norm")
)
_TENSOR_ATTRIBUTES = frozenset(("T", "mT", "H", "mH", "data", "real", "imag"))
_INT_OUT = frozenset(("argmax", "argmin", "argsort", "nonzero", "bucketize", "searchsorted"))
_FACTORIES = frozenset(
    (
        "zeros",
        "ones",
        "empty",
        "full",
        "rand",
        "randn",
        "arange",
        "linspace",
        "logspace",
        "eye",
        "tensor",
        "as_tensor",
    )
)


def _tensor_info(value: Any) -> Info:
    if isinstance(value, torch.Tensor):
        return Info("tensor", value.dtype, exact=True)
    if isinstance(value, nn.Module):
        return OTHER
    return OTHER


def _arg_infos(node: fx.Node, infos: dict[fx.Node, Info]) -> list[Info]:
    found: list[Info] = []

    def visit(arg: Any) -> Any:
        found.append(infos.get(arg, UNKNOWN))
        return arg

    fx.node.map_arg((node.args, node.kwargs), visit)
    return found


def _promote(inputs: list[Info]) -> Info:
    tensors = [i for i in inputs if i.kind != "other"]
    if not tensors:
        return Info("tensor", torch.get_default_dtype(), exact=False)
    if any(i.dtype is None for i in tensors):
        return Info("unknown", None, exact=False)
    floating = [i for i in tensors if i.dtype is not None and i.dtype.is_floating_point]
    kind = "tensor" if all(i.kind == "tensor" for i in tensors) else "unknown"
    if not floating:
        return Info(kind, tensors[0].dtype, exact=all(i.exact for i in tensors))
    dtype = ops.widest_of([i.dtype for i in floating if i.dtype is not None])
    return Info(kind, dtype, exact=all(i.exact for i in floating))


def _cast_info(value: Info, dtype: torch.dtype) -> Info:
    if value.kind == "other":
        return value
    if value.dtype is not None and not value.castable and value.exact:
        return value  # an int/bool/float64 tensor passes through
    return Info(value.kind, dtype, exact=True)


#: What a child module returns, given its call node and the infos found so far.
ChildInfo = Callable[[fx.Node, dict[fx.Node, Info]], Info]


def infer(
    graph: fx.Graph,
    root: nn.Module,
    *,
    inputs: dict[str, Info] | None = None,
    child: ChildInfo | None = None,
) -> dict[fx.Node, Info]:
    """Infer an :class:`Info` for every node of ``graph`` (whose attributes live on ``root``).

    Args:
        inputs: infos of placeholders by name (default: an assumed float32 tensor).
        child: what a ``call_module`` node returns (default: unknown). Never exact: a
            child's result is an assumption about another graph.
    """
    infos: dict[fx.Node, Info] = {}
    for node in graph.nodes:
        if node.op == "placeholder" and inputs is not None and str(node.target) in inputs:
            infos[node] = inputs[str(node.target)]
        elif node.op == "call_module" and child is not None and "mixprec_out" not in node.meta:
            found = child(node, infos)
            infos[node] = Info(found.kind, found.dtype, exact=False)
        else:
            infos[node] = _infer_node(node, infos, root)
    return infos


def _infer_node(node: fx.Node, infos: dict[fx.Node, Info], root: nn.Module) -> Info:
    if node.op == "placeholder":
        if str(node.target).startswith("*"):
            return UNKNOWN
        has_default = len(node.args) > 0
        if has_default and not isinstance(node.args[0], torch.Tensor):
            return OTHER if not node.users else UNKNOWN
        return Info("tensor", torch.float32, exact=False)
    if node.op == "get_attr":
        path = str(node.target)
        try:
            value: Any = root.get_parameter(path)
        except AttributeError:
            try:
                value = root.get_buffer(path)
            except AttributeError:
                value = _resolve(root, path)
        return _tensor_info(value)
    if node.op == "output":
        return OTHER
    explicit = node.meta.get("mixprec_out")
    if isinstance(explicit, Info):
        return explicit
    target = node.target
    if target is ops.cast:
        value, dtype = infos.get(node.args[0], UNKNOWN), node.args[1]  # type: ignore[arg-type]
        if isinstance(dtype, fx.Node):  # promote: the widest floating input, found at run time
            candidates = [infos.get(n, UNKNOWN) for n in dtype.all_input_nodes]
            widest = ops.widest_of(
                [c.dtype for c in candidates if c.castable and c.dtype is not None]
            )
            if widest is None:
                return value
            cast = _cast_info(value, widest)
            return Info(
                cast.kind, cast.dtype, exact=cast.exact and all(c.exact for c in candidates)
            )
        return _cast_info(value, dtype)  # type: ignore[arg-type]
    if target is ops.widest_dtype:
        return OTHER
    inputs = _arg_infos(node, infos)
    if node.op == "call_module":
        op = node.meta.get("mixprec_op")
        return inputs[0] if op in _FIRST_INPUT and inputs else UNKNOWN
    name = ops.op_name(target) if isinstance(target, str) or callable(target) else str(target)
    dtype_kw = node.kwargs.get("dtype")
    if isinstance(dtype_kw, torch.dtype):
        return Info("tensor", dtype_kw, exact=True)
    if target is getattr and len(node.args) > 1 and node.args[1] in _TENSOR_ATTRIBUTES:
        return inputs[0] if inputs else UNKNOWN  # x.T, x.mT, x.data: the same tensor's values
    if target is getattr or name in _NON_TENSOR:
        return OTHER
    if target is operator.getitem:
        base = inputs[0] if inputs else UNKNOWN
        if base.kind in ("tensor", "other"):
            return base  # an element of a tensor (or a tuple of them), or of a shape
        return Info("unknown", base.dtype, exact=base.exact) if base.dtype is not None else UNKNOWN
    if name in _DTYPE_METHODS:
        return Info("tensor", _DTYPE_METHODS[name], exact=True)
    if name in ("to", "type"):
        for arg in (*node.args[1:], *node.kwargs.values()):
            if isinstance(arg, torch.dtype):
                return Info("tensor", arg, exact=True)
        return UNKNOWN
    if name == "type_as" and len(node.args) > 1:
        other = infos.get(node.args[1], UNKNOWN)  # type: ignore[arg-type]
        return Info("tensor", other.dtype, exact=other.exact)
    if name in _BOOL_OUT:
        return (
            Info("tensor", torch.bool, exact=True)
            if all(i.kind != "unknown" for i in inputs)
            else UNKNOWN
        )
    if name in _FIRST_INPUT and inputs:
        return inputs[0]
    if name in _INT_OUT:
        return Info("tensor", torch.int64, exact=True)
    if name in _FACTORIES and not any(i.kind != "other" for i in inputs):
        return Info("tensor", torch.get_default_dtype(), exact=False)
    if not any(i.kind != "other" for i in inputs):
        return OTHER if node.op == "call_function" and target in _SCALAR_OPS else UNKNOWN
    return _promote(inputs)


_SCALAR_OPS = frozenset(
    (
        operator.add,
        operator.sub,
        operator.mul,
        operator.truediv,
        operator.floordiv,
        operator.mod,
        operator.neg,
    )
)


def _resolve(root: nn.Module, target: str) -> Any:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part, None)
    return value
