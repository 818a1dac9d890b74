"""Copies of a module tree that share its Parameters and buffers, and the one owner of
a converted module's instance slots.

Converting never edits the user's module: it edits a *structural copy*, a new tree of
modules of the same classes whose ``_parameters`` and ``_buffers`` hold the very same
tensor objects. An optimizer built on the original keeps updating the weights the copy
computes with; hooks or children added to the copy do not reach the original.

A converted module takes its class's converted class (:func:`converted_class`: a subclass
of the user's class whose ``__call__`` and ``forward`` are the conversion's), and the slots a
conversion layers on a copied module (its forward object and that object's key,
``_parameters``, ``extra_repr``) are written here only: :func:`set_forward`,
:func:`set_parameters` and :func:`add_repr_note`. Layers compose: a repr note is added,
never replaces another (emulation keeps the level line), and a forward wraps the one before
it.
"""

from __future__ import annotations

import contextlib
import copy
import copyreg
import functools
import itertools
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.compiler import is_dynamo_compiling as _dynamo_compiling
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from torch.nn.modules import module as module_hooks
from torch.nn.utils import parametrize

__all__ = [
    "CONVERSION_ATTR",
    "FORWARD_SLOT",
    "ExtraRepr",
    "HookedCall",
    "add_repr_note",
    "conversion_of",
    "converted_class",
    "eager_call",
    "facts_key",
    "find_converted",
    "forward_facts",
    "forward_of",
    "is_converted_exactly",
    "owner",
    "qualified_name",
    "register",
    "restore_key",
    "set_forward",
    "set_parameters",
    "structural_copy",
    "user_class",
]

#: The attribute a converted module carries (a :class:`mixprec.convert.plan.Conversion`).
CONVERSION_ATTR = "_mixprec_conversion"


def eager_call(function: Any) -> Any:
    """Mark ``function`` (a converted forward's ``call_impl``: the eager call) to run
    eagerly, with every call it makes, when TorchDynamo meets it as a frame of its own.

    Compiled code never calls it: a compiled module call takes its class's
    ``compiled_call``. TorchDynamo meets it only where it runs a converted call eagerly
    inside a compiled region, after a frame it could not trace (a root ``nn.GRU``, which it
    refuses to wrap). Compiling that frame alone would fold ``is_compiling()`` to true in
    the eager path's decisions (no per-call state entered, no mode) and run the rest, past
    the graph break, eagerly without them: a low input meets float32 weights. So the eager
    call runs eagerly, as it would with no compiler, and the calls it makes with it."""
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:  # (a torch without per-code strategies: nothing to mark)
        return function
    skip = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
    set_code_exec_strategy(function.__code__, skip)
    return function


