"""The few operations a converted model runs: casts, and the names that lists key on.

Converted graphs call :func:`cast` and :func:`widest_dtype`, so they appear by these
qualified names in generated code (``mixprec_policy_ops_cast(x, torch.bfloat16)``). Both are
no-ops on anything mixprec must not touch: integer and bool tensors, float64 tensors,
``None`` and non-tensors, so a cast that turns out to be unnecessary at run time costs
one Python call and no kernel.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Iterable
from dataclasses import is_dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor

from mixprec.policy.dtypes import is_castable, to_dtype

__all__ = ["cast", "cast_tree", "op_key", "op_name", "widest_dtype", "widest_of"]


def cast(value: Any, dtype: torch.dtype | None) -> Any:
    """Cast a floating tensor (or each one in a nested structure) to ``dtype``.

    Integer, bool and float64 tensors, and non-tensors, pass through unchanged, as does a
    tensor that already has ``dtype`` (no copy, no kernel) and anything when ``dtype`` is
    None (no floating input to promote to).

    Example:
        >>> cast(torch.ones(2), torch.bfloat16).dtype
        torch.bfloat16
        >>> cast(torch.ones(2, dtype=torch.int64), torch.bfloat16).dtype
        torch.int64
    """
    if isinstance(value, torch.Tensor):
        if dtype is not None and value.dtype != dtype and is_castable(value):
            return to_dtype(value, dtype)
        return value
    if dtype is None or value is None or isinstance(value, (int, float, bool, str)):
        return value
    return cast_tree(value, dtype)


#: Leaf types a flat tuple may hold for :func:`cast_tree`'s fast path.
_FLAT = frozenset(
    {torch.Tensor, torch.nn.Parameter, int, float, bool, str, type(None), torch.dtype}
)


def cast_tree(tree: Any, dtype: torch.dtype) -> Any:
    """:func:`cast` every floating tensor in a nested structure (tuples, lists, dicts,
    named tuples, dataclasses, and any type registered with ``torch.utils._pytree``); a
    tensor that appears twice is cast once, so ``query is key is value`` stays true."""
    if isinstance(tree, torch.Tensor):  # the common cases, without a tree walk
        return to_dtype(tree, dtype) if tree.dtype != dtype and is_castable(tree) else tree
    compiling = torch.compiler.is_compiling()  # (the compiler would guard on each id)
    if compiling:
        known = _cast_known(tree, dtype)
        if known is not _MISSING:
            return known
    elif isinstance(tree, dict) and type(tree) is not dict:
        mirrored = _cast_mirrored(tree, dtype)
        if mirrored is not None:
            return mirrored
    return _cast_walk(tree, dtype, compiling)


def _cast_walk(tree: Any, dtype: torch.dtype, compiling: bool) -> Any:
    """:func:`cast_tree`'s walk of ``tree`` (``compiling``: under ``torch.compile``)."""
    casts: dict[int, torch.Tensor] = {}  # a tensor given twice is cast once (aliases stay)

    def tensor(leaf: torch.Tensor) -> torch.Tensor:
        if leaf.dtype == dtype or not is_castable(leaf):
            return leaf
        if compiling:
            return leaf.to(dtype)
        cast = casts.get(id(leaf))
        if cast is None:
            cast = casts[id(leaf)] = to_dtype(leaf, dtype)
        return cast

    if type(tree) is tuple and all(type(v) in _FLAT or _opaque(v) for v in tree):
        return tuple(tensor(v) if isinstance(v, torch.Tensor) else v for v in tree)

    def one(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return tensor(leaf)
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            # a dataclass pytree does not know: rebuild it with its fields cast
            fields = {
                f.name: cast_tree(getattr(leaf, f.name), dtype)
                for f in dataclasses.fields(leaf)
                if f.init
            }
            return dataclasses.replace(leaf, **fields)
        return leaf

    return pytree.tree_map(one, tree)


def cast_compiled(tree: Any, dtype: torch.dtype) -> Any:
    """:func:`cast_tree` under ``torch.compile``, with no check of whether it is compiling
    (each check is a guard)."""
    known = _cast_known(tree, dtype)
    return _cast_walk(tree, dtype, True) if known is _MISSING else known


def _cast_known(tree: Any, dtype: torch.dtype) -> Any:
    """Under ``torch.compile``: ``tree`` cast when it is made of tensors, tuples, lists,
    named tuples, dicts and dict dataclasses (transformers' ``ModelOutput``, rebuilt by its
    constructor from its cast items, as its pytree registration rebuilds it); otherwise
    ``_MISSING``, for the tree walk. A model's output is made by the traced call, so this
    walk costs no guard, where ``torch.utils._pytree`` reads its type registry, a global
    dict TorchDynamo guards entry by entry (about 25 guard-tree nodes on a transformers
    output)."""
    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if tree.dtype != dtype and is_castable(tree) else tree
    if tree is None or isinstance(tree, (int, float, bool, str)):
        return tree
    kind = type(tree)
    if kind is tuple or kind is list:
        items = [_cast_known(v, dtype) for v in tree]
        return _MISSING if any(v is _MISSING for v in items) else kind(items)
    if isinstance(tree, tuple) and hasattr(kind, "_fields"):  # a named tuple
        items = [_cast_known(v, dtype) for v in tree]
        return _MISSING if any(v is _MISSING for v in items) else kind(*items)
    # (``is_dataclass`` a name of this module's: through the ``dataclasses`` module, a
    # global of that function's too, TorchDynamo would guard in Python that both paths
    # reach one module)
    if kind is dict or (isinstance(tree, dict) and is_dataclass(tree)):
        cast = {k: _cast_known(v, dtype) for k, v in tree.items()}
        if any(v is _MISSING for v in cast.values()):
            return _MISSING
        return cast if kind is dict else kind(**cast)
    return _MISSING


def _opaque(value: Any) -> bool:
    """Whether the tree walk would take ``value`` as a leaf and keep it as it is (a KV
    cache object in a transformers output): no tensor, no container (tuple, list, dict
    or a type registered with ``torch.utils._pytree``) and no dataclass (rebuilt with its
    fields cast)."""
    return not (
        isinstance(value, (torch.Tensor, tuple, list, dict))
        or type(value) in pytree.SUPPORTED_NODES
        or dataclasses.is_dataclass(value)
    )


_MISSING = object()


def _cast_mirrored(tree: dict[Any, Any], dtype: torch.dtype) -> Any:
    """A dict subclass whose attributes mirror its items (transformers' ``ModelOutput``),
    with its values cast: a copy of its state (what ``copy.copy`` makes) with the cast
    values set, instead of a call of its constructor (which re-validates every field, a
    large part of a small model's host time); the object itself when no value
    changes. None for any other dict subclass (the pytree path rebuilds it)."""
    state = getattr(tree, "__dict__", None)
    if state is None or not tree or any(state.get(k, _MISSING) is not v for k, v in tree.items()):
        return None
    values = tuple(tree.values())
    cast = cast_tree(values, dtype)  # (one memo: a tensor in two fields is cast once)
    if all(a is b for a, b in zip(values, cast, strict=True)):
        return tree
    cls = type(tree)
    setitem = (
        collections.OrderedDict.__setitem__
        if isinstance(tree, collections.OrderedDict)
        else dict.__setitem__
    )
    new = cls.__new__(cls)
    new.__dict__.update(state)
    for key, value in zip(tree.keys(), cast, strict=True):
        setitem(new, key, value)
        new.__dict__[key] = value
    return new


def widest_of(dtypes: Iterable[torch.dtype]) -> torch.dtype | None:
    """The one widest-dtype rule: PyTorch's type promotion over ``dtypes`` (float32 beats
    the 16-bit types; float16 meets bfloat16 in float32); None for no dtype."""
    widest: torch.dtype | None = None
    for dtype in dtypes:
        widest = dtype if widest is None else torch.promote_types(widest, dtype)
    return widest


def widest_dtype(*values: Any) -> torch.dtype | None:
    """:func:`widest_of` the castable floating tensors in ``values`` (lists included).

    float64 tensors are ignored (never cast down, and never a reason to cast up), as
    ``torch.autocast``'s promote policy does. None when there is no castable tensor.
    """
    return widest_of(leaf.dtype for leaf in pytree.tree_leaves(values) if is_castable(leaf))


_REFLECTED = frozenset(
    (
        "radd",
        "rsub",
        "rmul",
        "rmatmul",
        "rtruediv",
        "rdiv",
        "rfloordiv",
        "rpow",
        "rmod",
        "rand",
        "ror",
        "rxor",
        "rlshift",
        "rrshift",
    )
)
_INPLACE = frozenset("i" + name[1:] for name in _REFLECTED)


def op_name(target: str | Callable[..., Any]) -> str:
    """The name lists know an op by: ``torch.matmul``, ``Tensor.matmul``, ``x @ y`` and the
    graph method ``"__matmul__"`` are all ``"matmul"``; in-place forms end in ``_``."""
    name = target if isinstance(target, str) else getattr(target, "__name__", repr(target))
    if name.startswith("__") and name.endswith("__") and len(name) > 4:
        name = name[2:-2]
        if name in _REFLECTED:
            name = name[1:]
        elif name in _INPLACE:
            name = name[1:] + "_"
    return name


_TORCH_MODULES = ("torch", "_operator", "operator", "builtins")


def op_key(target: str | Callable[..., Any]) -> str | Callable[..., Any]:
    """The key of an op in a list: its :func:`op_name` for torch and operator functions
    and Tensor methods; the function object itself for anything else (a user's function)."""
    if isinstance(target, str):
        return op_name(target)
    module = getattr(target, "__module__", None)
    if module is None or module.split(".")[0] in _TORCH_MODULES:
        return op_name(target)
    return target


def only_plain_tensors(args: Iterable[Any], kwargs: dict[str, Any]) -> bool:
    """True when no operand (top level or in a list/tuple) is a tensor subclass of its own.

    Parameters, buffers and fake tensors count as plain. A subclass with its own dispatch
    (torchao's Float8 tensors, DTensor) keeps its own rules for its GEMMs and casts: mixprec's
    run-time modes leave such ops alone.
    """
    plain = PLAIN_TYPES
    for value in (*args, *kwargs.values()):
        if type(value) in plain:
            continue
        for leaf in value if isinstance(value, (list, tuple)) else (value,):
            if (
                isinstance(leaf, torch.Tensor)
                and type(leaf) not in plain
                and not _behaves_plain(type(leaf))
            ):
                return False
    return True


@functools.lru_cache(maxsize=64)
def _behaves_plain(cls: type) -> bool:
    """A tensor subclass with no rules of its own: torch-function handling disabled (as
    ``nn.Parameter`` has it) and no ``__torch_dispatch__`` (a Parameter subclass such as the
    training step's low-precision copies)."""
    return (
        getattr(cls, "__torch_function__", None) is torch._C._disabled_torch_function_impl
        and getattr(cls, "__torch_dispatch__", None) is torch.Tensor.__torch_dispatch__
    )


_BUFFER: tuple[type, ...] = (torch.nn.Buffer,) if hasattr(torch.nn, "Buffer") else ()
#: Tensor types with no rules of their own (a constant: TorchDynamo warns on a cached
#: function it traces)
PLAIN_TYPES: frozenset[type] = frozenset((torch.Tensor, torch.nn.Parameter, FakeTensor, *_BUFFER))


#: The higher-order operators TorchDynamo makes of blocks it traces as a body of their
#: own: a checkpointed block (``torch.utils.checkpoint.checkpoint``) is one
#: ``tag_activation_checkpoint`` call, which a torch-function mode sees whole and, by the
#: rule of modes, calls with itself off, so the block's ops would be traced with no mode
#: (compiled, O1 computed a checkpointed layer in float32, and O2's mixed operands failed
#: in it with a dtype error): a mode runs its body under itself (:func:`under`).
HIGHER_ORDER = frozenset(
    type(op)
    for op in (
        getattr(torch.ops.higher_order, "tag_activation_checkpoint", None),
        getattr(torch.ops.higher_order, "wrap", None),
    )
    if op is not None
)


def held_under(mode: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A higher-order operator's ``args`` with its body (the first) run :func:`under`
    ``mode``. First an equal mode is entered and left here, outside the operator: the
    torch-function mode stack is then a state TorchDynamo knows this frame changes, and it
    lets the body change it too (the body's own entering is otherwise the stack's first
    change in the frame, "a mutation from outside the operator's scope", which breaks the
    graph: a frame traced on its own after a break, as a transformers layer's
    checkpoint is)."""
    with mode.again():
        pass
    return (functools.partial(under, mode, args[0]), *args[1:])


def under(mode: Any, body: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``body(*args, **kwargs)`` under a mode equal to ``mode`` (a higher-order operator's
    body): a new one, made inside the body (TorchDynamo refuses a body that enters a mode
    made outside it, as a mutation from outside the operator's scope)."""
    with mode.again():
        return body(*args, **kwargs)
