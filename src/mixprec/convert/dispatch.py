"""O1's white list applied at PyTorch's dispatcher: a kernel per listed operator only.

O1 decides one thing per op: a white-list op computes in the low dtype and returns float32;
every other op follows its inputs. A ``TorchFunctionMode`` makes that decision in Python
for every call (each op, tensor method and property), most of which need nothing. Here the
decision is made where ``torch.autocast`` makes its own: one dispatch key, whose kernels
are registered (``torch.library``) for the listed ATen operators only and which falls
through for every other operator, in C++. The key is in effect only inside a converted
model's call, in the thread that runs it (the dispatcher's thread-local include set), so
nothing else in the process ever reaches the kernels.

The key is one of ``torch.autocast``'s keys that belongs to a backend this process does
not have (Graphcore IPU, else Habana HPU): it sits above autograd (the casts a kernel makes
are recorded for backward, as autocast's are) and above ``AutocastCPU``/``AutocastCUDA``.
A key some library has registered kernels for, or an op no ATen operator stands for (a
Python-level function on a user's white list), makes :func:`supports` answer False, and
that conversion runs under the mode (:class:`~mixprec.convert.runtime.RuntimeListMode`),
as a call under ``torch.compile`` does (TorchDynamo traces modes, not dispatch keys).

The decision is made at ATen's operator level, as ``torch.autocast`` makes it: an
operator PyTorch implements by calling a listed one (``tensordot`` and ``cdist`` call
``mm``) computes that part in the low dtype.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from mixprec.policy.ops import only_plain_tensors

if TYPE_CHECKING:
    from mixprec.convert.runtime import RuntimeListMode

__all__ = ["ListRegion", "aside", "is_excluded", "key", "set_excluded", "supports"]

#: The dispatcher's thread-local exclusion of one key, set and read directly: a
#: ``_ExcludeDispatchKeyGuard`` costs three times as much, on the hot path of every listed
#: op and one-call layer (a kernel is reached only where its key is not excluded, so it
#: knows what to put back)
set_excluded = torch._C._dispatch_tls_set_dispatch_key_excluded
is_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded

#: Autocast keys of backends PyTorch builds no kernels for, in order of preference.
_CANDIDATE_KEYS = ("AutocastIPU", "AutocastHPU")


class _Local(threading.local):
    def __init__(self) -> None:
        self.state: RuntimeListMode | None = None


_LOCAL = _Local()


def _free(key_name: str) -> bool:
    """No kernel of anyone's is registered at this key for the ops that matter here."""
    return not any(
        torch._C._dispatch_has_kernel_for_dispatch_key(name, key_name)
        for name in ("aten::linear", "aten::mm", "aten::matmul", "aten::conv2d", "aten::add.Tensor")
    )


class _Kernels:
    """The process's registrations: the key, its fallthrough, a kernel per listed op."""

    def __init__(self) -> None:
        self.key_name = next((k for k in _CANDIDATE_KEYS if hasattr(torch._C.DispatchKey, k)), "")
        self.usable = bool(self.key_name) and _free(self.key_name)
        self.names: set[str] = set()
        self.refused: set[str] = set()
        self.lock = threading.Lock()
        if not self.usable:
            return
        self.key = getattr(torch._C.DispatchKey, self.key_name)
        self.keyset = torch._C.DispatchKeySet(self.key)
        self._fallthrough = torch.library.Library("_", "IMPL")
        try:
            self._fallthrough.fallback(torch.library.fallthrough_kernel, self.key_name)
        except RuntimeError:  # a library already registered a fallback of its own there
            self.usable = False
            return
        self._library = torch.library.Library("aten", "IMPL")

    def register(self, name: str) -> bool:
        """A kernel for every overload of ``aten::<name>`` (not the ``out=`` forms);
        False (the list then runs as the mode) for a name no ATen operator has, or one
        whose kernels cannot be registered."""
        if name in self.names:
            return True
        with self.lock:
            if name in self.names or name in self.refused:
                return name in self.names
            packet = getattr(torch.ops.aten, name, None) if name.isidentifier() else None
            if not isinstance(packet, torch._ops.OpOverloadPacket):
                self.refused.add(name)
                return False
            try:
                for overload in packet.overloads():
                    if overload == "out" or overload.endswith("_out"):
                        continue
                    if not _in_dispatcher(name, overload):  # TorchScript's own: einsum.sublist
                        continue
                    op = getattr(packet, overload)
                    qualified = name if overload == "default" else f"{name}.{overload}"
                    self._library.impl(qualified, _kernel(op, name, self.key), self.key_name)
            except RuntimeError:  # (a kernel of another library's at this key)
                self.refused.add(name)
                return False
            self.names.add(name)
        return True


def _in_dispatcher(name: str, overload: str) -> bool:
    """Whether the dispatcher has ``aten::<name>.<overload>`` (TorchScript lists a few
    overloads of its own)."""
    try:
        torch._C._dispatch_find_schema_or_throw(
            f"aten::{name}", "" if overload == "default" else overload
        )
    except RuntimeError:
        return False
    return True


_KERNELS: _Kernels | None = None
_MADE = threading.Lock()


