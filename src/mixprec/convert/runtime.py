"""The lists, applied at run time, to the ops of a module's own forward.

O1 runs every module's own code under :class:`RuntimeListMode` (see
:mod:`mixprec.convert.autocast`), and both run-time levels run a module pinned low, or
run whole in low precision, under a forced-low one: a ``TorchFunctionMode`` that makes,
call by call, the decision of :meth:`mixprec.policy.levels.Recipe.decide`.

The decisions are made once, when the model is converted: a table from torch function
to precision, so a call costs one dict lookup and no string handling (``torch.compile``
traces the mode without a graph break per op). The mode is entered with a ``with``
block, so it is exited even when the forward raises, and it stands aside while a
child with a forward of its own (a pin) runs: see :func:`standing_aside`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.compiler import is_dynamo_compiling as _dynamo_compiling
from torch.overrides import TorchFunctionMode, get_overridable_functions

from mixprec.convert import dispatch
from mixprec.convert.structure import (
    FORWARD_SLOT,
    eager_call,
    forward_facts,
    hooked_compiled,
    owner,
    register,
    restore_key,
    takes_hook_path,
    user_class,
)
from mixprec.policy.dtypes import _CAST_METHODS, is_castable, to_dtype
from mixprec.policy.levels import Level, Precision, Recipe
from mixprec.policy.ops import (
    HIGHER_ORDER,
    PLAIN_TYPES,
    cast_tree,
    held_under,
    only_plain_tensors,
    op_key,
    op_name,
    widest_dtype,
)

__all__ = [
    "ForwardBase",
    "RuntimeForward",
    "RuntimeListMode",
    "ShowsForward",
    "any_nested",
    "decision_table",
    "standing_aside",
]

#: A key no list holds: the precision of an op the lists do not name.
_UNLISTED = "\x00unlisted"


@functools.lru_cache(maxsize=1)
def _torch_functions() -> tuple[tuple[Callable[..., Any], str | Callable[..., Any], bool], ...]:
    """Every overridable torch function with its list key and whether it writes in place
    (computed once per process; torch's function set does not change)."""
    found = []
    for functions in get_overridable_functions().values():
        for func in functions:
            name = op_name(func)
            found.append((func, op_key(func), name.endswith("_") and not name.endswith("__")))
    return tuple(found)


#: A decision as a table holds it: a small int for each :class:`Precision`. TorchDynamo
#: guards an int it reads from a table by its value, in its C++ guard tree; an enum member
#: read from a table and compared with the module's own member it guards as an alias of
#: that member, in Python, once for each entry of the table (29 guards on a tiny BERT at O1).
LOW, FP32, PROMOTE, FOLLOW = 0, 1, 2, 3
_CODES = {
    Precision.LOW: LOW,
    Precision.FP32: FP32,
    Precision.PROMOTE: PROMOTE,
    Precision.FOLLOW: FOLLOW,
}

#: ``({torch function: decision}, the decision of any other call)``, decisions as codes
Table = tuple[dict[Any, int], int]


def _table_key(recipe: Recipe, scopes: Sequence[tuple[str, nn.Module]], force: Any) -> Any:
    """What a table depends on: the innermost pin, O1's white module in scope, ``force``."""
    pin = next((p for n, m in reversed(scopes) if (p := recipe.pinned(m, n)) is not None), None)
    white = recipe.level is Level.O1 and any(isinstance(m, recipe.white_modules) for _, m in scopes)
    return (pin, white, force)


def decision_table(
    recipe: Recipe,
    scopes: Sequence[tuple[str, nn.Module]],
    force: Precision | None = None,
    cache: dict[Any, Table] | None = None,
) -> Table:
    """``({torch function: decision}, the decision of any other call)`` inside ``scopes``,
    as codes (:data:`LOW`, :data:`FP32`, :data:`PROMOTE`, :data:`FOLLOW`; ``cache``
    shares tables between parts of one conversion)."""
    key = _table_key(recipe, scopes, force)
    if cache is not None and key in cache:
        return cache[key]

    def decide(key: Any) -> Precision:
        return force or recipe.decide(key, scopes)

    default = _CODES[decide(_UNLISTED)]
    table: dict[Any, int] = {}
    for func, op, in_place in _torch_functions():
        code = FOLLOW if in_place else _CODES[decide(op)]
        if code != default:
            table[func] = code
    if cache is not None:
        cache[key] = (table, default)
    return table, default


@torch.compiler.assume_constant_result
def _inplace_position(func: Callable[..., Any]) -> int | None:
    """The position of ``func``'s ``inplace`` parameter (``F.relu``), or None: answered
    while TorchDynamo traces (traced, ``functools.cache`` and ``inspect.signature`` gave
    None, so a compiled O1 ``F.relu(x, inplace=True)`` computed low into a new tensor)."""
    return _inplace_position_of(func)


@functools.cache
def _inplace_position_of(func: Callable[..., Any]) -> int | None:
    try:
        names = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("inplace") if "inplace" in names else None


def _writes_in_place(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    """Does this call write into its input (``inplace=True``, by keyword or position)?"""
    at = _inplace_position(func)
    if at is None:
        return False
    return kwargs.get("inplace") is True or (len(args) > at and args[at] is True)


#: The fewest elements of a CPU tensor :meth:`RuntimeListMode._view_of_cast` takes as a
#: view of a cast: below it, the cast (a kernel on the host) costs less than finding and
#: making the view (about 5 us: 2.1 us for a strided cast of 4,096 bfloat16 elements,
#: 8 us for 65,536; `benchmarks/bench_overhead.py`'s BERT makes 16 such views per call)
_CPU_VIEW_MIN = 32_768


class RuntimeListMode(TorchFunctionMode):
    """Applies a decision table to each torch function call made while it is active."""

    def __init__(
        self,
        table: dict[Any, int],
        default: int,
        dtype: torch.dtype,
        back: bool,
        names: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__()
        self.table = table
        self.default = default
        self.dtype = dtype
        self.back = back  # O1: a low op's result goes back to float32
        self.suspended = 0
        #: the white list's ATen names, when its kernels apply it (:mod:`.dispatch`)
        self.names = names
        # one cast per value and dtype in this call: id -> (source, version, dtype, cast)
        self.memo: dict[tuple[int, torch.dtype], tuple[torch.Tensor, int, torch.Tensor]] = {}

    def cast_operand(self, leaf: Any, dtype: torch.dtype) -> Any:
        """One operand of a low op: a floating tensor (or each in a TensorList) cast."""
        if not isinstance(leaf, torch.Tensor):
            if isinstance(leaf, (list, tuple)) and leaf and isinstance(leaf[0], torch.Tensor):
                return type(leaf)(self.cast_operand(item, dtype) for item in leaf)  # einsum
            return leaf
        return self.cast_value(leaf, dtype)

    def cast_value(self, leaf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``leaf`` cast to ``dtype`` once per call of this mode (floating, not float64)."""
        if leaf.dtype == dtype or not is_castable(leaf):
            return leaf
        if torch.compiler.is_compiling():  # the compiler removes repeated casts itself,
            return leaf.to(dtype)  # and a dict it traced through would need guards
        return self.cast_eager(leaf, dtype)

    def cast_eager(self, leaf: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """:meth:`cast_value` outside ``torch.compile``: ``leaf`` cast to ``dtype`` (by
        default the low dtype) once per call; ``leaf`` itself when it is not floating, is
        float64 or is ``dtype`` already. An inference tensor (no version counter, so no way
        to see a write into it) is cast at each use."""
        if dtype is None:
            dtype = self.dtype
        have = leaf.dtype
        if have is dtype or not have.is_floating_point or have is torch.float64:
            return leaf
        key = (id(leaf), dtype)
        hit = self.memo.get(key)
        try:
            version = leaf._version
        except RuntimeError:  # an inference tensor
            return to_dtype(leaf, dtype)
        if hit is not None and hit[0] is leaf and hit[1] == version:
            made = hit[2]
            # (a cast made under no_grad has no gradient path, one made under inference_mode
            # cannot be saved for backward: a use with gradients on casts again)
            if made.requires_grad or not torch.is_grad_enabled():
                return made
            if not leaf.requires_grad and not made.is_inference():
                return made
        base = leaf._base
        cast = None
        if (
            base is not None
            and (id(base), dtype) in self.memo  # (the view's base was cast: look closer)
            and not leaf.requires_grad
            and (not leaf.is_cpu or leaf.numel() >= _CPU_VIEW_MIN)
            and type(leaf) in PLAIN_TYPES
        ):
            cast = self._view_of_cast(leaf, base, dtype)
        if cast is None:
            method = _CAST_METHODS.get(dtype)  # (to_dtype, inline: once per cast)
            cast = leaf.to(dtype) if method is None else method(leaf)
        self.memo[key] = (leaf, version, cast)
        return cast

    #: ``leaf`` cast to the low dtype outside ``torch.compile``: the hot path of O1's
    #: kernels and one-call layers (one Python call per operand)
    down = cast_eager

    def _view_of_cast(
        self, leaf: torch.Tensor, base: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """``leaf``, a view of a value this call has cast to ``dtype`` already (the heads
        split out of an attention projection's result, cast back up), as the same view of
        that cast: a cast is elementwise, so these are its values exactly, with no cast
        kernel. None when ``base`` was not cast, or was written since. (Only for a plain
        tensor that needs no gradient: with autograd the view's history, a backward hook's
        node included, must stay on the gradient's path.)"""
        hit = self.memo.get((id(base), dtype))
        if hit is None or hit[0] is not base or hit[1] != base._version:
            return None
        cast = hit[2]
        if cast.is_inference() and torch.is_grad_enabled():  # (made under inference_mode)
            return None
        if (
            base.storage_offset() != cast.storage_offset()
            or base.stride() != cast.stride()
            or base.shape != cast.shape
        ):
            return None
        return cast.as_strided(leaf.size(), leaf.stride(), leaf.storage_offset())

    def cast_back_eager(self, out: torch.Tensor) -> torch.Tensor:
        """:meth:`cast_back` of a tensor outside ``torch.compile``."""
        if out.dtype is not self.dtype:
            return out
        up = out.float()
        try:  # noqa: SIM105 (a try costs nothing; a suppress context costs a call)
            self.memo[(id(up), self.dtype)] = (up, up._version, out)
        except RuntimeError:  # an inference tensor has no version: not remembered
            pass
        return up

    def cast_back(self, out: Any) -> Any:
        """O1: a low result, cast back to float32 (remembered, so a white-list op that
        takes it next uses the low original instead of casting it down again)."""
        if not isinstance(out, torch.Tensor):
            return cast_tree(out, torch.float32)
        if torch.compiler.is_compiling():
            return out.float() if out.dtype == self.dtype else out
        return self.cast_back_eager(out)

    def again(self, back: bool | None = None) -> RuntimeListMode:
        """A mode with the same decisions (and no casts yet); ``back`` if given."""
        back = self.back if back is None else back
        return RuntimeListMode(self.table, self.default, self.dtype, back, self.names)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        decision = self.table.get(func, self.default)
        if decision == FOLLOW or self.suspended:
            if type(func) in HIGHER_ORDER and not self.suspended and args:
                args = held_under(self, args)
            return func(*args, **kwargs) if kwargs else func(*args)
        if kwargs is None:
            kwargs = {}
        if not only_plain_tensors(args, kwargs):  # torchao's float8 tensors, DTensor
            return func(*args, **kwargs)  # keep their own rules
        if decision == LOW:
            if _writes_in_place(func, args, kwargs):  # F.relu(x, inplace=True): x itself
                return func(*args, **kwargs)
            dtype: torch.dtype | None = self.dtype
        elif decision == FP32:
            dtype = torch.float32
        else:
            dtype = widest_dtype(args, kwargs)
        if dtype is not None:
            args = tuple([self.cast_operand(a, dtype) for a in args])
            if kwargs:
                kwargs = {k: self.cast_operand(v, dtype) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        if decision == LOW and self.back:
            return self.cast_back(out)
        return out


@contextlib.contextmanager
def standing_aside() -> Iterator[None]:
    """Make every active :class:`RuntimeListMode` of this thread, and O1's kernels
    (:mod:`mixprec.convert.dispatch`), ignore ops inside the block (a converted child runs
    there, with its own casts); undone even on error. (Under ``torch.compile`` no kernel
    runs: an O1 region applies its mode there, see ``Region.list_context``.)"""
    kernels = None if _dynamo_compiling() else dispatch.aside()
    modes = (
        [
            m
            for m in torch.overrides._get_current_function_mode_stack()
            if isinstance(m, RuntimeListMode)
        ]
        if torch._C._len_torch_function_stack()
        else []
    )
    for mode in modes:
        mode.suspended += 1
    try:
        if kernels is None:
            yield
        else:
            with kernels:
                yield
    finally:
        for mode in modes:
            mode.suspended -= 1


def any_nested(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Is any direct argument a nested tensor?"""
    return any(isinstance(v, torch.Tensor) and v.is_nested for v in (*args, *kwargs.values()))


class ShowsForward:
    """What a ``forward`` set on a module's instance shows to tools: the signature and
    code object of the forward it stands for, so ``inspect``, ``torch.export`` and
    transformers' ``generate()`` (which passes ``position_ids``, ``attention_mask`` or
    ``cache_position`` only to a forward whose signature names them) see the original."""

    module: nn.Module

    def shown(self) -> Callable[..., Any] | None:
        """The forward shown: the instance ``forward`` it wraps, or None (the class's)."""
        return None

    @property
    def __signature__(self) -> inspect.Signature:
        shown = self.shown()
        if shown is None:
            shown = functools.partial(user_class(self.module).forward, self.module)
        return inspect.signature(shown)

    @property
    def __code__(self) -> types.CodeType:
        """The shown forward's code object, else (a ``functools.partial``: accelerate's
        hook) the class forward's."""
        for function in (self.shown(), user_class(self.module).forward):
            code = getattr(function, "__code__", None)
            if isinstance(code, types.CodeType):
                return code
        return type(self).__call__.__code__


class Facts(NamedTuple):
    """What a compiled call of a :class:`ForwardBase` reads of it, as constants (see
    :func:`~mixprec.convert.structure.compiled_facts`); the names are the forward's own
    attributes, which an eager call reads instead."""

    region_key: str  # an O1 forward's region's ("": none)
    root: bool
    as_written: bool
    may_get_nested: bool
    relu: bool
    direct: str | None
    cls: str  # the module's class's key (its forward read by it: one guard per class)
    own: bool  # a forward the module held before conversion runs (read from the forward)
    inner: bool  # an O1 white-list forward's ``inner`` runs it
    inputs_low: bool
    kind: str  # the forward's class, by its key (its ``compiled_call`` makes the call)


def hook_path_compiled(module: nn.Module, facts: Facts, hooked: bool) -> bool:
    """Under ``torch.compile``: whether a call of ``module`` must go through
    ``nn.Module._call_impl`` (hooks, or a ``forward`` set on its instance since)."""
    return not hooked and ("forward" in module.__dict__ or hooked_compiled(module))


def called(module: nn.Module, forward: Any = None) -> Any:
    """Under ``torch.compile``: the forward a call runs (``forward``, else the module's
    own), where a call needs more of it than its facts (the root's entry, a forward of
    the instance's own)."""
    return module.__dict__[FORWARD_SLOT] if forward is None else forward


def own_code_compiled(
    module: nn.Module,
    facts: Facts,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    forward: ForwardBase | None = None,
) -> Any:
    """Under ``torch.compile``: the module's own code (the forward it held before
    conversion, else its class's ``forward``, read by the class's key: guarded once per
    class where ``type(module).forward`` is guarded once per module)."""
    if facts.own:
        return called(module, forward).own(*args, **kwargs)
    return owner(facts.cls).forward(module, *args, **kwargs)


class ForwardBase(ShowsForward):
    """A converted module's ``forward`` (held by the instance:
    :func:`~mixprec.convert.structure.set_forward`); it shows tools the signature and
    code object of the forward it runs (:class:`ShowsForward`)."""

    key: str  # the module's key (:func:`~mixprec.convert.structure.owner`)
    forward_key: str  # its own (see :func:`~mixprec.convert.structure.compiled_facts`)
    #: a ``forward`` the module held on its instance before conversion (a monkeypatch, an
    #: accelerate hook): it runs where the class's forward would
    own: Callable[..., Any] | None

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.key, self.forward_key = register(module), register(self)
        self.own = module.__dict__.get("forward")
        #: the module's class as the user made it (its ``forward`` is the class's)
        self.cls = user_class(module)

    def shown(self) -> Callable[..., Any] | None:
        return self.own

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["key"], state["forward_key"]  # (numbers of this process's table)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.key, self.forward_key = register(self.module), register(self)
        restore_key(self.module, self)

    def facts(self) -> Facts:
        """What a compiled call reads of it (:class:`Facts`)."""
        return Facts(
            region_key=getattr(self, "region_key", ""),
            root=getattr(self, "root", False),
            as_written=getattr(self, "as_written", False),
            may_get_nested=getattr(self, "may_get_nested", False),
            relu=getattr(self, "relu", False),
            direct=getattr(self, "direct", None),
            cls=register(self.cls),
            own=self.own is not None,
            inner=getattr(self, "inner", None) is not None,
            inputs_low=getattr(self, "inputs_low", False),
            kind=register(type(self)),
        )

    def entry(self, module: nn.Module, hooked: bool) -> tuple[Facts | ForwardBase, bool]:
        """A call's start: what the call reads of this forward (its :class:`Facts` under
        ``torch.compile``, else the forward itself), and whether the call must go through
        ``nn.Module._call_impl`` (hooks, or a forward set since). The hot forwards (O1's,
        the autocast level's) make these steps inline."""
        if _dynamo_compiling():
            facts = forward_facts(self.forward_key)
            return facts, hook_path_compiled(module, facts, hooked)
        return self, not hooked and takes_hook_path(module, self)

    @staticmethod
    def compiled_call(
        module: nn.Module,
        facts: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        hooked: bool,
        forward: ForwardBase | None,
        exact: bool,
    ) -> Any:
        """Under ``torch.compile``: a call of ``module`` (what its class's ``__call__``
        makes, from its forward's ``facts``; ``forward``: the forward called, when not
        the module's own, else read from it). Here the forward's own ``call_impl``; the
        hot forwards read their facts alone."""
        forward = called(module, forward)
        if hooked:
            kwargs = {**kwargs, "_mixprec_hooked": True}
        return forward.call_impl(module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``module.forward`` (what ``nn.Module._call_impl`` calls after the hooks, and
        what ``module.forward(...)`` calls)."""
        if _dynamo_compiling():
            facts = forward_facts(self.forward_key)
            return type(self).compiled_call(self.module, facts, args, kwargs, True, self, False)
        return self.call_impl(self.module, *args, _mixprec_hooked=True, **kwargs)

    @eager_call
    def call_impl(self, module: nn.Module, /, *args: Any, **kwargs: Any) -> Any:
        """A call of ``module`` (what its converted class's ``__call__`` calls): with no
        hooks it does the forward's work itself, as many Python frames as the original's
        call; with hooks ``nn.Module._call_impl`` runs them around :meth:`__call__`, which
        passes ``_mixprec_hooked=True`` (a keyword, not a parameter with a default:
        TorchDynamo guards a default it reads, once per module). Each converted forward's
        work is here; under ``torch.compile`` the callers call :meth:`compiled_call`
        instead (which the hot forwards keep apart: its facts are constants, where this
        object's attributes would each be guarded). ``module`` is the caller's (read from
        this object it would be a second path to it)."""
        raise NotImplementedError


class RuntimeForward(ForwardBase):
    """The ``forward`` of a module whose own code runs at run time under the lists."""

    def __init__(
        self,
        module: nn.Module,
        recipe: Recipe,
        scopes: Sequence[tuple[str, nn.Module]],
        output_dtype: torch.dtype | None,
        force: Precision | None = None,
        reason: str = "",
        tables: dict[Any, Table] | None = None,
    ) -> None:
        super().__init__(module)
        self.recipe, self.scopes, self.force = recipe, tuple(scopes), force
        self.table, self.default = decision_table(recipe, scopes, force, tables)
        self.dtype = recipe.dtype
        self.back = recipe.level is Level.O1 and force is None
        self.output_dtype = output_dtype
        self.reason = reason

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        del state["table"]  # torch functions do not pickle; the table is rebuilt
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.table, self.default = decision_table(self.recipe, self.scopes, self.force)

    @eager_call
    def call_impl(self, module: nn.Module, /, *args: Any, **kwargs: Any) -> Any:
        # (through a keyword, not a default: TorchDynamo guards a default it reads)
        hooked = kwargs.pop("_mixprec_hooked", False) if kwargs else False
        _, hook_path = self.entry(module, hooked)
        if hook_path:
            return nn.Module._call_impl(module, *args, **kwargs)
        if any_nested(args, kwargs):  # only a built-in fast path makes these: run as written
            with standing_aside():
                return (
                    self.cls.forward(module, *args, **kwargs)
                    if self.own is None
                    else self.own(*args, **kwargs)
                )
        running = _only_list_mode()
        if running is not None:  # the common case: lend it this module's decisions
            saved = running.table, running.default, running.back
            running.table, running.default, running.back = self.table, self.default, self.back
            try:
                out = (
                    self.cls.forward(module, *args, **kwargs)
                    if self.own is None
                    else self.own(*args, **kwargs)
                )
            finally:
                running.table, running.default, running.back = saved
        else:
            mode = RuntimeListMode(self.table, self.default, self.dtype, self.back)
            with standing_aside(), mode:
                out = (
                    self.cls.forward(module, *args, **kwargs)
                    if self.own is None
                    else self.own(*args, **kwargs)
                )
        return out if self.output_dtype is None else cast_tree(out, self.output_dtype)


def _only_list_mode() -> RuntimeListMode | None:
    """The thread's one torch-function mode when it is an active :class:`RuntimeListMode`
    (a module's decisions can then be lent to it for the module's call: the same as
    standing it aside and entering a mode of the module's own, without a mode per call)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_function_stack() != 1:
        return None
    mode = torch._C._get_function_stack_at(0)
    if isinstance(mode, RuntimeListMode) and not mode.suspended:
        return mode
    return None
