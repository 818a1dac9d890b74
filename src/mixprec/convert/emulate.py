"""Emulated low precision: float16/bfloat16 numerics at float32 speed on any machine.

A CPU without bfloat16 dot-product instructions runs a bfloat16 matmul about 250 times
slower than a float32 one, and float16 matmuls are slow on nearly every CPU. Emulation
is a layer put on a model *after* conversion, whatever the conversion did:

- tensors keep their real low-precision dtypes everywhere, so every decision of the level
  (which op runs low, promotion, casts, cast counts) is exactly the native one;
- only the GEMM family (``F.linear``, ``matmul``/``@``, ``mm``, ``bmm``, ``addmm``,
  ``baddbmm``, ``addbmm``, ``mv``, ``addmv``, ``dot``, ``einsum``, ``tensordot``,
  convolutions, ``scaled_dot_product_attention``, multi-head attention, the recurrent
  layers and cells, and their Tensor-method forms; also max pooling, exact in any dtype
  but slow in bfloat16 without native support) is replaced, when its floating inputs
  all have one low dtype: the inputs are cast up to float32 (exact), the float32 kernel
  runs, and the result is rounded to the low dtype. That is what a native kernel does
  (float32 accumulation, one rounding of the result), up to the order of accumulation;
- autograd records the casts, so backward runs float32 GEMMs and rounds each gradient
  to the low dtype at the same boundaries, even when ``loss.backward()`` is called
  outside the model; float16 overflow still gives ``inf`` (the rounding overflows), so
  loss scaling backs off as on real hardware;
- every other op runs its own low-precision CPU kernel, which already computes in
  float32 and rounds.

The layer is a :class:`EmulationMode` (a ``TorchFunctionMode``) entered by hooks on
every module of the converted model, so a call of the model, of any submodule, or a
recomputation under activation checkpointing runs under it; only the outermost module
call of a thread enters and leaves it. Composite functions the table does not name run
their inner ops natively (a mode does not see inside a function it handed on).

Example:
    >>> net = mixprec.auto_mixed_precision(model, "O2", "bf16", emulate=True)
    >>> net(x)  # bfloat16 numerics, float32 kernels
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from mixprec.convert.cast_at_use import ModuleCall
from mixprec.convert.plan import CastPlan, Conversion
from mixprec.convert.runtime import ShowsForward
from mixprec.convert.structure import (
    CONVERSION_ATTR,
    HookedCall,
    add_repr_note,
    conversion_of,
    forward_of,
    set_forward,
    user_class,
)
from mixprec.policy.dtypes import dtype_name
from mixprec.policy.ops import only_plain_tensors

__all__ = [
    "EMULATED_FUNCTIONS",
    "EmulatedCastPlan",
    "EmulationMode",
    "emulated_dtype",
    "emulating",
    "install_emulation",
    "is_emulated",
]

_LOW = (torch.float16, torch.bfloat16)


def _present(*candidates: object) -> tuple[Callable[..., Any], ...]:
    return tuple(c for c in candidates if callable(c))


_VF = torch._C._VariableFunctions
_T = torch.Tensor

#: The functions computed in float32 on rounded inputs (out-of-place forms).
EMULATED_FUNCTIONS: frozenset[Callable[..., Any]] = frozenset(
    _present(
        F.linear,
        F.bilinear,
        torch.matmul,
        torch.mm,
        torch.bmm,
        torch.addmm,
        torch.baddbmm,
        torch.addbmm,
        torch.mv,
        torch.addmv,
        torch.dot,
        torch.vdot,
        torch.inner,
        torch.einsum,
        torch.tensordot,
        torch.chain_matmul,
        torch.linalg.matmul,
        torch.linalg.multi_dot,
        torch.linalg.vecdot,
        F.conv1d,
        F.conv2d,
        F.conv3d,
        F.conv_transpose1d,
        F.conv_transpose2d,
        F.conv_transpose3d,
        torch.conv_tbc,
        F.scaled_dot_product_attention,
        F.multi_head_attention_forward,
        getattr(torch, "_native_multi_head_attention", None),
        getattr(torch, "_transformer_encoder_layer_fwd", None),
        _VF.lstm,
        _VF.gru,
        _VF.rnn_tanh,
        _VF.rnn_relu,
        _VF.lstm_cell,
        _VF.gru_cell,
        _VF.rnn_tanh_cell,
        _VF.rnn_relu_cell,
        # exact in any precision, but slow in bfloat16 where oneDNN has no native support
        F.max_pool1d,
        F.max_pool2d,
        F.max_pool3d,
        _T.matmul,
        _T.__matmul__,
        _T.__rmatmul__,
        _T.mm,
        _T.bmm,
        _T.addmm,
        _T.baddbmm,
        _T.addbmm,
        _T.mv,
        _T.addmv,
        _T.dot,
        _T.vdot,
        _T.inner,
    )
)

#: In-place forms: computed out of place in float32, rounded and written back.
_IN_PLACE: frozenset[Callable[..., Any]] = frozenset(
    _present(_T.addmm_, _T.baddbmm_, _T.addbmm_, _T.addmv_)
)


def _floats(value: Any) -> Iterator[torch.Tensor]:
    """The floating tensors of an argument (a tensor, or a list/tuple of them)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _floats(item)


