"""Cast at use: low-precision weights that every entry point of a converted module sees.

A module converted at O2/O3 keeps the user's float32 Parameters in its ``_parameters``
(same objects, so ``state_dict``, optimizers, ``load_state_dict`` and ``.data`` writes all
reach the one true tensor). Its low-precision view is made **while a module of the
conversion runs**, in the thread that runs it:

1. every module of the converted tree has an instance ``forward`` (:class:`ModuleCall`)
   that marks the call as running in this thread, whichever way the call came (the root's
   ``forward``, a submodule called directly, ``generate()`` or a feature method calling its
   parts, a checkpointed recomputation in backward);
2. a module whose Parameters compute in low precision holds them in a
   :class:`LowParameters` dict: reading ``module.weight`` (or ``module.parameters()``)
   inside a running call returns the weight cast to the low dtype, cast once per
   outermost call and thread (a tied weight is cast once), so ``self.weight.dtype`` and
   ``self.parameters()`` say what the module computes in; outside a call it returns the
   stored Parameter. Nothing shared is mutated, so two threads can run one model at once;
3. in the code of the module a call entered by (the root, or a submodule called
   directly), of loss modules and of modules that hold floating buffers,
   :class:`MixedOperands` applies ``torch.autocast``'s rule to operands the model itself
   mixes (a float32 buffer, a tensor made with ``.float()`` or
   a float32 mask, meeting a low-precision activation): an op on autocast's
   lower-precision list (``linear``, ``matmul``, ``conv*``, ``bmm``, ``addmm``,
   ``baddbmm``, ``einsum``, attention, ...) computes in the low dtype; every other op
   follows PyTorch's type promotion (float32 wins), never a dtype error. Every other
   module's code runs with no mode at all, as PyTorch runs it: the mode's Python call per
   op cost more host time than the rest of the conversion together (a model that makes a
   float32 tensor in such a module and feeds it to a matmul with low activations gets
   PyTorch's dtype error, with a note saying how to fix it, as a pure low-precision model
   would);
4. an ``nn.Linear``, ``nn.Conv1d/2d/3d``, ``nn.Embedding`` or low ``nn.LayerNorm`` (O3)
   that runs its class's own ``forward`` (checked
   at each call: its class, the class's ``forward``, its weights in its ``_parameters``)
   makes that forward's one call itself (:meth:`ModuleCall._direct`): the same casts and
   the same call, with no Python frame for the forward or for its weight reads.

Weights are cast afresh on each outermost call (once per weight), so every write to a
Parameter (in place, ``.data``, ``load_state_dict``, a fused optimizer that bumps no
version counter) is what the next call computes with: there is no cast cache across
calls, because no cheap check could tell a cached cast is still exact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
import types
from collections.abc import Callable, Collection, Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.compiler import is_dynamo_compiling as _dynamo_compiling
from torch.nn.modules.module import (
    _global_backward_hooks,
    _global_backward_pre_hooks,
    _global_forward_hooks,
    _global_forward_pre_hooks,
)
from torch.nn.utils import parametrize
from torch.overrides import TorchFunctionMode

from mixprec._warn import warn
from mixprec.convert import weight_hooks
from mixprec.convert.structure import (
    CLASS_METHODS,
    compiled_facts,
    eager_call,
    facts_key,
    forward_facts,
    forward_of,
    hooked_compiled,
    is_converted_exactly,
    owner,
    register,
    restore_key,
    set_parameters,
    torch_forward,
    user_class,
)
from mixprec.policy import lists
from mixprec.policy.dtypes import _CAST_METHODS, _CASTABLE, dtype_name, is_castable, to_dtype
from mixprec.policy.levels import Recipe
from mixprec.policy.ops import (
    HIGHER_ORDER,
    cast_compiled,
    cast_tree,
    held_under,
    only_plain_tensors,
    op_name,
)

__all__ = [
    "CastState",
    "LowParameter",
    "LowParameters",
    "MixedOperands",
    "ModuleCall",
    "cast_args",
    "has_fast_path",
    "low_precision_parameters",
    "settled",
]

_LOWER_OPS = lists.CPU_LOWER_OPS | lists.CUDA_LOWER_OPS
#: the loss functions (autocast runs them in float32 on every device)
_LOSSES = frozenset(
    name
    for name in lists.CPU_FP32_OPS | lists.CUDA_FP32_OPS
    if "loss" in name or "entropy" in name or name == "kl_div"
)
_AUTOCAST_DEVICES = ("cpu", "cuda")


def _tracing() -> bool:
    """Under TorchDynamo (``torch.compile``, strict ``torch.export``), which graph-breaks
    on thread-local state and on entering a mode: weights are cast at each read, inside
    the graph, and mixed operands are not rewritten. Non-strict ``torch.export`` (not
    TorchDynamo) runs the eager path."""
    return torch.compiler.is_dynamo_compiling()


def _version(tensor: torch.Tensor) -> int:
    try:
        return int(tensor._version)
    except RuntimeError:  # an inference tensor has no version counter
        return -1


def write_back(stored: torch.Tensor, low: torch.Tensor) -> None:
    """A write the forward made into ``low`` (a cast of ``stored``) made into ``stored``:
    the elements it changed take the written value, the others keep their own bits."""
    with torch.no_grad(), torch._C.DisableTorchFunction():
        before = stored.to(low.dtype)
        stored.copy_(torch.where(low != before, low.to(stored.dtype), stored))


#: A weight's cast in a running call: (stored, cast, the cast's version when made (-1: an
#: inference tensor, which has no version counter), the cast's data pointer when made (-1:
#: a fake or functional tensor)); both :data:`_UNSEEN` for a cast only a one-call layer's
#: kernel has taken (:meth:`ModuleCall._direct`), which no code of the model has seen yet
_Cast = tuple[torch.Tensor, torch.Tensor, int, int]
#: The version and pointer of a cast no code of the model has seen: nothing can have
#: written into it, so the write check at the call's end passes it by; its first read by
#: the model's code records them (:func:`_seen`)
_UNSEEN = -2


def _flush(cast: _Cast, listed: set[int] | frozenset[int] = frozenset()) -> None:
    """A write the forward made into a weight's cast (in place, or ``cast.data = ...``,
    which moves no version counter: a momentum encoder's update), made into the stored
    Parameter. ``listed``: the casts ``module.parameters()`` gave out (a write into one of
    those is an update of the parameters, made in the low dtype: warned of)."""
    stored, low, version, pointer = cast
    if low is stored or version == _UNSEEN:
        return
    if pointer != -1 and low.data_ptr() != pointer:  # ``.data`` replaced
        if low.shape != stored.shape:
            with torch.no_grad():
                stored.data = low.detach().to(stored.dtype)
            return
        write_back(stored, low)
        _warn_low_update(low, "replaced the .data of")
    elif version != -1 and low._version != version:
        write_back(stored, low)
        if id(low) in listed:
            _warn_low_update(low, "wrote in place into")


def _warn_low_update(low: torch.Tensor, how: str) -> None:
    name = dtype_name(low.dtype)
    warn(
        f"mixprec: the forward {how} a Parameter's {name} cast, read from "
        "parameters() or by name (a momentum or EMA update inside forward?); the update "
        f"reaches the float32 Parameter rounded to {name}, where a small one is lost. Make "
        "it in float32: `with mixprec.float32_parameters(module): ...` around it inside the "
        "forward, or make it outside the forward"
    )


class _Frame:
    """One thread's outermost running call of a conversion: its casts and its mode."""

    __slots__ = ("active", "casts", "depth", "extra", "listed", "mode")

    def __init__(self, mode: MixedOperands) -> None:
        self.depth = 0
        self.active = False  # whether ``mode`` is on the torch-function stack now
        # id(stored) -> (stored, its cast, the cast's version and data pointer when made)
        self.casts: dict[int, _Cast] = {}
        self.mode = mode
        self.extra: TorchFunctionMode | None = None  # the emulation mode, when emulated
        #: ids of the casts ``parameters()`` gave out in this call (see :func:`_flush`)
        self.listed: set[int] = set()