def _kernels() -> _Kernels:
    global _KERNELS
    if _KERNELS is None:
        with _MADE:
            if _KERNELS is None:
                _KERNELS = _Kernels()
    return _KERNELS


def supports(names: Iterable[Any]) -> bool:
    """Whether every op key in ``names`` (a recipe's white list) runs as a kernel here
    (registering the kernels the first time)."""
    kernels = _kernels()
    if not kernels.usable:
        return False
    return all(isinstance(name, str) and kernels.register(name) for name in names)


def _kernel(op: Any, name: str, key: Any) -> Callable[..., Any]:
    """The kernel of ``op`` (``aten::<name>``): in the running call's state's list, its
    floating operands cast down (each value once per call), its result cast back. The key
    is excluded while it runs, so the ops a composite calls (``matmul``'s ``mm``) are
    not listed again."""
    call = op._op  # (the operator itself, without the overload object's Python frame)
    binding = _binding(name)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        state = _LOCAL.state
        set_excluded(key, True)  # (reached only where the key is not excluded)
        try:
            if (
                state is None
                or state.suspended
                or name not in state.names
                or not (
                    (_PLAIN.issuperset(map(type, args)) or _plain(args))
                    and (not kwargs or _plain(kwargs.values()))
                )
            ):  # (a tensor subclass of its own, torchao's float8 or DTensor: its rules)
                return call(*args, **kwargs)
            down = state.down
            low = [
                down(value)
                if type(value) in _TENSORS
                else value
                if type(value) in _SCALARS
                else _down(state, value)
                for value in args
            ]
            if kwargs:
                kwargs = {word: _down(state, value) for word, value in kwargs.items()}
            # (a torch-function mode sees nothing of it: the mode is off while it runs the
            # call the model made, and this call is made inside that one)
            out = call(*low, **kwargs) if binding is None else binding(*low, **kwargs)
            if not state.back:
                return out
            # (never under the compiler, which runs the mode: the eager cast back directly)
            return state.cast_back_eager(out) if type(out) is torch.Tensor else state.cast_back(out)
        finally:
            set_excluded(key, False)

    return kernel


#: Where the Python bindings of ATen's operators are: a binding parses its arguments and
#: reaches the operator sooner than the operator's boxed call does (``addmm``: 3 µs less)
_NAMESPACES = (torch._C._VariableFunctions, torch._C._nn)


def _binding(name: str) -> Callable[..., Any] | None:
    """``aten::<name>``'s Python binding (which takes every overload's arguments as the
    dispatcher passes them to a kernel: positional, and keyword-only by name), if any."""
    for namespace in _NAMESPACES:
        function = getattr(namespace, name, None)
        if function is not None:
            return function
    return None


#: Types told apart by type alone on the hot path: tensors with no rules of their own,
#: and the non-tensor operands ops take (anything else asks ``only_plain_tensors``).
_PLAIN = frozenset((torch.Tensor, torch.nn.Parameter, type(None), bool, int, float, str))
_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))
_SCALARS = _PLAIN - _TENSORS


def _plain(values: Iterable[Any]) -> bool:
    """No operand (nor a TensorList's item) is a tensor subclass with rules of its own."""
    for value in values:
        if type(value) not in _PLAIN and not only_plain_tensors((value,), {}):
            return False
    return True


def _down(state: RuntimeListMode, value: Any) -> Any:
    """One operand of a listed op: a floating tensor (not float64), or each in a
    TensorList, cast down once per call."""
    if type(value) in _PLAIN:
        return state.down(value) if isinstance(value, torch.Tensor) else value
    if isinstance(value, torch.Tensor):
        return state.down(value)
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return type(value)(_down(state, item) for item in value)  # einsum's operands
    return value


class ListRegion:
    """Inside: this thread's ops run under ``state``'s white list (the listed ops' kernels
    read it); the state and the dispatcher's thread-local sets are put back on exit."""

    __slots__ = ("_guards", "_saved", "state")

    def __init__(self, state: RuntimeListMode) -> None:
        self.state = state

    def __enter__(self) -> RuntimeListMode:
        kernels = _kernels()
        self._saved = _LOCAL.state
        _LOCAL.state = self.state
        self._guards = (
            torch._C._IncludeDispatchKeyGuard(kernels.key),
            torch._C._SetExcludeDispatchKeyGuard(kernels.key, False),
        )
        for guard in self._guards:
            guard.__enter__()
        return self.state

    def __exit__(self, *exc: object) -> None:
        try:
            for guard in reversed(self._guards):
                guard.__exit__(None, None, None)
        finally:
            _LOCAL.state = self._saved


def key() -> Any:
    """The key's ``DispatchKey`` (None when the kernels are not used)."""
    if _KERNELS is None or not _KERNELS.usable:
        return None
    return _KERNELS.key


def aside() -> Any:
    """A context inside which no listed op's kernel runs (a converted child with casts of
    its own runs there); None when the kernels were never registered."""
    if _KERNELS is None or not _KERNELS.usable:
        return None
    return torch._C._ExcludeDispatchKeyGuard(_KERNELS.keyset)