def _low_dtype(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.dtype | None:
    """The one low dtype of every floating input, or None (then the call runs natively,
    with its native result or error)."""
    found: torch.dtype | None = None
    for value in (*args, *kwargs.values()):
        for tensor in _floats(value):
            if tensor.dtype not in _LOW or (found is not None and tensor.dtype != found):
                return None
            found = tensor.dtype
    return found


class _Upcast(torch.autograd.Function):
    """``low`` cast to float32 into ``buffer`` (a reused allocation); backward rounds the
    gradient to ``low``'s dtype, as the cast's own backward would."""

    @staticmethod
    def forward(ctx: Any, low: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        ctx.dtype = low.dtype
        buffer.copy_(low)
        return buffer.view(buffer.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.dtype), None


def _storage_users(tensor: torch.Tensor) -> int:
    return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata))


class _BufferPool:
    """Float32 buffers for the upcasts of large tensors, reused from call to call.

    A fresh large allocation costs page faults on every call (the system allocator maps
    and unmaps big blocks), often more than the cast itself. A buffer is reused only when
    nothing but the pool holds its storage (no autograd graph saved it, no view of it is
    alive), so reuse never overwrites a value still needed.
    """

    #: tensors at least this large (elements) are upcast into pooled buffers
    MIN_NUMEL = 1 << 18

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, like: torch.Tensor) -> torch.Tensor:
        key = (tuple(like.shape), like.device)
        with self._lock:
            buffers = self._buffers.setdefault(key, [])
            for buffer in buffers:
                if _storage_users(buffer) <= 2:  # the pool's tensor and the probe's storage
                    return buffer
            buffer = torch.empty(like.shape, dtype=torch.float32, device=like.device)
            buffers.append(buffer)
            return buffer


def _up(value: Any, pool: _BufferPool | None) -> Any:
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            return value
        if pool is not None and value.numel() >= pool.MIN_NUMEL and value.is_contiguous():
            return _Upcast.apply(value, pool.take(value))
        return value.float()
    if isinstance(value, (list, tuple)):
        return type(value)(_up(item, pool) for item in value)
    if isinstance(value, dict):
        return {key: _up(item, pool) for key, item in value.items()}
    return value