class _CastLocal(threading.local):
    """One conversion's per-thread state: each thread's frame exists from its first read
    (so the hot path reads ``local.frame`` with no default to supply)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.frame = _Frame(MixedOperands(dtype))


class CastState:
    """Which threads are inside a call of one conversion, and their weight casts.

    One per conversion, shared by every :class:`ModuleCall` and :class:`LowParameters`
    of it. Copies (``deepcopy``, pickle) get a fresh state.
    """

    def __init__(self, dtype: torch.dtype, recipe: Recipe | None = None) -> None:
        self.dtype = dtype
        #: the conversion's recipe: a module registered after conversion is converted by
        #: it (:func:`_registered`)
        self.recipe = recipe
        # this thread's frame exists from the start, so a compiled caller sees one state
        self._local = _CastLocal(dtype)
        # makes the mode an emulated conversion's calls run under (emulate=True)
        self.emulation: Callable[[], TorchFunctionMode] | None = None
        self.warned = False  # the outer-autocast warning, once per conversion
        #: runs when a submodule is called directly (not inside a call of the root): the
        #: master weights reconcile outside writes there as the root's entry does
        self.on_direct_call: Callable[[], None] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (CastState, (self.dtype, self.recipe), {"emulation": self.emulation})

    def frame(self) -> _Frame | None:
        """This thread's running call, or None outside every call."""
        frame: _Frame = self._local.frame
        return frame if frame.depth > 0 else None

    def enter(self) -> _Frame:
        """Mark a module call of this conversion as running in this thread (pair with
        :meth:`exit` in a ``finally``)."""
        frame: _Frame = self._local.frame
        frame.depth += 1
        if frame.depth == 1:
            frame.mode.__enter__()
            frame.active = True
            extra = self.emulation
            if extra is not None:
                frame.extra = extra()
                frame.extra.__enter__()
        return frame

    def exit(self, frame: _Frame) -> None:
        frame.depth -= 1
        if frame.depth == 0:
            try:
                with torch._C.DisableTorchFunction():
                    listed = frame.listed
                    for cast in frame.casts.values():
                        stored, low, version, pointer = cast  # (_flush's test, inline)
                        if (
                            low is not stored
                            and version != _UNSEEN
                            and (
                                (pointer != -1 and low.data_ptr() != pointer)
                                or (version != -1 and low._version != version)
                            )
                        ):
                            _flush(cast, listed)  # (the forward wrote into a weight)
            finally:
                frame.casts.clear()
                frame.listed.clear()
                if frame.extra is not None:
                    frame.extra.__exit__(None, None, None)
                    frame.extra = None
                frame.mode.__exit__(None, None, None)
                frame.active = False


#: Tensor types whose calls run no ``__torch_function__`` of their own.
_NO_TORCH_FUNCTION = frozenset((nn.Parameter, torch.Tensor))
#: how many torch-function modes are on (bound once: the weight-cast path's one check)
_function_modes = torch._C._len_torch_function_stack