def structural_copy(module: nn.Module, memo: dict[int, nn.Module] | None = None) -> nn.Module:
    """A new module tree of the same classes, sharing every Parameter and buffer.

    A submodule that appears twice in the tree (a shared block) is copied once and
    appears twice in the copy. Hook dictionaries are copied, so hooks registered on the
    copy stay on the copy. A method bound to the module and set on its instance (a patched
    ``forward``, or accelerate's hook's ``functools.partial`` of the module) is bound to
    the copy, so it computes with the copy's children.
    """
    memo = {} if memo is None else memo
    if id(module) in memo:
        return memo[id(module)]
    if isinstance(module, OptimizedModule):  # a submodule the user compiled: its copy is
        # the copy of the module it compiles, compiled as it was (its ``forward`` is bound
        # to the module it was made for)
        wrapped = OptimizedModule(structural_copy(module._orig_mod, memo), module.dynamo_ctx)
        memo[id(module)] = wrapped
        return wrapped
    cls = type(module)
    try:
        new = cls.__new__(cls)
    except TypeError:  # (a ``__new__`` of the user's that takes arguments: its state is the
        new = object.__new__(cls)  # dict copied next, as ``__new__`` left it)
    state = dict(module.__dict__)
    for key, value in module.__dict__.items():
        if "hooks" in key and isinstance(value, dict):
            state[key] = type(value)(value)
    for key, value in module.__dict__.items():  # methods bound to the original: the copy's
        if isinstance(value, types.MethodType) and value.__self__ is module:
            state[key] = types.MethodType(value.__func__, new)
    own = state.get("forward")  # accelerate's hooks bind the module as a partial's first
    if isinstance(own, functools.partial) and own.args and own.args[0] is module:
        state["forward"] = functools.partial(own.func, new, *own.args[1:], **own.keywords)
    state["_parameters"] = dict(module._parameters)
    state["_buffers"] = dict(module._buffers)
    state["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
    new.__dict__.update(state)
    for name in copyreg._slotnames(cls):  # type: ignore[attr-defined]  # (``__slots__``)
        with contextlib.suppress(AttributeError):  # (a slot never set)
            object.__setattr__(new, name, object.__getattribute__(module, name))
    memo[id(module)] = new
    new._modules = {
        name: None if child is None else structural_copy(child, memo)
        for name, child in module._modules.items()
    }
    if isinstance(new, torch.fx.GraphModule):
        # ``GraphModule.__new__`` made the copy a class of its own; a graph of its own
        # (an edit of the copy's graph leaves the original's be), whose setter gives that
        # class its ``forward`` (the same code)
        new.graph = copy.deepcopy(module.graph)  # type: ignore[assignment]
    return new


def conversion_of(module: nn.Module) -> object | None:
    """The conversion record of a converted module, or None."""
    return module.__dict__.get(CONVERSION_ATTR)


def find_converted(module: nn.Module) -> Iterator[str]:
    """Qualified names of already-converted modules in a tree."""
    for name, sub in module.named_modules():
        if conversion_of(sub) is not None:
            yield name


class ExtraRepr:
    """``extra_repr`` of a converted module: its notes (the level and dtype, emulation,
    ...), one a line, then the original class's own."""

    def __init__(
        self, module: nn.Module, text: str = "", cls: type[nn.Module] | None = None
    ) -> None:
        self.module = module
        self.notes: list[str] = [text] if text else []
        self.cls = user_class(module) if cls is None else cls

    def __call__(self) -> str:
        try:
            own = self.cls.extra_repr(self.module)
        except AttributeError:  # the original's extra_repr reads something the copy lacks
            own = ""
        return "\n".join(part for part in (*self.notes, own) if part)


def add_repr_note(module: nn.Module, note: str) -> None:
    """Add a line to what ``repr(module)`` shows for it (after any earlier note)."""
    current = module.__dict__.get("extra_repr")
    if not isinstance(current, ExtraRepr):
        current = ExtraRepr(module)
        module.__dict__["extra_repr"] = current
    current.notes.append(note)


#: The instance attribute that holds a converted module's forward object (see
#: :func:`set_forward`); ``module.forward`` reads it.
FORWARD_SLOT = "_mixprec_forward"
#: The instance attribute that holds the key of its forward's facts (what a compiled
#: call reads: one guard, where the object would be guarded by type and by each
#: attribute; see :func:`facts_key`)
KEY_SLOT = "_mixprec_key"


class _ConvertedForward:
    """The ``forward`` of a converted class: on a module, the converted forward object it
    holds (:data:`FORWARD_SLOT`); on the class, the user's class's ``forward``, read at
    each access (so ``type(module).forward`` is what it is on the original, patches
    included). A non-data descriptor: a ``forward`` set on the instance since conversion
    (a monkeypatch) takes precedence, as it would on the original."""

    def __get__(self, module: nn.Module | None, cls: type | None = None) -> Any:
        if module is None:
            # (``symbolic_trace`` reads the root's class's forward; never while TorchDynamo
            # traces, whose own check would add guards)
            if not _dynamo_compiling() and is_fx_symbolic_tracing():
                raise TypeError(_FX_REFUSAL.format(name=cls.__name__))  # type: ignore[union-attr]
            return cls._mixprec_user_class.forward  # type: ignore[union-attr]
        return module.__dict__[FORWARD_SLOT]


class _ConvertedBase:
    """The first base of a converted class, ahead of the user's class: a subclass of this
    one of its own (:func:`_quiet_subclass`) holds the class's ``forward``
    (:class:`_ConvertedForward`). Read on the class (``type(module).forward``, which
    transformers' ``GradientCheckpointingLayer`` compares with its wrapper to decide
    whether to checkpoint), TorchDynamo answers a descriptor of the class's own dict with
    the descriptor object itself, not with its ``__get__``; one a base holds, it invokes.
    (Held in the class's own dict, the comparison failed under ``torch.compile`` and a
    converted layer never checkpointed there.) One descriptor object for every converted
    class, reached through two classes, TorchDynamo guarded as one object by two paths,
    one of which reads the descriptor's ``__get__``: the guard failed at once."""


_FX_REFUSAL = (
    "mixprec: torch.fx.symbolic_trace cannot trace a converted model ({name}): its casts "
    "are made in its modules' calls, which symbolic tracing replaces with its own, so the "
    "graph would not compute what the model computes. Trace the original and convert "
    "the GraphModule (mixprec.auto_mixed_precision(torch.fx.symbolic_trace(model), ...)), "
    "or capture the converted model with torch.export.export or torch.compile."
)


def _converted_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``__call__`` of a converted class made without a key, and of a class another
    library makes over a converted class (``register_parametrization``'s, FSDP2's
    ``fully_shard``'s: see :func:`_init_converted_subclass`), in place of
    ``nn.Module.__call__``, which it does with its own ``_call_impl``: the module's forward
    object makes the call, hooks included (its ``call_impl``). As many Python frames as
    the original's call.

    Under ``torch.compile`` the call reads the module's key of its forward's facts
    (:data:`KEY_SLOT`) and the forward's class's ``compiled_call`` makes it from those
    facts (:func:`compiled_facts`), as a call of a module of another class than its
    converted one (``exact`` false: no one-call short cut). It reads the key as an
    attribute: TorchDynamo reads a module's attributes through the instance dict it walks
    anyway, where ``self.__dict__`` would add a node of its own to the guard tree."""
    if _dynamo_compiling():
        key = getattr(self, KEY_SLOT, None)
        if key is not None:
            facts = compiled_facts(key)
            return owner(facts.kind).compiled_call(self, facts, args, kwargs, False, None, False)
    elif self._compiled_call_impl is not None:  # (``module.compile()``)
        return self._compiled_call_impl(*args, **kwargs)
    return self.__dict__[FORWARD_SLOT].call_impl(self, *args, **kwargs)


#: the constant of :func:`_keyed_call_template`'s code that :func:`_keyed_call` replaces
#: with a key in a copy of that code
_KEY_PLACEHOLDER = "<mixprec: a converted class's facts key>"


def _keyed_call_template(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """:func:`_converted_call` of a converted class whose modules' forward facts have one
    key (:func:`_keyed_call` copies this code with the key a constant of it)."""
    if _dynamo_compiling():
        facts = compiled_facts("<mixprec: a converted class's facts key>")  # (_KEY_PLACEHOLDER)
        return owner(facts.kind).compiled_call(self, facts, args, kwargs, False, None, True)
    if self._compiled_call_impl is not None:  # (``module.compile()``)
        return self._compiled_call_impl(*args, **kwargs)
    return self.__dict__[FORWARD_SLOT].call_impl(self, *args, **kwargs)


def _keyed_call(key: str) -> Any:
    """``__call__`` of the converted class of the forward facts of key ``key``
    (:func:`converted_class`): :func:`_converted_call`, but under ``torch.compile`` the
    key is a constant of the function's code, not read from the module. TorchDynamo reads
    a constant of the code it traces without a guard (a closure cell or a default would be
    guarded, through the class, for each class), and it guards each module's class anyway:
    a module's decisions then cost no guard of their own. One class per user class and set
    of decisions, shared by every module with those decisions."""
    template = _keyed_call_template.__code__
    if _KEY_PLACEHOLDER not in template.co_consts:
        raise RuntimeError("mixprec: the keyed call's template lost its key placeholder")
    consts = tuple(key if c == _KEY_PLACEHOLDER else c for c in template.co_consts)
    call = types.FunctionType(
        template.replace(co_consts=consts, co_name="_converted_call"),
        _keyed_call_template.__globals__,
        "_converted_call",
    )
    call.__qualname__ = "_converted_call"  # (its docstring is the template's)
    return call


def _init_converted_subclass(sub: type, **kwargs: Any) -> None:
    """``__init_subclass__`` of a converted class: a class made over it by another library
    (``register_parametrization``, FSDP2's ``fully_shard``) calls through
    :func:`_converted_call`, which reads the module's key (a converted class's key is what
    its own modules compute with)."""
    base = next(c for c in sub.__mro__[1:] if "_mixprec_user_class" in c.__dict__)
    super(base, sub).__init_subclass__(**kwargs)  # type: ignore[arg-type]
    for name in ("__call__", "_call_impl"):
        if name in base.__dict__ and getattr(sub, name) is base.__dict__[name]:
            # (its calls would reach the converted class's own: a class between them that
            # defines one, a mixin's, keeps it, as it would over the user's class)
            setattr(sub, name, _converted_call)


def _converted_new(cls: type[nn.Module], *args: Any, **kwargs: Any) -> Any:
    """``__new__`` of a converted class. Called to make a module with arguments
    (``type(converted)(4, 4)``, a container sliced in a forward, which makes
    ``self.__class__(...)``), it makes a module of the user's class,
    as that class makes it: unconverted, as any module the user makes (not an instance
    of ``cls``: ``type.__call__`` runs no ``__init__`` on it). With none (``copy.deepcopy``
    of a parametrized module, ``DataParallel``'s replicas, which fill the module they
    make; a constructor that takes no arguments), an empty module of ``cls``:
    :func:`_converted_init` makes the latter the user's."""
    user = cls._mixprec_user_class  # type: ignore[attr-defined]
    if args or kwargs or _dynamo_compiling():  # (no copy is made in a compiled forward;
        return user(*args, **kwargs)  # re-classing one there would break the graph)
    return user.__new__(cls)


def _converted_init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
    """``__init__`` of a converted class, for a module made by calling it with no
    arguments (:func:`_converted_new`): the user's class's ``__init__`` makes it, and it is
    then of the user's class."""
    cls = type(self)
    user = cls._mixprec_user_class  # type: ignore[attr-defined]
    user.__init__(self, *args, **kwargs)
    if cls._mixprec_exact is cls:  # type: ignore[attr-defined]  # (not a class made over it)
        self.__class__ = user


def _converted_replicate(self: nn.Module) -> nn.Module:
    """``nn.DataParallel``'s replica of a converted module: refused where its forward
    object holds the module it was made for (O2/O3: its replica would compute with that
    module's weights, not the replica's copies on its device)."""
    forward = self.__dict__.get(FORWARD_SLOT)
    if getattr(type(forward), "binds_its_module", False):
        raise TypeError(
            "mixprec: nn.DataParallel cannot replicate a model converted at O2/O3 (each "
            "replica would compute with the original module's weights); use "
            "torch.nn.parallel.DistributedDataParallel (docs/distributed.md), or level O1 "
            "or 'autocast'"
        )
    user: Any = type(self)._mixprec_user_class  # type: ignore[attr-defined]
    return user._replicate_for_data_parallel(self)


def _converted_recompile(self: Any) -> Any:
    """``GraphModule.recompile`` of a converted ``GraphModule``: made on the user's class
    (the class of that module's own, which it gives the new ``forward``, and whose
    ``forward`` the converted class reads), not on the converted class, where it would
    set a ``forward`` and a ``__call__`` that call each other without end."""
    cls = type(self)
    self.__class__ = cls._mixprec_user_class
    try:
        return self.recompile()
    finally:
        self.__class__ = cls


def _converted_reduce_ex(self: nn.Module, protocol: Any) -> Any:
    """Pickle and ``copy.deepcopy`` a converted module as its user's class (the converted
    class is made again, by :func:`converted_class`, where it is loaded; the forward's
    key is this process's: :func:`restore_key`)."""
    state = self.__getstate__()
    state.pop(KEY_SLOT, None)
    return (_rebuilt, (type(self)._mixprec_user_class,), state)  # type: ignore[attr-defined]


def _converted_setstate(self: nn.Module, state: dict[str, Any]) -> None:
    type(self)._mixprec_user_class.__setstate__(self, state)  # type: ignore[attr-defined]
    forward = self.__dict__.get(FORWARD_SLOT)
    if forward is not None:
        restore_key(self, forward)


def restore_key(module: nn.Module, forward: Any) -> None:
    """After a copy or an unpickling: the module's :data:`KEY_SLOT` (this process's
    key of its forward's facts), once both the module and ``forward``, its forward,
    are whole (either is restored first; each calls this)."""
    if module.__dict__.get(FORWARD_SLOT) is not forward or not hasattr(
        type(forward), "compiled_call"
    ):
        return
    try:
        facts = forward.facts()  # type: ignore[union-attr]
    except AttributeError:  # (the forward is not whole yet)
        return
    key = module.__dict__[KEY_SLOT] = facts_key(facts)
    if is_converted_exactly(module):
        module.__class__ = converted_class(user_class(module), key)


def _rebuilt(cls: type[nn.Module]) -> nn.Module:
    """An empty converted module of the user's class ``cls`` (its state is set next)."""
    new = cls.__new__(cls)
    new.__class__ = converted_class(cls)
    return new


#: user class -> {key: its converted class}, held for good (a bounded set: one class per
#: user class and set of decisions, which converted copies of a model share, so their
#: compiled graphs are found again by class)
_CONVERTED: weakref.WeakKeyDictionary[type, dict[str | None, type]] = weakref.WeakKeyDictionary()
#: the same for keys of one conversion's own (:data:`_PASSING_KEYS`), held while a module
#: of the class lives: each O1 conversion, and each copy of one, makes classes of its own
_CONVERTED_PASSING: weakref.WeakKeyDictionary[type, weakref.WeakValueDictionary[str, type]] = (
    weakref.WeakKeyDictionary()
)


#: base class -> methods a converted class of it (or of a subclass of it) takes in place
#: of the base's (filled by the modules that need one: ``cast_at_use``'s slicing of a
#: ``ParameterList`` whose weights read low)
CLASS_METHODS: dict[type, dict[str, Any]] = {}


def converted_class(cls: type[nn.Module], key: str | None = None) -> type[nn.Module]:
    """The class of a converted module of class ``cls`` whose forward's facts have key
    ``key`` (:func:`facts_key`; None: a module being converted, or one whose forward has
    no compiled facts): a subclass of ``cls`` of the same name, module and qualified name,
    one per class and key, whose ``forward`` is the module's forward object and whose
    calls that object makes (:func:`_keyed_call`).

    A conversion's per-module state lives on the instance (:data:`FORWARD_SLOT`), its
    code and its decisions' key on this class: TorchDynamo guards a module's class once
    per module, where every instance slot (a ``forward``, a ``_call_impl``, a key) would
    be guarded besides. ``isinstance(converted, cls)`` holds; ``type(converted)`` is this
    class (as it is a class of its own for a module sharded by FSDP2's ``fully_shard``).
    A class with a ``__call__`` of its own keeps it, and ``nn.Module.__call__``, which it
    calls, reads this class's ``_call_impl`` (the same call)."""
    passing = key in _PASSING_KEYS
    table: Any = _CONVERTED_PASSING if passing else _CONVERTED
    classes = table.get(cls)
    if classes is None:
        classes = table[cls] = weakref.WeakValueDictionary() if passing else {}
    converted = classes.get(key)
    if converted is None:
        body: dict[str, Any] = {
            "__new__": staticmethod(_converted_new),
            "__init__": _converted_init,
            "__reduce_ex__": _converted_reduce_ex,
            "__setstate__": _converted_setstate,
            "__init_subclass__": classmethod(_init_converted_subclass),
            **{
                name: method
                for base in reversed(cls.__mro__)
                for name, method in CLASS_METHODS.get(base, {}).items()
            },
            "_mixprec_user_class": cls,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        }
        if issubclass(cls, torch.fx.GraphModule):
            body["recompile"] = _converted_recompile
            # (copied as a converted module is, by ``__reduce_ex__``: ``GraphModule``'s own
            # copies make a new module of a new class, which would drop the conversion)
            body["__deepcopy__"] = None
            body["__copy__"] = None
        body["_replicate_for_data_parallel"] = _converted_replicate
        call = _converted_call if key is None else _keyed_call(key)
        if cls.__call__ is nn.Module.__call__:
            body["__call__"] = call
        else:  # (a ``__call__`` of its own, which calls ``nn.Module.__call__``: that reads
            # ``_call_impl``, a method of this class's, not a slot of each module's, which
            # TorchDynamo would reach the module through a second time: a guard per module)
            body["_call_impl"] = call
        converted = _quiet_subclass(cls, body)
        converted._mixprec_exact = converted  # type: ignore[attr-defined]
        classes[key] = converted
    return converted


def _quiet_subclass(cls: type, body: dict[str, Any]) -> type:
    """A subclass of ``cls`` with ``body``, made without the user's ``__init_subclass__``:
    a converted class is the conversion's, not a class of the user's program (a registry
    a base fills by name, as plugin registries are, received it, and one that refuses a
    second class of a name refused conversion). Made over ``nn.Module`` and given ``cls``
    as its base after (``type`` calls ``__init_subclass__`` only where a class is made);
    where that cannot be (a metaclass of the user's, a layout of its own: ``__slots__``),
    made over ``cls``, with ``body`` set again over what its ``__init_subclass__`` set
    (transformers' layers wrap ``forward``)."""
    # (a base of its own: one descriptor object shared by every converted class, reached by
    # TorchDynamo through two classes, is one object by two paths, which it guards as one)
    base = type("_ConvertedBase", (_ConvertedBase,), {"forward": _ConvertedForward()})
    if type(cls) is type:
        quiet = types.new_class(cls.__name__, (nn.Module,), exec_body=lambda ns: ns.update(body))
        try:
            quiet.__bases__ = (base, cls)
        except TypeError:  # (a layout of its own)
            pass
        else:
            return quiet
    converted = types.new_class(cls.__name__, (base, cls), exec_body=lambda ns: ns.update(body))
    for name, value in body.items():
        setattr(converted, name, value)
    if "forward" in converted.__dict__:  # (set by the user's ``__init_subclass__``)
        delattr(converted, "forward")
    return converted


def is_converted_exactly(module: nn.Module) -> bool:
    """Whether ``module`` is of a converted class (:func:`converted_class`), not of a class
    another library made over one (which inherits the converted class's
    ``_mixprec_exact``, the converted class itself)."""
    cls = type(module)
    return getattr(cls, "_mixprec_exact", None) is cls


def _converted_class_of(
    module: nn.Module, cls: type[nn.Module], key: str | None
) -> type[nn.Module]:
    """The class ``module`` (of class ``cls``) takes when converted, its forward's facts of
    key ``key``: :func:`converted_class`, or for a module parametrized before conversion,
    whose class ``register_parametrization`` made for it over its own (the parametrized
    tensors' properties live there), a copy of that class over the converted class: the
    layout a parametrization registered after conversion makes, which
    ``remove_parametrizations`` undoes (it deletes the properties from the module's class
    and restores the class's base)."""
    if not parametrize.is_parametrized(module):
        return converted_class(cls, key)
    body = {name: v for name, v in vars(cls).items() if name not in ("__dict__", "__weakref__")}
    return type(cls.__name__, (converted_class(cls.__bases__[0], key),), body)


def user_class(module: nn.Module) -> type[nn.Module]:
    """The class of ``module`` as the user made it (a converted module's class is a
    subclass of it: :func:`converted_class`)."""
    cls = type(module)
    return getattr(cls, "_mixprec_user_class", cls)


def forward_of(module: nn.Module) -> Any:
    """The converted forward object ``module`` holds (None: not converted)."""
    return module.__dict__.get(FORWARD_SLOT)


class HookedCall:
    """A converted forward whose calls take ``nn.Module._call_impl`` (hooks, then the
    module's ``forward``: this object's ``__call__``)."""

    @eager_call
    def call_impl(self, module: nn.Module, /, *args: Any, **kwargs: Any) -> Any:
        return nn.Module._call_impl(module, *args, **kwargs)


def set_forward(module: nn.Module, forward: Any) -> None:
    """Make ``forward`` (an object with ``call_impl(module, /, *args, **kwargs)``, which
    makes a call of the module, hooks included) the module's ``forward``; it wraps the one
    it read before (:func:`forward_of`, else an instance ``forward`` the module held,
    which it runs in place of the class's: that slot is emptied, so ``module.forward`` is
    the converted one). The module takes its :func:`converted_class`."""
    slots = module.__dict__
    slots[FORWARD_SLOT] = forward
    slots.pop("forward", None)
    # (its facts read the module as it is now, of its class or of a converted one of it)
    key = facts_key(forward.facts()) if hasattr(type(forward), "compiled_call") else None
    if key is None:
        slots.pop(KEY_SLOT, None)
    else:
        slots[KEY_SLOT] = key
    cls = type(module)
    user = getattr(cls, "_mixprec_user_class", None)
    if user is None:
        module.__class__ = cls = _converted_class_of(module, cls, key)
    elif is_converted_exactly(module):
        module.__class__ = cls = converted_class(user, key)
    slots.pop("_call_impl", None)  # (a slot of an older conversion's: now the class's)


#: key -> a weak reference to an object a converted forward reads (see :func:`owner`), as
#: the attributes of a module object: TorchDynamo reads a module's attribute by name and
#: guards that one attribute, where a global dict would be copied whole at each trace (and
#: could change size meanwhile, as a collected module's key goes)
_TABLE = types.ModuleType("mixprec.convert.structure._TABLE")
_KEY_OF: dict[int, str] = {}  # id(object) -> its key
_KEYS = itertools.count()


def register(obj: Any) -> str:
    """The key :func:`owner` answers with ``obj`` while ``obj`` lives (one key per
    object, so every reader of it reads it by one path)."""
    key = _KEY_OF.get(id(obj))
    if key is not None and getattr(_TABLE, key)() is obj:
        return key
    key = f"k{next(_KEYS)}"

    def forget(_: object, key: str = key, address: int = id(obj)) -> None:
        _TABLE.__dict__.pop(key, None)
        if _KEY_OF.get(address) == key:
            del _KEY_OF[address]

    setattr(_TABLE, key, weakref.ref(obj, forget))
    _KEY_OF[id(obj)] = key
    return key


def owner(key: str) -> Any:
    """The object registered under ``key`` (a converted module, an O1 region): what a
    converted forward reads, under ``torch.compile``, instead of the one it holds.

    TorchDynamo reaches a module through its parent (``parent._modules[name]``); read
    again through its forward (``module._call_impl.__self__.module``) it is the same
    object by a second path, and TorchDynamo adds a guard that the two paths agree,
    which it checks in Python at every call (one or two per module, each walking both
    paths from the frame's arguments). An object read from this global table is not such
    a second path (TorchDynamo relates paths from the frame only to each other, and every
    reader reads one object by one key), and the table never changes what a key means,
    so nothing needs guarding beyond the key itself.
    """
    obj = getattr(_TABLE, key)()
    if obj is None:  # (a forward outliving its module: not reachable from a model)
        raise RuntimeError(f"mixprec: the object of key {key} is gone")
    return obj


#: key -> facts (a hashable tuple of constants), and facts -> key: one key per value,
#: so that equal decisions (the same layer of two converted copies of a model) have
#: one key, and their compiled calls share guards and graphs, as the original's do
_FACTS = types.ModuleType("mixprec.convert.structure._FACTS")
_FACTS_KEYS: dict[Any, str] = {}
#: keys of facts that name one conversion's own state (an O1 region: ``region_key``),
#: whose converted classes are not kept past their modules (:func:`converted_class`)
_PASSING_KEYS: set[str] = set()


def facts_key(facts: Any) -> str:
    """The key of ``facts`` (a hashable tuple of constants: a converted forward's
    decisions, a low-precision parameter table's), one per value, for good."""
    key = _FACTS_KEYS.get(facts)
    if key is None:
        key = _FACTS_KEYS[facts] = f"f{len(_FACTS_KEYS)}"
        setattr(_FACTS, key, facts)
        if getattr(facts, "region_key", ""):
            _PASSING_KEYS.add(key)
    return key


@torch.compiler.assume_constant_result
def compiled_facts(key: str) -> Any:
    """Under ``torch.compile``: the facts of ``key`` (:func:`facts_key`), answered while
    TorchDynamo traces, so that none of them is guarded one by one: the traced code
    reads one string (one guard).

    A forward's facts are fixed at conversion; what can change since is read in the
    traced code (hooks, a ``forward`` set on the instance, the class's ``forward``), and
    so guarded."""
    return getattr(_FACTS, key)


@torch.compiler.assume_constant_result
def forward_facts(forward_key: str) -> Any:
    """Under ``torch.compile``: the facts of the converted forward registered under
    ``forward_key`` (a call through the forward itself: with hooks, or
    ``module.forward(...)``)."""
    return owner(forward_key).facts()


def torch_forward(cls: type[nn.Module]) -> bool:
    """Whether ``cls.forward`` is the ``forward`` PyTorch defines on ``cls`` (not one a
    library patched onto the class, before conversion or since): what a converted call
    checks before it makes a built-in layer's one call in its place."""
    forward = cls.__dict__.get("forward")
    return (
        forward is not None
        and getattr(forward, "__module__", None) == cls.__module__
        and getattr(forward, "__qualname__", None) == f"{cls.__qualname__}.forward"
    )


def takes_hook_path(module: nn.Module, forward: object) -> bool:
    """Whether a call of ``module`` (converted, its ``forward`` the object ``forward``)
    must go through ``nn.Module._call_impl``, outside ``torch.compile``: hooks on it,
    global module hooks, a TorchScript trace running, or a ``forward`` set on its
    instance since (which then runs). Under ``torch.compile``: :func:`hooked_compiled` and the
    ``current`` of :func:`compiled_facts`."""
    slots = module.__dict__  # (read directly: a module's attribute lookup takes longer)
    return bool(
        slots["_forward_pre_hooks"]
        or slots["_forward_hooks"]
        or slots["_backward_pre_hooks"]
        or slots["_backward_hooks"]
        or module_hooks._global_forward_pre_hooks
        or module_hooks._global_forward_hooks
        or module_hooks._global_backward_pre_hooks
        or module_hooks._global_backward_hooks
        or "forward" in slots
        or torch._C._get_tracing_state()
    )


def hooked_compiled(module: nn.Module) -> bool:
    """Whether ``module`` has hooks, or global module hooks are set, under
    ``torch.compile``: the hook dictionaries read as the module's attributes, which
    TorchDynamo guards as it guards the original's (an empty one costs no guard)."""
    return bool(
        module._forward_pre_hooks
        or module._forward_hooks
        or module._backward_pre_hooks
        or module._backward_hooks
        or module_hooks._global_forward_pre_hooks
        or module_hooks._global_forward_hooks
        or module_hooks._global_backward_pre_hooks
        or module_hooks._global_backward_hooks
    )


def set_forward_hooks(module: nn.Module, hooks: dict[int, Any]) -> None:
    """Make ``hooks`` (a dict holding the same hooks) the module's ``_forward_hooks``."""
    module.__dict__["_forward_hooks"] = hooks


def set_parameters(module: nn.Module, table: dict[str, Any]) -> None:
    """Make ``table`` (a dict holding the same Parameters) the module's ``_parameters``."""
    module.__dict__["_parameters"] = table


def qualified_name(prefix: str, name: str) -> str:
    """``prefix.name`` as ``named_modules`` spells it (either part may be empty)."""
    return f"{prefix}.{name}" if prefix and name else prefix or name