def _down(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.dtype == torch.float32 else value
    if isinstance(value, (list, tuple)):
        return type(value)(_down(item, dtype) for item in value)
    return value


class EmulationMode(TorchFunctionMode):
    """Runs the GEMM family in float32 on low-precision inputs, rounding the results.

    Args:
        pool: where large upcasts are allocated (reused across calls); None for fresh
            allocations.

    Example:
        >>> with EmulationMode():
        ...     y = torch.randn(4, 8).bfloat16() @ torch.randn(8, 2).bfloat16()
        >>> y.dtype
        torch.bfloat16
    """

    def __init__(self, pool: _BufferPool | None = None) -> None:
        super().__init__()
        self.pool = pool

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func not in EMULATED_FUNCTIONS and func not in _IN_PLACE:
            return func(*args, **kwargs)
        if not only_plain_tensors(args, kwargs):  # torchao Float8, DTensor: their own dispatch
            return func(*args, **kwargs)
        if func in EMULATED_FUNCTIONS:
            low = None if kwargs.get("out") is not None else _low_dtype(args, kwargs)
            if low is not None:
                return _down(func(*_up(args, self.pool), **_up(kwargs, self.pool)), low)
        elif func in _IN_PLACE:
            low = None if kwargs.get("out") is not None else _low_dtype(args, kwargs)
            if low is not None:
                target = args[0]
                result = getattr(torch, func.__name__[:-1])(*_up(args, None), **_up(kwargs, None))
                return target.copy_(result)
        return func(*args, **kwargs)


@contextmanager
def emulating() -> Iterator[EmulationMode]:
    """Emulate low precision for the code in the block (restored even when it raises).

    Example:
        >>> with emulating():
        ...     y = torch.nn.functional.linear(x.bfloat16(), w.bfloat16())
    """
    with EmulationMode() as mode:
        yield mode


class _Emulation:
    """The hooks that put a converted model's calls under :class:`EmulationMode`.

    One per converted model, shared by all its modules; per thread it counts how deep in
    module calls it is, so that only the outermost call enters and leaves the mode.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._local = threading.local()
        self._pool = _BufferPool()

    def __getstate__(self) -> dict[str, Any]:
        return {"dtype": self.dtype}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["dtype"])  # type: ignore[misc]

    def mode(self) -> EmulationMode:
        """A fresh mode for one outermost call (sharing this model's buffer pool)."""
        return EmulationMode(self._pool)

    def enter(self, module: nn.Module, args: Any) -> None:
        local = self._local
        depth = getattr(local, "depth", 0)
        if depth == 0:
            local.mode = EmulationMode(self._pool)
            local.mode.__enter__()
        local.depth = depth + 1

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        local = self._local
        depth = getattr(local, "depth", 0)
        if depth == 0:  # a pre-hook before ours raised: we never entered
            return
        local.depth = depth - 1
        if depth == 1:
            mode, local.mode = local.mode, None
            mode.__exit__(None, None, None)

    def abandon(self) -> None:
        """Leave the mode now: a call was interrupted by a ``BaseException`` (such as
        ``KeyboardInterrupt``), for which ``nn.Module`` runs no forward hooks."""
        local = self._local
        mode = getattr(local, "mode", None)
        local.depth, local.mode = 0, None
        if mode is not None:
            mode.__exit__(None, None, None)


class _Guarded(HookedCall, ShowsForward):
    """The root's ``forward``: leaves the emulation mode when the call is interrupted.

    It shows the signature of the forward it wraps (``generate()`` reads it to decide
    which arguments to pass). Picklable (it holds the module and the instance ``forward``
    it wraps, if any).
    """

    def __init__(self, emulation: _Emulation, module: nn.Module, inner: Any) -> None:
        self.emulation, self.module, self.inner = emulation, module, inner

    def shown(self) -> Callable[..., Any] | None:
        return self.inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            if self.inner is None:
                return user_class(self.module).forward(self.module, *args, **kwargs)
            return self.inner(*args, **kwargs)
        except Exception:
            raise
        except BaseException:
            self.emulation.abandon()
            raise


@dataclasses.dataclass(frozen=True)
class EmulatedCastPlan(CastPlan):
    """A cast plan whose low-precision ops are emulated (see :mod:`.emulate`)."""

    emulated: bool = True

    def table(self) -> str:
        first, _, rest = super().table().partition("\n")
        note = f"; {self.dtype} emulated: float32 GEMMs on rounded inputs, results rounded"
        return f"{first}{note}\n{rest}"

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "emulated": True}


def _emulated_plan(plan: CastPlan) -> EmulatedCastPlan:
    values = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.init}
    return EmulatedCastPlan(**values)


def install_emulation(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Make every call of a converted ``network`` (and of each of its submodules) run
    under :class:`EmulationMode`; its cast plan and ``repr`` say so. Returns ``network``.

    Call it on the converted copy only (the hooks go on each module of the tree).

    Example:
        >>> net = install_emulation(mixprec.auto_mixed_precision(model, "O2"), torch.bfloat16)
        >>> mixprec.explain(net).emulated
        True
    """
    emulation = _Emulation(dtype)
    for module in network.modules():
        call = forward_of(module)
        if isinstance(call, ModuleCall):  # entered and left in the call's own try/finally
            call.state.emulation = emulation.mode
            continue
        module.register_forward_pre_hook(emulation.enter, prepend=True)
        module.register_forward_hook(emulation.leave, always_call=True)
        if module is network:
            inner = forward_of(module) or module.__dict__.get("forward")
            set_forward(module, _Guarded(emulation, module, inner))
    conversion = conversion_of(network)
    if isinstance(conversion, Conversion):
        network.__dict__[CONVERSION_ATTR] = dataclasses.replace(
            conversion, plan=_emulated_plan(conversion.plan)
        )
    add_repr_note(network, f"emulated={dtype_name(dtype)} (float32 kernels, results rounded)")
    network.__dict__["_mixprec_emulation"] = emulation
    return network


def emulated_dtype(network: nn.Module) -> torch.dtype | None:
    """The dtype ``network`` emulates, or None when it runs natively."""
    emulation = network.__dict__.get("_mixprec_emulation")
    return emulation.dtype if isinstance(emulation, _Emulation) else None


def is_emulated(network: nn.Module) -> bool:
    """Whether ``network`` was converted with ``emulate=True``.

    Example:
        >>> is_emulated(mixprec.auto_mixed_precision(model, "O2", emulate=True))
        True
    """
    return emulated_dtype(network) is not None