def _cast_for(frame: _Frame, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast ``tensor`` to ``dtype`` for the running call ``frame`` and remember the cast
    (and its version, to find a write the forward makes into it)."""
    low = tensor
    have = tensor.dtype
    if have is not dtype and have in _CASTABLE:
        cast = _CAST_METHODS[dtype]  # (a low dtype: its method, with no to_dtype call)
        if _function_modes() or type(tensor) not in _NO_TORCH_FUNCTION:
            # mixprec's own bookkeeping is not the model's code: no mode need see it
            with torch._C.DisableTorchFunction():
                low = cast(tensor)
        else:  # (no mode on, and a Parameter's torch-function handling is off)
            low = cast(tensor)
    frame.casts[id(tensor)] = _record(tensor, low)
    return low


def _record(tensor: torch.Tensor, low: torch.Tensor) -> _Cast:
    """The record of ``low``, a cast of ``tensor`` the model's code is given now."""
    try:
        version = low._version
    except RuntimeError:  # an inference tensor has no version counter
        version = -1
    if type(low) is not torch.Tensor and isinstance(low, FakeTensor):
        pointer = -1  # (explain's fake tensors: no data, and a warning where it is read)
    else:
        try:
            pointer = low.data_ptr()
        except RuntimeError:  # a functional tensor (export) has no data
            pointer = -1
    return (tensor, low, version, pointer)


def _seen(frame: _Frame, hit: _Cast) -> _Cast:
    """``hit``, a cast of this call, about to be given to the model's code: recorded now
    if only a one-call layer's kernel has taken it so far (:data:`_UNSEEN`)."""
    if hit[2] != _UNSEEN:
        return hit
    cast = frame.casts[id(hit[0])] = _record(hit[0], hit[1])
    return cast


def _kernel_cast(casts: dict[int, _Cast], weight: nn.Parameter, dtype: torch.dtype) -> Any:
    """A Parameter's cast to ``dtype`` for a one-call layer's kernel alone
    (:meth:`ModuleCall._direct`), recorded as :data:`_UNSEEN` in the running call's
    ``casts``: the kernel writes into none of its operands, so until the model's code
    reads the cast (a tied weight, :func:`_seen`) there is nothing to check."""
    low: torch.Tensor = weight
    have = weight.dtype
    if have is not dtype and have in _CASTABLE:
        if _function_modes():  # (a Parameter's own torch-function handling is off)
            with torch._C.DisableTorchFunction():  # (mixprec's casts are not the model's ops)
                low = _CAST_METHODS[dtype](weight)
        else:
            low = _CAST_METHODS[dtype](weight)
    casts[id(weight)] = (weight, low, _UNSEEN, _UNSEEN)
    return low


def _recast(
    frame: _Frame,
    tensor: torch.Tensor,
    old: _Cast,
    dtype: torch.dtype,
) -> torch.Tensor:
    """A fresh cast of ``tensor`` for a use with gradients on, where this call's cast
    ``old`` was made under ``torch.no_grad()`` (no gradient path) or ``inference_mode``
    (cannot be saved for backward): a forward that computes a target under no_grad first,
    or a block run once under a re-entrant checkpoint and once plainly. A write the forward
    made into the old cast goes into ``tensor`` first."""
    with torch._C.DisableTorchFunction():
        _flush(old, frame.listed)
    return _cast_for(frame, tensor, dtype)


class _Spec(NamedTuple):
    """What a compiled call of a :class:`ModuleCall` does."""

    root: bool
    cast: torch.dtype | None  # what floating arguments are cast to (None: as they come)
    output: torch.dtype | None  # what floating outputs are cast to
    #: an island's kernel takes a low input on these device types (a tuple: a constant
    #: TorchDynamo can test membership in, where a set would need a source to guard)
    fused: tuple[str, ...]
    float32: bool  # an outer torch.autocast is off inside
    inner: bool  # the module had an instance forward of its own
    view: bool  # a recurrent layer: it runs on a per-call view (:meth:`ModuleCall._plain`)
    low: torch.dtype  # the conversion's low dtype
    #: the module's class, by its key (:func:`~mixprec.convert.structure.owner`): read
    #: through ``type(module)``, modules of one class would reach it by as many paths,
    #: each pair guarded as aliases; its ``forward`` is read at each call (a class patched
    #: later runs its new forward)
    cls: str
    #: a one-call layer whose weights a compiled call reads as :meth:`ModuleCall._direct`
    #: does (from its ``LowParameters``, with no names kept: not through ``module.weight``,
    #: whose traced lookup TorchDynamo guards step by step, per module), while the module
    #: is of its converted class exactly (the call's ``exact``: FSDP2's ``fully_shard``
    #: and ``register_parametrization`` make other classes over it)
    direct: bool
    #: its own code runs under the mixed-operand rule inside a call (a loss module; one
    #: that held floating buffers at conversion), as :meth:`ModuleCall.call_impl` decides
    mixes: bool
    #: PyTorch's forward of a class with a fused fast path (no mode in its own code)
    fast_path: bool


class _Facts(NamedTuple):
    """What a compiled call of a :class:`ModuleCall` reads of it, as constants (see
    :func:`~mixprec.convert.structure.compiled_facts`)."""

    spec: _Spec
    kind: str  # :class:`ModuleCall`, by its key


class LowParameters(dict[str, Any]):
    """A module's ``_parameters`` that compute in low precision, but those ``kept``.

    Holds the stored Parameters unchanged. Reading one by name (what ``module.weight``
    does) or iterating ``items()`` (what ``module.parameters()`` does) inside a running
    call of the conversion gives its low-precision cast; anywhere else, the Parameter.
    A Parameter registered after conversion computes low too, as its module does.
    """

    def __init__(self, table: dict[str, Any], kept: frozenset[str], state: CastState) -> None:
        super().__init__(table)
        self.kept = kept  # names that stay as stored (an old weight hook's originals)
        self.state = state
        self.dtype = state.dtype
        self.local = state._local
        #: what a compiled read reads it by (see :meth:`facts`)
        self.facts_key = facts_key(self.facts())

    def __getstate__(self) -> dict[str, Any]:
        return {"kept": self.kept, "state": self.state}  # (a thread-local is not copied)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.dtype = self.state.dtype
        self.local = self.state._local
        self.facts_key = facts_key(self.facts())

    def adopt_weight_hooks(self, module: nn.Module) -> None:
        """Keep float32 the originals of the old weight hooks registered on ``module``
        (which holds this table) since conversion (:func:`weight_hooks.adopt`)."""
        kept = weight_hooks.adopt(module, self.dtype, self.kept)
        if kept is not self.kept:
            self.kept = kept
            self.facts_key = facts_key(self.facts())

    def facts(self) -> tuple[tuple[str, ...], torch.dtype]:
        """What a compiled read takes as constants
        (:func:`~mixprec.convert.structure.compiled_facts`): the kept names and the low
        dtype, both fixed when the table is made (read as attributes, each would be
        guarded, per table)."""
        return tuple(sorted(self.kept)), self.dtype

    def __getitem__(self, name: str) -> Any:
        value = dict.__getitem__(self, name)
        if value is None:
            return value
        if _dynamo_compiling():  # (non-strict export: the eager path)
            kept, dtype = compiled_facts(self.facts_key)
            if name in kept or not is_castable(value) or not _COMPILED.in_call:
                return value
            return to_dtype(value, dtype)
        if name in self.kept:
            return value
        frame = self.local.frame
        if not frame.depth:
            return value
        hit = frame.casts.get(id(value))
        if hit is not None and hit[0] is value:
            hit = _seen(frame, hit)
            if hit[1].requires_grad or (not value.requires_grad and hit[2] != -1):
                return hit[1]
            if not torch.is_grad_enabled():  # (a no-grad cast, and no grad wanted now)
                return hit[1]
            return _recast(frame, value, hit, self.dtype)
        return _cast_for(frame, value, self.dtype)

    def items(self) -> Any:
        if _tracing() or self.state.frame() is None:
            return dict.items(self)
        return [(name, self._listed(name)) for name in dict.keys(self)]

    def values(self) -> Any:
        if _tracing() or self.state.frame() is None:
            return dict.values(self)
        return [self._listed(name) for name in dict.keys(self)]

    def _listed(self, name: str) -> Any:
        """``self[name]``, for ``parameters()`` in a running call: a cast is remembered as
        listed (a write into it is a parameter update: see :func:`_flush`)."""
        value = self[name]
        if value is not dict.__getitem__(self, name):
            self.local.frame.listed.add(id(value))
        return value

    def stored(self) -> Iterator[tuple[str, Any]]:
        """``(name, stored tensor)`` for the low-precision names (never cast)."""
        for name, value in dict.items(self):
            if name not in self.kept and value is not None and is_castable(value):
                yield name, value


#: Layers whose forward is one call of their weights (see :meth:`ModuleCall._direct`); a
#: LayerNorm takes it where it computes low (O3, or a low pin), never as a float32 island.
_ONE_CALL: frozenset[type[nn.Module]] = frozenset(
    (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.LayerNorm, nn.Embedding)
)

#: Their forwards as PyTorch wrote them (what a compiled call compares the class's with)
_TORCH_FORWARDS = {cls: cls.forward for cls in _ONE_CALL}

#: Tensor types an island takes on its fast path (plain tensors: no rules of their own).
_TENSOR_TYPES = frozenset((torch.Tensor, nn.Parameter))

_FOLLOW, _LOWER, _LOSS = 0, 1, 2

#: a name a module's ``_parameters`` does not hold (``dict.get``'s default)
_ABSENT: Any = object()


def _kind(func: Callable[..., Any]) -> int:
    """What :class:`MixedOperands` does with a call of ``func``."""
    name = op_name(func)
    if name in _LOWER_OPS:
        return _LOWER
    return _LOSS if name in _LOSSES else _FOLLOW


@torch.compiler.assume_constant_result
def _traced_kind(func: Callable[..., Any]) -> int:
    """:func:`_kind` under ``torch.compile``, answered while TorchDynamo traces (no
    cache read in the traced code, whose contents it would guard)."""
    return _kind(func)


class MixedOperands(TorchFunctionMode):
    """autocast's rule for operands a model mixes: an op on autocast's lower-precision
    list whose floating operands mix float32 with ``dtype`` runs in ``dtype``; all-float32
    operands stay float32 (math the model chose to do in float32); other ops follow
    PyTorch's type promotion. A loss function (``cross_entropy``, ``mse_loss``, ...) with
    a ``dtype`` operand runs in float32, as the training step computes a loss."""

    def __init__(self, dtype: torch.dtype, traced: bool = False) -> None:
        super().__init__()
        self.dtype = dtype
        # torch function -> _FOLLOW, _LOWER or _LOSS; None in the mode a compiled call
        # enters, which answers at trace time (no cache whose contents TorchDynamo would
        # guard). Not ``torch.compiler.is_compiling()`` here: called in a mode's
        # ``__torch_function__`` it breaks a module built in the traced code (torch 2.13:
        # ``tensor.dim()`` in ``nn.Linear``'s initialisation returns None).
        self._kinds: dict[Any, int] | None = None if traced else {}

    def again(self) -> MixedOperands:
        """A mode of the same dtype, made traced (a traced body's: see
        :func:`~mixprec.policy.ops.under`)."""
        return MixedOperands(self.dtype, traced=True)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kinds = self._kinds
        if kinds is None:
            kind = _traced_kind(func)
        elif func in kinds:
            kind = kinds[func]
        else:
            kind = kinds[func] = _kind(func)
        if kind == _FOLLOW:
            if kinds is None and type(func) in HIGHER_ORDER and args:  # (traced only)
                args = held_under(self, args)
            return func(*args, **kwargs) if kwargs else func(*args)
        if kwargs is None:
            kwargs = {}
        if kind == _LOWER:
            if self._mixed(args, kwargs) and only_plain_tensors(args, kwargs):
                args, kwargs = cast_tree((args, kwargs), self.dtype)
        elif self._has_low(args, kwargs) and only_plain_tensors(args, kwargs):  # a loss
            args, kwargs = cast_tree((args, kwargs), torch.float32)
        return func(*args, **kwargs)

    def _has_low(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        return any(
            isinstance(leaf, torch.Tensor) and leaf.dtype == self.dtype
            for value in (*args, *kwargs.values())
            for leaf in (value if isinstance(value, (list, tuple)) else (value,))
        )

    def _mixed(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        low = wide = False
        for value in (*args, *kwargs.values()):
            for leaf in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(leaf, torch.Tensor) and is_castable(leaf):
                    if leaf.dtype == self.dtype:
                        low = True
                    else:
                        wide = True
        return low and wide


def settled(values: Any, dtype: torch.dtype) -> bool:
    """No value needs a cast to ``dtype`` (checked without walking containers)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.dtype != dtype and is_castable(value):
                return False
        elif not isinstance(value, (int, float, bool, str, type(None))):
            return False  # a container: let cast_tree look inside
    return True


def cast_args(
    args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with every floating tensor in them cast to ``dtype``
    (containers included); the same objects when nothing needs a cast, and each argument
    that holds nothing to cast (a list the forward appends to, a dict it fills) the same
    object in any case."""
    with torch._C.DisableTorchFunction():  # mixprec's casts are not the model's ops
        if settled(args, dtype) and (not kwargs or settled(kwargs.values(), dtype)):
            return args, kwargs  # the common case: nothing to cast, no tree walk
        cast_pos, cast_kwargs = cast_tree((args, kwargs), dtype)  # (aliases stay aliases)
        cast_pos = tuple(_kept_if_settled(a, c, dtype) for a, c in zip(args, cast_pos, strict=True))
        cast_kwargs = {k: _kept_if_settled(kwargs[k], c, dtype) for k, c in cast_kwargs.items()}
    return cast_pos, cast_kwargs


def cast_pairs(given: Any, cast: Any) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """The tensors of ``given`` (a call's arguments) that ``cast`` (their copy from
    :func:`cast_args`) holds casts of, each with its cast's version counter now: a write the
    call makes into one of those casts goes back into the caller's tensor after the call
    (:func:`written_back`), as it would without the cast. (Inference tensors, which have no
    version counter, are left out.)"""
    pairs = []
    for leaf, low in zip(pytree.tree_leaves(given), pytree.tree_leaves(cast), strict=False):
        if low is not leaf and isinstance(leaf, torch.Tensor) and isinstance(low, torch.Tensor):
            version = _version(low)
            if version != -1:
                pairs.append((leaf, low, version))
    return pairs


def written_back(pairs: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
    """Each write a call made into a cast of :func:`cast_pairs`, made into its source."""
    for leaf, low, version in pairs:
        if low._version != version:
            write_back(leaf, low)


def _kept_if_settled(given: Any, cast: Any, dtype: torch.dtype) -> Any:
    """``given``, an argument of :func:`cast_args`, where it is a container that holds no
    tensor to cast (its rebuilt copy ``cast`` would lose what the forward writes into it);
    else ``cast``."""
    if cast is given or isinstance(given, torch.Tensor):
        return cast
    for leaf in pytree.tree_leaves(given):
        if isinstance(leaf, torch.Tensor):
            if leaf.dtype != dtype and is_castable(leaf):
                return cast
        elif dataclasses.is_dataclass(leaf):  # (cast_tree looks inside it)
            return cast
    return given


#: PyTorch's modules whose ``forward`` takes a fused fast path (``nn.TransformerEncoder``'s
#: nested tensors, zeros at padded positions) only when no torch-function mode is active
_FAST_PATH_MODULES: tuple[type[nn.Module], ...] = (
    nn.TransformerEncoder,
    nn.TransformerEncoderLayer,
    nn.MultiheadAttention,
)


def has_fast_path(module: nn.Module) -> bool:
    """``module`` runs PyTorch's own ``forward`` of a class with a fused fast path (whose
    kernels take its children's weights: it casts its floating inputs as a layer does)."""
    return "forward" not in module.__dict__ and any(
        type(module).forward is cls.forward for cls in _FAST_PATH_MODULES
    )


#: Norms whose kernel takes a low-precision input with float32 weights and statistics,
#: computes in float32 and returns the input's dtype, on these device types: the same
#: bits as casting the input up, computing in float32 and casting the output down (what a
#: float32 island does), with no cast kernels. (CUDA's layer and group norms require one
#: dtype: there an island casts.)
_FUSED_ISLANDS: dict[Callable[..., Any], frozenset[str]] = {
    nn.modules.batchnorm._BatchNorm.forward: frozenset({"cpu", "cuda"}),
    nn.LayerNorm.forward: frozenset({"cpu"}),
    nn.GroupNorm.forward: frozenset({"cpu"}),
    nn.modules.instancenorm._InstanceNorm.forward: frozenset({"cpu"}),
}


def fused_island(module: nn.Module) -> frozenset[str]:
    """The device types on which ``module``, a float32 island in low-precision code, runs
    as one kernel on its low-precision input (none: it casts its input and output)."""
    if "forward" in module.__dict__:
        return frozenset()
    return _FUSED_ISLANDS.get(type(module).forward, frozenset())


def _outer_autocast() -> bool:
    """Whether a ``torch.autocast`` is on around the call (a float32 island turns it off)."""
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


def _floating(buffers: dict[str, Any]) -> bool:
    """Whether a module holds a floating buffer (a float32 operand its code may mix)."""
    if not buffers:
        return False
    with torch._C.DisableTorchFunction():
        return any(is_castable(value) for value in buffers.values())


#: Words in PyTorch's errors for operands of different dtypes.
_DTYPE_ERRORS = ("dtype", "scalar type", "type (", "same type")
_MIXED_NOTE = (
    "mixprec: if this op mixed a float32 tensor the model made (torch.ones, .float(), a "
    "float32 mask) with {dtype} activations, cast it with .to(x.dtype) where it is made, or "
    "pin its module to float32 (fp32_modules=...). The mixed-operand rule (autocast's, for "
    "matmul, linear, conv, ... and losses) applies in the code of the model's entry module, "
    "of loss modules and of modules that hold floating buffers."
)


def _explain_mixed(error: RuntimeError, dtype: torch.dtype, entry: nn.Module) -> None:
    """Add a note to a dtype error raised inside a converted model (once); name the
    modules added after conversion without registration, which were not converted
    (``Sequential.insert``: they run on float32 weights; see :func:`_registered`)."""
    message = str(error)
    note = _MIXED_NOTE.format(dtype=str(dtype).removeprefix("torch."))
    if any(word in message for word in _DTYPE_ERRORS) and note not in getattr(
        error, "__notes__", ()
    ):
        added = [
            name or "(the entry)"
            for name, module in entry.named_modules()
            if not isinstance(forward_of(module), ModuleCall)
            and type(module).__name__ != "OptimizedModule"  # (left as it is: see _Walk)
        ]
        if added:
            note = (
                f"mixprec: these modules were added after conversion and run unconverted, on "
                f"float32 weights: {', '.join(added[:8])}{' ...' if len(added) > 8 else ''}; "
                "convert the changed model again (auto_mixed_precision on the original, "
                "changed the same way)"
            )
        error.add_note(note)


def _cast_top(value: Any, dtype: torch.dtype, casts: dict[int, torch.Tensor]) -> Any:
    """``value`` cast to ``dtype`` when it is a floating tensor (once: ``casts`` holds the
    casts made so far, so ``model(x, x, x)`` passes one tensor three times); anything else
    as it is."""
    if isinstance(value, torch.Tensor) and value.dtype != dtype and is_castable(value):
        if torch.compiler.is_compiling():  # (the compiler would guard on the id)
            return value.to(dtype)
        cast = casts.get(id(value))
        if cast is None:
            cast = casts[id(value)] = to_dtype(value, dtype)
        return cast
    return value


class _CompiledState:
    """Whether a converted call is running, for compiled code: ``in_call``, set by
    :func:`_compiled_call` around the module's forward and read by a ``LowParameters``
    read under ``torch.compile`` (a weight is its low-precision cast inside a converted
    call only, as its eager read tells from the call's thread-local state).

    A plain attribute of a global object, which TorchDynamo traces as it traces any
    Python: a write is a side effect it applies where the compiled code hands back to
    Python (a graph break, the end of the frame), and drops with a trace it restarts; a
    read inside one graph sees the writes before it, a read at its start is guarded (one
    guard). So a read between a call's entry and its exit casts, across graph breaks too,
    and one anywhere else does not: ``torch.func.functional_call`` saving and restoring the
    Parameters around the call, a regulariser reading a weight next to the call."""

    def __init__(self) -> None:
        self.in_call = False  # (an instance attribute: read through the object's dict)
        #: whether the conversion's mode (:class:`MixedOperands`) is on in the code
        #: running now (compiled, it is pushed and set aside as eagerly: _compiled_call)
        self.mixing = False


_COMPILED = _CompiledState()


def _compiled_call(
    module: nn.Module,
    facts: _Facts,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    hooked: bool,
    call: ModuleCall | None,
    exact: bool,
) -> Any:
    """A :class:`ModuleCall` under ``torch.compile``: the casts inside the graph, no
    thread-local state and no mode (weights are cast at each read, inside the graph).

    It reads nothing of the ``ModuleCall`` but its ``facts`` (each attribute read, and
    each second path to an object, would add a guard checked at every call); the module
    is the caller's. A float32 island under an outer autocast, a module with a
    ``forward`` of its own and a recurrent layer read the ``ModuleCall`` by its key. A one-call layer's
    weights are read from its ``LowParameters`` as :meth:`ModuleCall._direct` reads them:
    through ``module.weight`` TorchDynamo would trace ``nn.Module.__getattr__`` and the
    table's ``__getitem__``, guarding each step, per module."""
    spec = facts.spec
    if not hooked and ("forward" in module.__dict__ or hooked_compiled(module)):
        return nn.Module._call_impl(module, *args, **kwargs)
    if spec.root and spec.cast is not None and not spec.view:
        dtype = spec.cast
        args = tuple(_cast_top(v, dtype, {}) for v in args)
        kwargs = {k: _cast_top(v, dtype, {}) for k, v in kwargs.items()}
    elif spec.cast is not None and not (
        spec.fused and _takes_low(args, kwargs, spec.fused, spec.low)
    ):
        dtype = spec.cast
        if kwargs or not all(isinstance(v, torch.Tensor) for v in args):
            args, kwargs = cast_tree((args, kwargs), dtype)
        else:  # (no tree walk: TorchDynamo would guard each step of it)
            args = tuple(_cast_top(v, dtype, {}) for v in args)
    before = _COMPILED.in_call
    active = _COMPILED.mixing if before else False  # (outside every call: no mode)
    # the mixed-operand rule in the module's own code where its eager call has it: the
    # entry's (the root, a submodule called directly; not a fused fast path's, which any
    # mode turns off), a loss module's and a floating-buffer holder's (call_impl's rule)
    mixing = spec.mixes if before else not spec.fast_path
    _COMPILED.in_call = True
    _COMPILED.mixing = mixing
    try:
        if mixing is active:
            out = _compiled_body(module, spec, args, kwargs, call, exact)
        elif mixing:
            with MixedOperands(spec.low, traced=True):
                out = _compiled_body(module, spec, args, kwargs, call, exact)
        else:
            out = _set_aside(module, spec, args, kwargs, call, exact)
    finally:
        _COMPILED.in_call = before
        _COMPILED.mixing = active
    return out if spec.output is None else cast_compiled(out, spec.output)


def _set_aside(
    module: nn.Module,
    spec: _Spec,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    call: ModuleCall | None,
    exact: bool,
) -> Any:
    """:func:`_compiled_body` with the conversion's mode, on top of the torch-function
    mode stack, set aside (as :meth:`ModuleCall._moded` sets it aside eagerly; another
    mode above it, the model's own, is left be)."""
    depth = torch._C._len_torch_function_stack()
    if not depth or not isinstance(torch._C._get_function_stack_at(depth - 1), MixedOperands):
        return _compiled_body(module, spec, args, kwargs, call, exact)
    mode = torch._C._pop_torch_function_stack()
    try:
        return _compiled_body(module, spec, args, kwargs, call, exact)
    finally:
        torch._C._push_on_torch_function_stack(mode)


def _compiled_body(
    module: nn.Module,
    spec: _Spec,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    call: ModuleCall | None,
    exact: bool,
) -> Any:
    """A compiled call's own code, on its cast arguments (:func:`_compiled_call`)."""
    if spec.float32 and _outer_autocast():
        return _without_autocast(_called(module, call), args, kwargs)
    if spec.inner or spec.view:  # (a view: its flat weights are set on a per-call view)
        return _called(module, call)._plain(args, kwargs)
    cls = owner(spec.cls)
    forward = cls.forward  # (guarded once per class: a class patched later retraces)
    if cls is nn.Embedding and _renorms(module, cls, forward):
        lookup = args[0] if args else kwargs["input"]
        return _renormed_lookup(module, lookup, spec.low if _COMPILED.in_call else None)
    if spec.direct and len(args) == 1 and not kwargs and forward is _TORCH_FORWARDS[cls] and exact:
        # (its forward's one call; ``_parameters`` as an attribute, not through
        # ``module.__dict__``: a guard-tree node per module, see ``_converted_call``)
        params: dict[str, Any] = module._parameters
        weight = dict.__getitem__(params, "weight")
        bias = dict.get(params, "bias")
        return _one_call(
            cls,
            module,
            args[0],
            to_dtype(weight, spec.low),
            None if bias is None else to_dtype(bias, spec.low),
        )
    return forward(module, *args, **kwargs)


def _called(module: nn.Module, call: ModuleCall | None) -> ModuleCall:
    """Under ``torch.compile``: the ``ModuleCall`` a call runs (``call``, else the
    module's own), where a call needs more of it than its facts."""
    return forward_of(module) if call is None else call


def _renorms(module: nn.Module, cls: type[nn.Module], forward: Any) -> bool:
    """Whether a call of ``module`` (of class ``cls``, whose ``forward`` is ``forward``)
    is an ``nn.Embedding`` lookup with ``max_norm`` whose weight reads low: its rows are
    renormalised in the stored weight before the cast (:func:`_renormed_lookup`)."""
    return (
        cls is nn.Embedding
        and getattr(module, "max_norm", None) is not None
        and forward is _TORCH_FORWARDS.get(cls)
        and type(params := module._parameters) is LowParameters
        and "weight" not in params.kept
    )


def _renormed_lookup(
    module: Any, x: torch.Tensor, dtype: torch.dtype | None, frame: _Frame | None = None
) -> Any:
    """An ``nn.Embedding`` lookup with ``max_norm`` in a converted call, whatever the path
    to it (a keyword argument, a hook, the root, a weight a call has cast already): the
    rows renormalised in the stored float32 weight (:func:`_renorm`), then looked up in a
    cast of it made now (``dtype``; None: the weight as it is), with no ``max_norm`` of
    its own (:func:`_one_call`). Eagerly (``frame``) the cast is the call's: one made
    before the renorm (a tied head read the weight first) is made again, so every read
    after it sees the renormalised rows, as the original's reads do."""
    stored = dict.__getitem__(module._parameters, "weight")
    _renorm(module, x, stored)
    if dtype is None or stored.dtype == dtype:
        weight = stored
    elif frame is None:  # (compiled: a read casts afresh)
        weight = to_dtype(stored, dtype)
    else:
        hit = frame.casts.get(id(stored))
        if hit is not None and hit[0] is stored:
            weight = _recast(frame, stored, hit, dtype)
        else:
            weight = _cast_for(frame, stored, dtype)
    return _one_call(nn.Embedding, module, x, weight, None)


def _renorm(module: Any, x: torch.Tensor, weight: torch.Tensor) -> None:
    """What ``F.embedding`` does first for an ``nn.Embedding`` with ``max_norm``: the rows
    ``x`` looks up renormalised in place, in the stored float32 weight (the original's
    update, bit for bit), before the weight is cast; the call then looks the cast up with
    no ``max_norm`` of its own (:func:`_one_call`)."""
    torch.embedding_renorm_(weight.detach(), x.contiguous(), module.max_norm, module.norm_type)


def _one_call(
    cls: type[nn.Module],
    module: Any,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> Any:
    """The one call of a one-call layer of class ``cls`` (its ``forward``'s, on the
    weights given): its class's attributes read as its forward reads them."""
    if cls is nn.Linear:
        return F.linear(x, weight, bias)
    if cls is nn.LayerNorm:
        return F.layer_norm(x, module.normalized_shape, weight, bias, module.eps)
    if cls is nn.Embedding:
        return F.embedding(
            x,
            weight,
            module.padding_idx,
            None,  # (renormalised before the cast: _renorm)
            module.norm_type,
            module.scale_grad_by_freq,
            module.sparse,
        )
    return module._conv_forward(x, weight, bias)


def _without_autocast(call: ModuleCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A float32 island's forward with every outer ``torch.autocast`` turned off."""
    with contextlib.ExitStack() as stack:
        for device in _AUTOCAST_DEVICES:
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        return call._plain(args, kwargs)


def _takes_low(
    args: tuple[Any, ...], kwargs: dict[str, Any], fused: Collection[str], dtype: torch.dtype
) -> bool:
    """Whether an island's kernel takes ``args`` as they are: one tensor of the low dtype
    on a device type in ``fused`` (strided, not nested), with no outer autocast."""
    if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
        return False
    with torch._C.DisableTorchFunction():  # (a tensor's properties are torch functions)
        return _is_low_on(args[0], fused, dtype) and not _outer_autocast()


def _is_low_on(x: torch.Tensor, fused: Collection[str], dtype: torch.dtype) -> bool:
    """``x`` is a strided, non-nested tensor of ``dtype`` on a device type in ``fused``."""
    return (
        x.dtype is dtype
        and ((x.is_cpu and "cpu" in fused) or (x.is_cuda and "cuda" in fused))
        and x.layout is torch.strided
        and not x.is_nested
    )


class ModuleCall:
    """The instance ``forward`` of every module of a conversion.

    Runs the module's own ``forward`` (the instance's, if it had one, else its class's)
    as a running call of the conversion. Inside a running call (the common case: a
    submodule called by its parent) that costs one thread-local read, plus, for a
    low-precision module with weights, the cast of its floating inputs down (``dtype``;
    no-op checks when they already are). The root (and any module called from
    outside a running call) enters the call; the root also casts its floating tensor
    arguments to the low dtype and floating outputs to ``output_dtype``. Recurrent layers
    run on a per-call view whose flat weights are the casts, so the shared module is never
    written.
    """

    #: it holds the module it was made for: ``nn.DataParallel``'s replicas are refused
    #: (:func:`~mixprec.convert.structure._converted_replicate`)
    binds_its_module = True

    def __init__(
        self,
        module: nn.Module,
        state: CastState,
        *,
        root: bool = False,
        output_dtype: torch.dtype | None = None,
        float32: bool = False,
        dtype: torch.dtype | None = None,
        fused: frozenset[str] = frozenset(),
        mixed_kernel: bool = False,
        path: str = "",
    ) -> None:
        _watch_registrations()
        self.module = module
        self.path = path  # its qualified name in the converted model (for a pin by name)
        self.key = register(module)  # (what a compiled call reads it by: see _compiled_call)
        self.forward_key = register(self)  # (see structure.compiled_facts)
        self.state = state
        self.local = state._local
        self.root = root
        #: what the root casts floating inputs to: float32 for a root pinned to float32
        self.input_dtype = torch.float32 if float32 else state.dtype
        self.output_dtype = output_dtype
        self.float32 = float32  # a float32 island: an outer torch.autocast is off inside
        self.dtype = dtype  # what floating inputs are cast to (None: taken as they come)
        #: a float32 island's kernel takes its low input as it is on these device types
        self.fused = fused
        #: a module computing in another dtype than its parent: it casts its floating
        #: inputs to ``dtype`` and its floating outputs back to ``output_dtype``
        self.island = not root and dtype is not None and output_dtype is not None
        self.inner: Callable[..., Any] | None = module.__dict__.get("forward")
        #: a loss module: its own code runs under the mixed-operand rule (a loss in float32)
        #: (or a fused-kernel module whose children compute in two dtypes, which its kernel
        #: cannot take: the mode makes it take its standard path)
        self.loss = isinstance(module, nn.modules.loss._Loss) or mixed_kernel
        #: a parametrization (its output: the value of a parametrized tensor)
        self.parametrization = isinstance(module, parametrize.ParametrizationList)
        #: a call that needs more than the fast path when it runs inside a running call
        self.special = isinstance(module, nn.RNNBase)
        #: whether a call inside a running call takes the hot path (not the root's)
        self.nested = not root and not self.special
        #: PyTorch's own forward of a class with a fused fast path, which any active
        #: torch-function mode turns off: it runs with the conversion's mode set aside
        self.fast_path = has_fast_path(module) and not mixed_kernel
        #: whether its floating buffers may meet low activations in its own code (a
        #: float32 island computes in float32; a norm's kernel takes float32 statistics)
        self.buffers_mix = not float32 and not isinstance(module, lists.FP32_STATE_MODULES)
        #: an ``nn.Linear``, ``nn.Conv1d/2d/3d``, low ``nn.LayerNorm`` or ``nn.Embedding``
        #: running its class's forward (one call,
        #: which :meth:`_direct` makes): ``(class, its forward)``, checked at each call
        cls = self.cls = user_class(module)
        self.direct = (
            (cls, cls.forward)
            if cls in _ONE_CALL
            and torch_forward(cls)
            and self.inner is None
            and dtype is not None
            and not float32
            else None
        )

    def _spec(self) -> _Spec:
        return _Spec(
            root=self.root,
            cast=self.input_dtype if self.root else self.dtype,
            output=self.output_dtype,
            fused=tuple(sorted(self.fused)),
            float32=self.float32,
            inner=self.inner is not None,
            view=self.special,
            low=self.state.dtype,
            cls=register(self.cls),
            direct=self._direct_table() is not None,
            mixes=not self.island
            and (self.loss or (self.buffers_mix and _floating(self.module._buffers))),
            fast_path=self.fast_path,
        )

    def _direct_table(self) -> LowParameters | None:
        """The module's ``LowParameters`` where its one call can be made here: a one-call
        layer of the class it had at conversion, with that class's ``forward``, its
        weights in a table of this conversion with no names kept."""
        if self.direct is None:
            return None
        cls, forward = self.direct
        params = self.module.__dict__.get("_parameters")
        if (
            not (type(self.module) is cls or is_converted_exactly(self.module))
            or cls.forward is not forward
            or type(params) is not LowParameters
            or params.kept
            or params.state is not self.state
        ):
            return None
        return params

    def facts(self) -> _Facts:
        """What a compiled call reads of it (see :func:`_compiled_call`)."""
        return _Facts(self._spec(), register(ModuleCall))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["local"]  # a thread-local cannot be copied: the copy's state has its own
        del state["key"], state["forward_key"]  # (this process's table)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        _watch_registrations()
        self.__dict__.update(state)
        self.key, self.forward_key = register(self.module), register(self)
        self.local = self.state._local
        restore_key(self.module, self)

    @staticmethod
    def compiled_call(
        module: nn.Module,
        facts: _Facts,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        hooked: bool,
        call: ModuleCall | None,
        exact: bool,
    ) -> Any:
        """Under TorchDynamo (``torch.compile``, strict ``torch.export``):
        :func:`_compiled_call`. ``exact``: the module is of its converted class exactly,
        whose key is its own (:func:`~mixprec.convert.structure.converted_class`)."""
        return _compiled_call(module, facts, args, kwargs, hooked, call, exact)

    @property
    def __signature__(self) -> inspect.Signature:
        """The wrapped forward's signature (what ``inspect``, ``generate()``'s argument
        checks and ``torch.export`` see)."""
        inner = self.inner or functools.partial(self.cls.forward, self.module)
        return inspect.signature(inner)

    @property
    def __code__(self) -> types.CodeType:
        """The wrapped forward's code object (``torch.export`` reads its name and place)."""
        code = getattr(self.inner or self.cls.forward, "__code__", None)
        return code if isinstance(code, types.CodeType) else type(self).__call__.__code__

    @eager_call
    def call_impl(self, module: nn.Module, /, *args: Any, **kwargs: Any) -> Any:
        """A call of ``module`` (what its converted class's ``__call__`` calls): with no
        hooks on the module (nor global module hooks, nor a TorchScript trace running)
        and no ``forward`` set on its instance since, it does the forward's work itself,
        one Python frame where ``nn.Module`` takes two; otherwise ``nn.Module._call_impl``
        runs the hooks around the module's ``forward``."""
        # (through a keyword, not a default: TorchDynamo guards a default it reads)
        hooked = kwargs.pop("_mixprec_hooked", False) if kwargs else False
        if not hooked:
            slots = module.__dict__  # (structure.takes_hook_path, inline: the hot call)
            if (
                slots["_forward_pre_hooks"]
                or slots["_forward_hooks"]
                or slots["_backward_pre_hooks"]
                or slots["_backward_hooks"]
                or _global_forward_pre_hooks
                or _global_forward_hooks
                or _global_backward_pre_hooks
                or _global_backward_hooks
                or "forward" in slots
                or torch._C._get_tracing_state()
            ):
                if slots["_forward_pre_hooks"] and type(slots["_parameters"]) is LowParameters:
                    slots["_parameters"].adopt_weight_hooks(module)  # (an old weight hook)
                return nn.Module._call_impl(module, *args, **kwargs)
        if self.nested:
            frame = self.local.frame
            if frame.depth and not (self.float32 and torch._C._is_any_autocast_enabled()):
                # a submodule called by its parent: the hot path
                dtype = self.dtype
                pairs = None  # the casts of its arguments, when it made any
                if dtype is not None:
                    if self.island:  # (its caller under the mode: set aside for the island)
                        if frame.active:
                            return self._moded(frame, False, args, kwargs, self._island_body)
                        return self._island_body(args, kwargs)
                    if (
                        kwargs
                        or len(args) != 1
                        or frame.active
                        or type(first := args[0]) is not torch.Tensor
                        or (first.dtype is not dtype and first.dtype in _CASTABLE)
                    ):
                        cast_pos, cast_kwargs = cast_args(args, kwargs, dtype)
                        if cast_pos is not args or cast_kwargs is not kwargs:
                            pairs = cast_pairs((args, kwargs), (cast_pos, cast_kwargs))
                        args, kwargs = cast_pos, cast_kwargs
                if self.loss or (
                    self.buffers_mix and module._buffers and _floating(module._buffers)
                ):
                    moded = not frame.active  # (its own code under the mode)
                else:
                    moded = frame.active  # (the mode set aside for its own code)
                if moded:
                    out = self._moded(frame, not frame.active, args, kwargs, self._code)
                elif self.direct is not None:  # (:meth:`_code`, inline: the hot call)
                    if (
                        len(args) != 1
                        or kwargs
                        or (out := self._direct(module, frame, args[0])) is NotImplemented
                    ):
                        out = self._plain(args, kwargs)
                elif self.inner is not None:
                    out = self.inner(*args, **kwargs)
                else:
                    out = self.cls.forward(module, *args, **kwargs)
                if pairs:  # a write into a cast argument goes back to the caller's tensor
                    written_back(pairs)
                return out
        return self._enter(args, kwargs)

    def _code(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The module's own code inside a running call: a one-call layer's call
        (:meth:`_direct`) where it applies, else its forward (:meth:`_plain`)."""
        if self.direct is not None and len(args) == 1 and not kwargs:
            out = self._direct(self.module, self.local.frame, args[0])
            if out is not NotImplemented:
                return out
        return self._plain(args, kwargs)

    def _direct(self, module: nn.Module, frame: _Frame, x: Any) -> Any:
        """A one-call layer's forward (``F.linear``, ``_conv_forward``, ``F.layer_norm``,
        ``F.embedding``) inside a running call, its weight and bias read as its own
        ``self.weight`` and ``self.bias`` would read them (cast once per call), with no
        frame for the forward and none for each read: the same casts, the same call, the
        same result. NotImplemented where its forward decides (its class or the class's
        ``forward`` changed since conversion, a weight not in its ``_parameters``: a
        parametrization; names kept as stored, a tensor subclass, no affine weight, a
        weight this call has read already)."""
        cls, forward = self.direct  # type: ignore[misc]
        params = module.__dict__["_parameters"]
        kind = type(module)
        if (
            kind._mixprec_exact is not kind  # type: ignore[attr-defined]  # (is_converted_exactly)
            or cls.forward is not forward
            or type(params) is not LowParameters
            or params.kept
            or params.state is not self.state
            or type(x) is not torch.Tensor
        ):
            return NotImplemented
        # (``dict.get``: the stored tensors, as ``dict.__getitem__`` reads them)
        weight = params.get("weight", _ABSENT)
        if cls is nn.Embedding:  # (its one Parameter: no bias)
            if weight is _ABSENT:
                return NotImplemented
            if module.max_norm is not None:  # (renormalised, then cast)
                return _renormed_lookup(module, x, self.state.dtype, frame)
            bias = None
        else:
            bias = params.get("bias", _ABSENT)
        casts = frame.casts
        if (
            type(weight) is not nn.Parameter
            or id(weight) in casts
            or (bias is not None and (type(bias) is not nn.Parameter or id(bias) in casts))
        ):
            return NotImplemented  # (LowParameters.__getitem__ decides: a tied weight)
        dtype = self.state.dtype
        weight = _kernel_cast(casts, weight, dtype)
        if bias is not None:
            bias = _kernel_cast(casts, bias, dtype)
        if cls is nn.Linear:  # (the common case, inline)
            return F.linear(x, weight, bias)
        return _one_call(cls, module, x, weight, bias)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The instance ``forward`` (what ``nn.Module._call_impl`` calls after the hooks,
        and what ``module.forward(...)`` calls)."""
        if _dynamo_compiling():
            facts = forward_facts(self.forward_key)
            return self.compiled_call(self.module, facts, args, kwargs, True, self, False)
        return self.call_impl(self.module, *args, _mixprec_hooked=True, **kwargs)

    def _island_body(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An island inside a running call (with no outer autocast, which the hot path
        checked, and the mode set aside): its inputs cast to its dtype (or, for a norm
        whose kernel computes in float32 from a low input, taken as they are), its own
        code run, its outputs cast back."""
        fused = self.fused
        if (
            fused
            and not kwargs
            and len(args) == 1
            and isinstance(args[0], torch.Tensor)
            and _is_low_on(args[0], fused, self.state.dtype)
        ):
            # the kernel takes the low input as it is (an island is never recurrent:
            # those take the full path)
            if self.inner is not None:
                return self.inner(*args)
            return self.cls.forward(self.module, *args)
        if not kwargs and len(args) == 1 and type(args[0]) in _TENSOR_TYPES:
            out = self._one_tensor(args[0])  # a norm's call: no tree to walk
        else:
            cast_pos, cast_kwargs = cast_args(args, kwargs, self.dtype)  # type: ignore[arg-type]
            out = self._plain(cast_pos, cast_kwargs)
            if cast_pos is not args or cast_kwargs is not kwargs:
                written_back(cast_pairs((args, kwargs), (cast_pos, cast_kwargs)))
        if self.output_dtype is None:
            return out
        with torch._C.DisableTorchFunction():
            return cast_tree(out, self.output_dtype)

    def _one_tensor(self, given: torch.Tensor) -> Any:
        """:meth:`_island_body`'s own code run on one tensor argument, cast to the
        island's dtype (what :func:`cast_args` and :func:`cast_pairs` make of it, without
        their tree walks): a write into the cast goes back into ``given``."""
        dtype = self.dtype
        if given.dtype == dtype or not is_castable(given):
            return self._plain((given,), {})
        with torch._C.DisableTorchFunction():  # mixprec's casts are not the model's ops
            cast = to_dtype(given, dtype)  # type: ignore[arg-type]
        version = _version(cast)
        out = self._plain((cast,), {})
        if version != -1 and cast._version != version:
            write_back(given, cast)
        return out

    def _fused(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether this island's kernel takes ``args`` as they are."""
        return bool(self.fused) and _takes_low(args, kwargs, self.fused, self.state.dtype)

    def _moded(
        self,
        frame: _Frame,
        on: bool,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        run: Callable[[tuple[Any, ...], dict[str, Any]], Any] | None = None,
    ) -> Any:
        """Run the module's own code (``run``, by default :meth:`_plain`) with the
        conversion's :class:`MixedOperands` mode on (``on``) or off, and put it back as
        it was."""
        run = run or self._plain
        mode = frame.mode
        if not on:
            depth = torch._C._len_torch_function_stack()
            if not depth or torch._C._get_function_stack_at(depth - 1) is not mode:
                return run(args, kwargs)  # another mode above it: leave the stack be
            torch._C._pop_torch_function_stack()
        else:
            torch._C._push_on_torch_function_stack(mode)
        frame.active = on
        try:
            return run(args, kwargs)
        finally:
            if on:
                torch._C._pop_torch_function_stack()
            else:
                torch._C._push_on_torch_function_stack(mode)
            frame.active = not on

    def _enter(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call that enters the conversion (the root, or a module called directly),
        or one that needs more than the hot path (a float32 island, a recurrent layer)."""
        if self.parametrization and self.state.frame() is None:
            # a parametrized weight read outside any call: float32, as a stored weight
            # reads there (what ``remove_parametrizations`` writes back to the original)
            return self._plain(args, kwargs)
        given: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (see cast_pairs)
        # (a recurrent root is the layer that uses what its containers hold, ``(h0, c0)``
        # or a ``PackedSequence``: its arguments are cast as a nested layer's are)
        dtype = self.input_dtype if self.root else self.dtype
        if dtype is not None and self.root and not self.special:
            casts: dict[int, torch.Tensor] = {}
            cast_pos = tuple(_cast_top(value, dtype, casts) for value in args)
            cast_kwargs = {name: _cast_top(v, dtype, casts) for name, v in kwargs.items()}
            if not _tracing():  # (it casts top-level tensors only: no tree to walk)
                given = [
                    (leaf, cast, version)
                    for leaf, cast in zip(
                        (*args, *kwargs.values()),
                        (*cast_pos, *cast_kwargs.values()),
                        strict=True,
                    )
                    if cast is not leaf and (version := _version(cast)) != -1
                ]
            args, kwargs = cast_pos, cast_kwargs
        elif dtype is not None and not self._fused(args, kwargs):
            if torch.compiler.is_compiling():  # no torch-function state inside a graph
                args, kwargs = cast_tree((args, kwargs), dtype)
            else:
                cast_pos, cast_kwargs = cast_args(args, kwargs, dtype)
                if cast_pos is not args or cast_kwargs is not kwargs:
                    given = cast_pairs((args, kwargs), (cast_pos, cast_kwargs))
                args, kwargs = cast_pos, cast_kwargs
        if _tracing():
            out = self._run(args, kwargs)
        else:
            direct = self.state.on_direct_call
            if direct is not None and not self.root and self.state.frame() is None:
                direct()
            frame = self.state.enter()
            try:
                out = self._run(args, kwargs)
            except RuntimeError as error:
                if frame.depth == 1:
                    _explain_mixed(error, self.state.dtype, self.module)
                raise
            finally:
                self.state.exit(frame)
            written_back(given)  # the forward wrote into a caller's tensor
        return out if self.output_dtype is None else cast_tree(out, self.output_dtype)

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.root or self.float32:
            outer = [d for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]
            if outer and self.root and not self.state.warned:
                self.state.warned = True
                warn(
                    "mixprec: a converted model runs under an outer torch.autocast; its level "
                    "decides what each module computes in, and its float32 modules (black-list "
                    "norms, fp32_modules pins) run with the outer autocast off"
                )
            if outer and self.float32:
                with contextlib.ExitStack() as stack:
                    for device in outer:
                        stack.enter_context(torch.autocast(device, enabled=False))
                    return self._own(args, kwargs)
        return self._own(args, kwargs)

    def _own(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.fast_path:
            frame = self.local.frame
            if frame.active:
                return self._moded(frame, False, args, kwargs)
        return self._plain(args, kwargs)

    def _plain(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        module = self.module
        if self.cls is nn.Embedding and _renorms(module, self.cls, self.cls.forward):
            frame = self.state.frame()
            lookup = args[0] if args else kwargs["input"]
            dtype = None if frame is None else self.state.dtype
            return _renormed_lookup(module, lookup, dtype, frame)
        if isinstance(module, nn.RNNBase) and isinstance(module._parameters, LowParameters):
            view = self.cls.__new__(self.cls)
            view.__dict__.update(module.__dict__)
            module = view  # its _update_flat_weights() writes the view, not the module
        return self.cls.forward(module, *args, **kwargs)


def _registered(parent: nn.Module, name: str, child: nn.Module | None) -> None:
    """A module registered in a module converted at O2/O3, after conversion (a child
    replaced or added, a block appended, what ``register_parametrization`` adds): converted
    as conversion would have converted it there
    (:func:`~mixprec.convert.module_level.convert_added`). One added without
    registration (``ModuleList.insert``, which writes ``_modules``) runs unconverted,
    on float32 weights (a dtype error it meets names it: :func:`_explain_mixed`)."""
    call = forward_of(parent)
    if type(call) is not ModuleCall or child is None or forward_of(child) is not None:
        return
    from mixprec.convert.module_level import convert_added  # (it imports this module)

    convert_added(call, name, child)


_WATCHING = False


def _watch_registrations() -> None:
    """Watch module registrations (:func:`_registered`), once per process, from the first
    module converted at O2/O3 (or loaded) on."""
    global _WATCHING
    if not _WATCHING:
        _WATCHING = True
        nn.modules.module.register_module_module_registration_hook(_registered)


def _low_slice(self: nn.ParameterList, index: Any) -> Any:
    """``ParameterList.__getitem__`` of a converted list whose Parameters read low: a
    slice is a list of the same Parameters reading low as this one's do. (The list's own
    slice appends what its items read, the casts, which a new list makes new Parameters
    of: gradients no longer reached the stored ones.)"""
    params = self.__dict__["_parameters"]
    if not isinstance(index, slice) or type(params) is not LowParameters:
        return nn.ParameterList.__getitem__(self, index)
    return _low_list(self, params, index)


@torch._dynamo.disable(reason="mixprec: a sliced ParameterList reading low is made eagerly")
def _low_list(self: nn.ParameterList, params: LowParameters, index: slice) -> Any:
    """:func:`_low_slice`'s new list, made outside a compiled graph: TorchDynamo reads
    the ``_parameters`` of a module made in its trace as a plain dict (the slice's
    Parameters computed in float32), and a table made there failed its guard check."""
    user = user_class(self)
    out = user()
    for i in range(len(self))[index]:
        out.append(dict.__getitem__(params, str(i)))  # type: ignore[operator]
    set_parameters(out, LowParameters(out._parameters, frozenset(), params.state))
    return out


CLASS_METHODS[nn.ParameterList] = {"__getitem__": _low_slice}


class LowParameter(NamedTuple):
    """A Parameter a converted module computes with in low precision: ``owner.<name>``."""

    owner: nn.Module
    name: str
    parameter: torch.Tensor
    dtype: torch.dtype


def low_precision_parameters(converted: nn.Module) -> list[LowParameter]:
    """Every (owner, name, stored Parameter, low dtype) that computes in low precision.

    A tied Parameter appears once per owner. What a training step needs to give the model
    low-precision Parameters of its own: storing a low-precision Parameter at
    ``owner._parameters[name]`` makes the module compute with it (no cast).

    Raises:
        TypeError: ``converted`` holds no module converted at O2 or O3.

    Example:
        >>> fast = mixprec.auto_mixed_precision(torch.nn.Linear(4, 4), "O2", "bf16")
        >>> [(p.name, p.dtype) for p in low_precision_parameters(fast)]
        [('bias', torch.bfloat16), ('weight', torch.bfloat16)]
    """
    found: list[LowParameter] = []
    seen = False
    for module in converted.modules():
        table = module.__dict__.get("_parameters")
        if isinstance(forward_of(module), ModuleCall):
            seen = True
        if isinstance(table, LowParameters):
            dtype = table.state.dtype
            found += [LowParameter(module, n, p, dtype) for n, p in sorted(table.stored())]
    if not seen:
        raise TypeError(
            f"converted must be a module converted at O2 or O3; got {type(converted).__name__}"
        )
    return found


def float32_parameters(module: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Inside a converted model's forward at O2/O3, where reading a Parameter gives its
    low-precision cast: for the block, ``module``'s Parameters (those of its submodules
    too) read as the stored float32 Parameters, so an update the forward makes to them (a
    momentum encoder's EMA: ``p_k.mul_(m).add_(p_q, alpha=1 - m)``, ``p_k.data = ...``) is
    made in float32, as on the original model. Writes the forward made into their casts
    before the block are written into them first; a read after the block casts them
    afresh. Outside a running call, and at the other levels (which read the Parameters
    themselves), it changes nothing.

    A module called inside the block runs as if called from outside (its own entry)."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"float32_parameters: module must be an nn.Module, got {type(module).__name__}"
        )
    return _float32_parameters(module)


@contextlib.contextmanager
def _float32_parameters(module: nn.Module) -> Iterator[None]:
    states: dict[int, CastState] = {}
    for child in module.modules():
        table = child.__dict__.get("_parameters")
        if isinstance(table, LowParameters):
            states.setdefault(id(table.state), table.state)
    saved: list[tuple[CastState, _Frame]] = []
    for state in states.values():
        frame = state._local.frame
        if not frame.depth:
            continue
        ids = [
            id(value)
            for child in module.modules()
            if isinstance(table := child.__dict__.get("_parameters"), LowParameters)
            and table.state is state
            for _, value in table.stored()
        ]
        with torch._C.DisableTorchFunction():
            for key in ids:  # (their casts' writes first, then fresh casts after)
                cast = frame.casts.pop(key, None)
                if cast is not None:
                    _flush(cast, frame.listed)
        saved.append((state, frame))
        state._local.frame = _Frame(MixedOperands(state.dtype))  # (as outside any call)
    try:
        yield
    finally:
        for state, frame in saved:
            state._local.frame = frame


def reuse_weight_casts(converted: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Deprecated: a context that does nothing; casts are no longer kept across calls.

    The cross-call cast cache served stale casts after writes no version counter sees
    (``.data``, a fused optimizer's kernel), so it was removed: every call casts afresh.
    The name stays for one release so that code using it keeps running.
    """
    import warnings

    del converted
    warnings.warn(
        "reuse_weight_casts is deprecated and does nothing: a converted model casts its weights "
        "on every call, so every write is what the next call computes with",
        DeprecationWarning,
        stacklevel=2,
    )
    return contextlib.nullcontext()
