"""The levels that run the user's own code: the autocast level and O1.

Nothing is traced and nothing is snapshotted: every module runs its own, unchanged
``forward``, so children replaced, added or removed after conversion run as on the
original, tensors in any argument are used as passed, and a forward reads every
attribute (and draws from the RNG) at each call, exactly as the original does.

**The autocast level** is ``torch.autocast`` itself: the user's code, torch's decisions.

The level's decision for every op is the one ``torch.autocast`` makes on CPU and CUDA (its
lists, :mod:`mixprec.policy.lists`, reproduce it op by op), so a converted model runs its
own, unchanged ``forward`` inside ``torch.autocast(device_type, dtype)``: nothing is
traced, nothing is snapshotted, and the host cost per op is torch's own (C++, no Python
per op). The device type is the one the call runs on (:func:`call_device`): a model
converted on the CPU and moved to a GPU afterwards runs under CUDA's autocast. Each
module's ``forward`` (set on the instance) is one of:

* :class:`AutocastForward`: its own forward, entering the autocast region when called
  from outside it (the root, or a submodule called directly);
* :class:`Fp32Forward` inside a float32 pin: autocast off, floating arguments cast up;
* :class:`~mixprec.convert.runtime.RuntimeForward` forced low for a low pin and for the
  recurrent layers and attention (run whole in low precision: floating arguments and
  weights cast down, under :class:`~mixprec.convert.runtime.RuntimeListMode`).

**O1** runs the model's code under one :class:`~mixprec.convert.runtime.RuntimeListMode`
per call, entered where the call comes in (the root, or a submodule called directly):

* a call of a white-list function (``F.linear``, ``matmul``, ``conv*``, ``bmm``, ...)
  casts its floating operands down (each value once per call: a weight used twice, or a
  low result feeding the next white-list op, is not cast again), computes low, and
  returns its result cast back to float32;
* every other call follows its inputs, which are float32 by construction (the entry
  casts float16/bfloat16 arguments up and every white-list result comes back float32),
  at the cost of one dictionary lookup;
* a white-list module whose code is one white-list call (``nn.Linear``, ``nn.Conv2d``,
  ...) needs nothing more; any other white-list module (recurrent layers, attention, a
  class of the user's list) runs whole in low precision, its result cast back; a
  subclass of a built-in white-list layer with its own ``forward`` (torchao's
  ``Float8Linear``) gets its inputs cast down and runs its own code.

Pins work as at the autocast level (:class:`Fp32Forward`, a forced-low
:class:`~mixprec.convert.runtime.RuntimeForward`).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.compiler as _compiler
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.compiler import is_dynamo_compiling as _dynamo_compiling
from torch.nn.modules.module import (
    _global_backward_hooks,
    _global_backward_pre_hooks,
    _global_forward_hooks,
    _global_forward_pre_hooks,
)

from mixprec._warn import warn
from mixprec.convert import dispatch
from mixprec.convert.dispatch import is_excluded as _is_excluded
from mixprec.convert.dispatch import set_excluded as _set_excluded
from mixprec.convert.plan import CastPlan, Conversion, PlanRow, RowKind
from mixprec.convert.runtime import (
    LOW,
    Facts,
    ForwardBase,
    RuntimeForward,
    RuntimeListMode,
    any_nested,
    called,
    decision_table,
    hook_path_compiled,
    own_code_compiled,
    standing_aside,
)
from mixprec.convert.structure import (
    CONVERSION_ATTR,
    add_repr_note,
    eager_call,
    forward_of,
    owner,
    qualified_name,
    register,
    set_forward,
    set_forward_hooks,
    structural_copy,
    takes_hook_path,
    torch_forward,
    user_class,
)
from mixprec.policy import lists
from mixprec.policy.dtypes import dtype_name, is_castable
from mixprec.policy.levels import Level, Precision, Recipe
from mixprec.policy.ops import only_plain_tensors

__all__ = [
    "AutocastForward",
    "Fp32Forward",
    "ListedForward",
    "WhiteForward",
    "convert_autocast",
    "convert_o1",
]


#: Built-in modules whose forward picks a fused fast path from run-time values (eval
#: mode, no grad, a padding mask): they run their own code so the choice is PyTorch's.
FAST_PATH_MODULES: tuple[type[nn.Module], ...] = (nn.TransformerEncoder,)


def _cast_floating(
    call: tuple[tuple[Any, ...], dict[str, Any]], dtype: torch.dtype
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A call's floating arguments (not float64) cast to ``dtype``, as :func:`cast_arguments`."""

    def needs(leaf: torch.Tensor) -> bool:
        return is_castable(leaf) and leaf.dtype != dtype

    return _cast_call(call[0], call[1], dtype, needs)


class _Inside(threading.local):
    """How many autocast-level entries (a root, a submodule called directly) this thread
    is inside: a module called inside one keeps the autocast state its caller's code set."""

    def __init__(self) -> None:
        self.depth = 0  # (in each thread's own dict from the start: one guard under compile)


_INSIDE = _Inside()


def _first_parameter(module: nn.Module) -> torch.Tensor | None:
    return next(module.parameters(), None)


def call_device(
    module: nn.Module,
    probe: torch.Tensor | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    default: str,
) -> str:
    """The device type a call of ``module`` runs on (whose ``torch.autocast`` applies):
    its Parameters' as they are now (``probe`` is its first: ``.to()``, ``.cuda()`` and
    ``.cpu()`` move a Parameter in place), else (a module without Parameters) its first
    tensor argument's, else ``default`` (the device at conversion). ``"cuda"`` or
    ``"cpu"``, as the level's lists know only those two."""
    if _dynamo_compiling():  # (``probe`` would be a second path to the Parameter)
        probe = _first_parameter(module)
    if probe is None:
        probe = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
        if probe is None:
            return default
    return "cuda" if probe.is_cuda else "cpu"


class AutocastForward(ForwardBase):
    """A module's ``forward``: its own forward inside ``torch.autocast``.

    Inside the model (below an entry) it calls the forward directly, under the autocast
    state the code around it set: the region's, or the user's own ``torch.autocast``
    (disabled, or of another dtype), which holds for the children as under
    ``torch.autocast``. A direct call of the module (an entry point) enters the region. The
    root entered under the user's own ``torch.autocast`` warns once (inside the model the
    level's dtype and pins apply). A call with nested tensors (only a built-in fast path
    makes them; autocast has no kernels for them) and a module with a built-in fast path
    chosen from run-time values run their own code as written, autocast off, so PyTorch
    picks the fast path exactly as it would for the original. The region is the
    autocast of the device the call runs on (:func:`call_device`).
    """

    def __init__(
        self,
        module: nn.Module,
        device_type: str,
        dtype: torch.dtype,
        *,
        root: bool,
        under_fast_path: bool = False,
    ) -> None:
        super().__init__(module)
        self.device_type = device_type  # (at conversion: for a call with nothing to tell)
        self.probe = _first_parameter(module)
        self.dtype = dtype
        self.root = root
        self.as_written = isinstance(module, FAST_PATH_MODULES)
        self.may_get_nested = under_fast_path  # only a fast path makes nested tensors
        self.warned = False

    @eager_call
    def call_impl(self, module: nn.Module, /, *args: Any, **kwargs: Any) -> Any:
        # (through a keyword, not a default: TorchDynamo guards a default it reads)
        hooked = kwargs.pop("_mixprec_hooked", False) if kwargs else False
        if not hooked and takes_hook_path(module, self):
            return nn.Module._call_impl(module, *args, **kwargs)
        if (
            _INSIDE.depth
            and not self.root
            and not self.as_written
            and not (self.may_get_nested and any_nested(args, kwargs))
        ):  # inside the model: the autocast state the code around it set (the region's,
            # or the user's own torch.autocast, disabled or of another dtype, as under
            # torch.autocast)
            return (
                self.cls.forward(module, *args, **kwargs)
                if self.own is None
                else self.own(*args, **kwargs)
            )
        return self._enter(module, self, args, kwargs)

    @staticmethod
    def compiled_call(
        module: nn.Module,
        facts: Facts,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        hooked: bool,
        forward: ForwardBase | None,
        exact: bool,
    ) -> Any:
        if hook_path_compiled(module, facts, hooked):
            return nn.Module._call_impl(module, *args, **kwargs)
        if (
            _INSIDE.depth
            and not facts.root
            and not facts.as_written
            and not (facts.may_get_nested and any_nested(args, kwargs))
        ):  # inside the model (below, as in eager): its own code, read by its facts
            return own_code_compiled(module, facts, args, kwargs, forward)
        return called(module, forward)._enter(module, facts, args, kwargs)

    def _enter(
        self,
        module: nn.Module,
        facts: Facts | AutocastForward,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """A call that enters the region (the root, a submodule called directly), or a
        module that runs its own code as written."""
        inside = _INSIDE
        if facts.as_written or (facts.may_get_nested and any_nested(args, kwargs)):
            depth, inside.depth = inside.depth, 0  # children enter afresh
            device = call_device(module, self.probe, args, kwargs, self.device_type)
            try:
                with torch.autocast(device, enabled=False):
                    return (
                        self.cls.forward(module, *args, **kwargs)
                        if self.own is None
                        else self.own(*args, **kwargs)
                    )
            finally:
                inside.depth = depth
        if inside.depth and not facts.root:  # (inside the model, with nested tensors)
            return (
                self.cls.forward(module, *args, **kwargs)
                if self.own is None
                else self.own(*args, **kwargs)
            )
        device = call_device(module, self.probe, args, kwargs, self.device_type)
        if facts.root and not self.warned and torch.is_autocast_enabled(device):
            self.warned = True
            warn_outer_autocast()
        inside.depth += 1  # an entry: the root, or a submodule called directly
        try:
            with torch.autocast(device, self.dtype):
                return (
                    self.cls.forward(module, *args, **kwargs)
                    if self.own is None
                    else self.own(*args, **kwargs)
                )
        finally:
            inside.depth -= 1


def warn_outer_autocast() -> None:
    """The warning of a converted model's call under the user's own ``torch.autocast``
    (once per conversion)."""
    warn(
        "a model converted by mixprec runs under an outer torch.autocast: inside the "
        "model the level's own dtype, lists and float32 pins apply"
    )


def _outer_autocast() -> bool:
    """Whether a ``torch.autocast`` is on around a call entering an O1 model: one cheap
    check, then the devices' (inside another O1 call the first says yes: its region holds
    the autocast key of a backend this process lacks)."""
    return torch._C._is_any_autocast_enabled() and (
        torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")
    )


class Fp32Forward(ForwardBase):
    """A float32-pinned module's ``forward``: autocast off (on the device the call runs
    on), floating arguments cast up (also under an outer ``torch.autocast``)."""

    def __init__(self, module: nn.Module, device_type: str) -> None:
        super().__init__(module)
        self.device_type = device_type
        self.probe = _first_parameter(module)

    @eager_call
    def call_impl(self, module: nn.Module, /, *args: Any, **kwargs: Any) -> Any:
        # (through a keyword, not a default: TorchDynamo guards a default it reads)
        hooked = kwargs.pop("_mixprec_hooked", False) if kwargs else False
        _, hook_path = self.entry(module, hooked)
        if hook_path:
            return nn.Module._call_impl(module, *args, **kwargs)
        device = call_device(module, self.probe, args, kwargs, self.device_type)
        args, kwargs = _cast_floating((args, kwargs), torch.float32)
        with standing_aside(), torch.autocast(device, enabled=False):
            return (
                self.cls.forward(module, *args, **kwargs)
                if self.own is None
                else self.own(*args, **kwargs)
            )


class _RegionLocal(threading.local):
    """A thread's place in an O1 region, made when the thread first reads it (outside:
    depth 0), so a first call leaves it as it found it: a compiled first call's graph
    guards on it, and the next call matches that graph instead of compiling another."""

    def __init__(self) -> None:
        self.depth = 0
        self.mode: RuntimeListMode | None = None


class Region:
    """One O1 conversion's run-time state: the decision table its calls run under, and
    how deep this thread is inside a call of the model (0: outside)."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.table, self.default = decision_table(recipe, ())
        self.local = _RegionLocal()
        #: the white list's op names, and whether kernels at the dispatcher apply it
        #: (:mod:`mixprec.convert.dispatch`) rather than the mode
        self.names = frozenset(op for op in recipe.low_ops if isinstance(op, str))
        self.kernels = dispatch.supports(self.names)
        self.listed_key = dispatch.key()  # (what a call that makes its own casts excludes)
        self.key = register(self)  # (what a compiled call reads it by: see InRegion)
        self.warned = False  # (of an outer torch.autocast)

    def __getstate__(self) -> dict[str, Any]:
        return {"recipe": self.recipe}  # torch functions and thread state do not pickle

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["recipe"])  # type: ignore[misc]

    def mode(self) -> RuntimeListMode:
        """A call's state: its decisions and its casts (each value once per call)."""
        return RuntimeListMode(
            self.table, self.default, self.recipe.dtype, back=True, names=self.names
        )

    def applying(self, mode: RuntimeListMode) -> Any:
        """The context a call runs in under ``mode``: the white list's kernels (eager), or
        the mode itself (under ``torch.compile``, or a list with no kernels); under an
        outer ``torch.autocast``, with it off (:meth:`outer`)."""
        if _outer_autocast():  # (the one check per call of the model)
            return self.outer(mode)
        return self.list_context(mode)

    @contextlib.contextmanager
    def outer(self, mode: RuntimeListMode) -> Iterator[None]:
        """A call under the user's own ``torch.autocast`` (warned once): the autocast off
        inside, as the other levels keep their float32 modules, so O1's list decides:
        white-list ops in the level's dtype, cast back, every other op in float32."""
        if not self.warned:
            self.warned = True
            warn_outer_autocast()
        with (
            torch.autocast("cpu", enabled=False),
            torch.autocast("cuda", enabled=False),
            self.list_context(mode),
        ):
            yield

    def list_context(self, mode: RuntimeListMode) -> Any:
        """The white list's kernels (eager), or ``mode`` itself."""
        if self.kernels and not torch.compiler.is_compiling():
            return dispatch.ListRegion(mode)
        return mode


def _needs_up(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dtype in (torch.float16, torch.bfloat16)


def _up(tree: Any) -> Any:
    """Float16/bfloat16 tensors in ``tree`` (a result) cast to float32, float32 and
    float64 kept; ``tree`` itself when nothing needs a cast (no container is rebuilt)."""
    if isinstance(tree, torch.Tensor):
        return tree.to(torch.float32) if _needs_up(tree) else tree
    if not _holds_low(tree):
        return tree
    return pytree.tree_map(lambda leaf: leaf.to(torch.float32) if _needs_up(leaf) else leaf, tree)


def _holds_low(tree: Any) -> bool:
    """Whether a float16/bfloat16 tensor is in ``tree``: tuples, lists and dicts (a
    transformers output among them) walked directly, anything else by its pytree leaves."""
    if isinstance(tree, torch.Tensor):
        return _needs_up(tree)
    if isinstance(tree, (tuple, list)):
        return any(_holds_low(item) for item in tree)
    if isinstance(tree, dict):
        return any(_holds_low(item) for item in tree.values())
    if tree is None or isinstance(tree, (int, float, bool, str)):
        return False
    return any(_needs_up(leaf) for leaf in pytree.tree_leaves(tree))


def cast_arguments(value: Any, dtype: torch.dtype, needs: Callable[[Any], bool]) -> Any:
    """``value`` (an argument) with the tensors ``needs`` picks cast to ``dtype``: the
    argument itself or inside (nested) tuples. Lists, dicts and other objects are passed
    as they are, the same objects (a KV cache or list the forward appends to stays the
    caller's)."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if needs(value) else value
    if type(value) is tuple:
        return tuple(cast_arguments(item, dtype, needs) for item in value)
    return value


def _cast_call(
    args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype, needs: Callable[[Any], bool]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (
        tuple(cast_arguments(a, dtype, needs) for a in args),
        {k: cast_arguments(v, dtype, needs) for k, v in kwargs.items()},
    )


def _all_float32(values: Any) -> bool:
    """No argument needs casting up (checked without walking containers)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.dtype in (torch.float16, torch.bfloat16):
                return False
        elif type(value) is tuple:
            return False  # let cast_arguments look inside
    return True


class InRegion(ForwardBase):
    """A forward of an O1 module, one of a region's. Under ``torch.compile`` a call reads
    its module and its region by their keys (:func:`~mixprec.convert.structure.owner`):
    every module's forward holds the one region, which TorchDynamo would otherwise guard
    as an alias pair per module."""

    def __init__(self, module: nn.Module, region: Region) -> None:
        super().__init__(module)
        self.region = region
        self.region_key = region.key

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        del state["region_key"]  # (the copy's region has a key of its own)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.region_key = self.region.key


class ListedForward(InRegion):
    """An O1 module's ``forward``: its own forward, under the region's list when called
    from outside the model (an entry point: the root or a submodule called directly),
    its float16/bfloat16 arguments cast up and its floating results returned float32."""

    def __init__(self, module: nn.Module, region: Region, *, under_fast_path: bool) -> None:
        super().__init__(module, region)
        self.as_written = isinstance(module, FAST_PATH_MODULES)
        self.may_get_nested = under_fast_path  # only a fast path makes nested tensors
        #: an ``nn.ReLU`` whose one call (white at O1) is made here, without its kernel
        self.relu = (
            self.cls.forward is nn.ReLU.forward
            and torch_forward(nn.ReLU)
            and "relu" in region.names
            and self.own is None
        )

    @eager_call
    def call_impl(self, module: nn.Module, /, *args: Any, **kwargs: Any) -> Any:
        # (through a keyword, not a default: TorchDynamo guards a default it reads)
        hooked = kwargs.pop("_mixprec_hooked", False) if kwargs else False
        region = self.region
        slots = module.__dict__  # (takes_hook_path, inline: the hot call)
        if not hooked and (
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
            return nn.Module._call_impl(module, *args, **kwargs)
        local = region.local
        if (
            local.depth
            and not self.as_written
            and not (self.may_get_nested and any_nested(args, kwargs))
        ):  # inside the model: the region's mode is active
            if (
                self.relu
                and region.kernels
                and len(args) == 1
                and not kwargs
                and not module.inplace
                and self.cls.forward is _RELU_FORWARD  # (not patched since)
            ):
                out = _direct_relu(local.mode, args[0], region.listed_key)
                if out is not NotImplemented:
                    return out
            return (
                self.cls.forward(module, *args, **kwargs)
                if self.own is None
                else self.own(*args, **kwargs)
            )
        return self._enter(module, region, self, args, kwargs)

    @staticmethod
    def compiled_call(
        module: nn.Module,
        facts: Facts,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        hooked: bool,
        forward: ForwardBase | None,
        exact: bool,
    ) -> Any:
        region = owner(facts.region_key)
        if hook_path_compiled(module, facts, hooked):
            return nn.Module._call_impl(module, *args, **kwargs)
        if (
            region.local.depth
            and not facts.as_written
            and not (facts.may_get_nested and any_nested(args, kwargs))
        ):  # inside the model (below, as in eager; the mode applies the list)
            return own_code_compiled(module, facts, args, kwargs, forward)
        return called(module, forward)._enter(module, region, facts, args, kwargs)

    def _enter(
        self,
        module: nn.Module,
        region: Region,
        facts: Facts | ListedForward,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """A call that enters the region (the root, a submodule called directly), or a
        module that runs its own code as written."""
        local = region.local
        if facts.as_written or (facts.may_get_nested and any_nested(args, kwargs)):
            depth, local.depth = local.depth, 0  # children enter afresh
            try:
                with standing_aside():
                    return (
                        self.cls.forward(module, *args, **kwargs)
                        if self.own is None
                        else self.own(*args, **kwargs)
                    )
            finally:
                local.depth = depth
        if not (_all_float32(args) and _all_float32(kwargs.values())):
            args, kwargs = _cast_call(args, kwargs, torch.float32, _needs_up)
        local.depth, local.mode = 1, region.mode()
        try:
            with region.applying(local.mode):
                out = (
                    self.cls.forward(module, *args, **kwargs)
                    if self.own is None
                    else self.own(*args, **kwargs)
                )
        finally:
            local.depth, local.mode = 0, None
        return out if isinstance(out, torch.Tensor) and out.dtype == torch.float32 else _up(out)


class WhiteForward(InRegion):
    """An O1 white-list module's ``forward``: it computes low, and its result is cast back
    to float32 for its caller after its forward hooks (the last of them,
    :class:`CastBackLast`; with no hook, here), so the hooks see the low result as under
    ``torch.autocast``. Called directly it answers the same (a checkpointed
    recomputation calls submodules directly: it must compute what the forward did).

    ``inner`` runs it: None for a one-call layer (its white-list call decided by the
    region's mode, the result kept low) and, with ``inputs_low``, for a subclass of a
    built-in layer with a ``forward`` of its own (torchao's ``Float8Linear``,
    transformers' ``FalconLinear``: floating inputs cast down, its own code run under the
    list, where a tensor subclass of its own, such as torchao's float8 tensors, keeps its
    rules); a forced-low :class:`~mixprec.convert.runtime.RuntimeForward` for a module run
    whole in low precision.
    """

    def __init__(
        self,
        module: nn.Module,
        region: Region,
        inner: Callable[..., Any] | None,
        *,
        inputs_low: bool = False,
    ) -> None:
        super().__init__(module, region)
        self.inner = inner
        self.inputs_low = inputs_low
        #: a built-in layer whose one call is made here, without its operator's kernel
        one_call = inner is None and not inputs_low and self.own is None
        self.direct = _direct_kind(module) if one_call else None
        #: its class's ``forward`` at conversion: a class patched since runs its own code
        self.class_forward = self.cls.forward

    @eager_call
    def call_impl(self, module: nn.Module, /, *args: Any, **kwargs: Any) -> Any:
        # (through a keyword, not a default: TorchDynamo guards a default it reads)
        hooked = kwargs.pop("_mixprec_hooked", False) if kwargs else False
        region = self.region
        if not hooked:
            slots = module.__dict__  # (takes_hook_path, inline: the hot call)
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
                return nn.Module._call_impl(module, *args, **kwargs)
            local = region.local
            running = local.mode
            if (
                local.depth
                and running is not None
                and self.direct is not None
                and len(args) == 1
                and not kwargs
                and region.kernels
                and not _compiler._is_compiling_flag
            ):  # the hot path: inside the model, no hooks
                out = self._direct(module, running, args[0])
                if out is not NotImplemented:
                    return running.cast_back_eager(out)
                out = self._run(module, region, running, args, kwargs, direct=False)
                return self._finish(module, running, out)
        return self._call(module, region, args, kwargs)

    @staticmethod
    def compiled_call(
        module: nn.Module,
        facts: Facts,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        hooked: bool,
        forward: ForwardBase | None,
        exact: bool,
    ) -> Any:
        region = owner(facts.region_key)
        if hook_path_compiled(module, facts, hooked):
            return nn.Module._call_impl(module, *args, **kwargs)
        running = region.local.mode
        if region.local.depth and running is not None:
            return _white_compiled(module, facts, region, running, args, kwargs, forward)
        return called(module, forward)._call(module, region, args, kwargs)

    def _call(
        self, module: nn.Module, region: Region, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """A call with no one-call short cut: inside the model, or entering the region."""
        local = region.local
        running = local.mode
        if local.depth and running is not None:  # inside the model
            return self._finish(module, running, self._run(module, region, running, args, kwargs))
        mode = region.mode()
        local.depth, local.mode = 1, mode
        try:
            with region.applying(mode):
                return self._finish(module, mode, self._run(module, region, mode, args, kwargs))
        finally:
            local.depth, local.mode = 0, None

    def _finish(self, module: nn.Module, mode: RuntimeListMode, out: Any) -> Any:
        if module._forward_hooks or _global_forward_hooks:
            return out  # CastBackLast casts it back after the hooks
        return mode.cast_back(out)

    def _run(
        self,
        module: nn.Module,
        region: Region,
        mode: RuntimeListMode,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        direct: bool = True,  # (False: the caller's direct call declined already)
    ) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        if self.inputs_low:  # a layer subclass with its own code, which runs under the list
            args, kwargs = _inputs_down(mode, region.recipe.dtype, args, kwargs)
            return (
                self.cls.forward(module, *args, **kwargs)
                if self.own is None
                else self.own(*args, **kwargs)
            )
        if (
            direct
            and self.direct is not None
            and not kwargs
            and len(args) == 1
            and self.region.kernels
            and not (_dynamo_compiling() or _compiler._is_compiling_flag)
        ):
            out = self._direct(module, mode, args[0])
            if out is not NotImplemented:
                return out
        mode.back = False  # the layer's one white-list call keeps its result low
        try:
            return (
                self.cls.forward(module, *args, **kwargs)
                if self.own is None
                else self.own(*args, **kwargs)
            )
        finally:
            mode.back = True

    def _direct(self, module: Any, mode: RuntimeListMode, x: Any) -> Any:
        """The layer's one call (``F.linear``, a convolution), its operands cast down
        here as its operator's kernel would cast them, with no kernel: the same casts, the
        same result (low), one Python call fewer. NotImplemented where the kernel decides
        (a tensor subclass, a padding mode of its own). Eager, with the list's kernels
        only: the callers check."""
        # read directly: ``module.weight`` takes a Python call (``.get``'s default would
        # make that call every time)
        params = module._parameters
        weight = params["weight"] if "weight" in params else module.weight  # noqa: SIM401
        bias = params["bias"] if "bias" in params else module.bias  # noqa: SIM401
        if self.cls.forward is not self.class_forward:
            return NotImplemented  # (its class patched since conversion: its code decides)
        if (
            type(x) is not torch.Tensor
            or type(weight) is not nn.Parameter
            or (bias is not None and type(bias) is not nn.Parameter)
        ) and not (isinstance(x, torch.Tensor) and only_plain_tensors((x, weight, bias), {})):
            return NotImplemented
        direct = self.direct
        if direct == "conv" and module.padding_mode != "zeros":
            return NotImplemented
        down = mode.down
        key = self.region.listed_key
        aside = _is_excluded(key)  # (a child's own casts around it: already excluded)
        if not aside:
            _set_excluded(key, True)
        try:
            x, weight = down(x), down(weight)
            if bias is not None:
                bias = down(bias)
            if direct == "linear":
                return F.linear(x, weight, bias)
            return module._conv_forward(x, weight, bias)
        finally:
            if not aside:
                _set_excluded(key, False)


def _inputs_down(
    mode: RuntimeListMode, dtype: torch.dtype, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A white-list layer subclass's tensor arguments (or in tuples) cast down to ``dtype``
    once per call, for its own code (:class:`WhiteForward`'s ``inputs_low``)."""

    def down(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return mode.cast_value(value, dtype)
        return tuple(map(down, value)) if type(value) is tuple else value

    return tuple(map(down, args)), {k: down(v) for k, v in kwargs.items()}


def _white_compiled(
    module: nn.Module,
    facts: Facts,
    region: Region,
    mode: RuntimeListMode,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    forward: Any = None,
) -> Any:
    """A :class:`WhiteForward` inside the model under ``torch.compile`` (no hooks): what
    its ``_run`` and ``_finish`` do there, its decisions read from ``facts`` (an attribute
    of the forward read in the traced code is a guard per module, and its region a second
    path to the region, guarded as an alias in Python)."""
    if facts.inner:
        out = called(module, forward).inner(*args, **kwargs)
    elif facts.inputs_low:
        args, kwargs = _inputs_down(mode, region.recipe.dtype, args, kwargs)
        out = own_code_compiled(module, facts, args, kwargs, forward)
    else:  # the layer's one white-list call keeps its result low
        out = _kept_low(module, facts, mode, args, kwargs, forward)
    if module._forward_hooks or _global_forward_hooks:
        return out  # CastBackLast casts it back after the hooks
    return mode.cast_back(out)


def _kept_low(
    module: nn.Module,
    facts: Facts,
    mode: RuntimeListMode,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    forward: Any,
) -> Any:
    """A one-call white-list layer's own code under ``torch.compile``, its white-list
    call's result kept low: the running mode, on top of the stack, set aside for an equal
    one that casts nothing back (toggling the mode's ``back`` is a mutation TorchDynamo
    refuses inside a checkpointed block's body). With no mode of O1's on top (the layer's
    call reached from a frame compiled on its own, inside an eager call), ``mode.back``
    is switched off around the call, which the white list's kernels read."""
    depth = torch._C._len_torch_function_stack()
    if depth and isinstance(torch._C._get_function_stack_at(depth - 1), RuntimeListMode):
        top = torch._C._pop_torch_function_stack()
        try:
            with top.again(back=False):
                return own_code_compiled(module, facts, args, kwargs, forward)
        finally:
            torch._C._push_on_torch_function_stack(top)
    mode.back = False
    try:
        return own_code_compiled(module, facts, args, kwargs, forward)
    finally:
        mode.back = True


class CastBackLast(collections.OrderedDict):
    """A one-call white-list layer's ``_forward_hooks``: the user's hooks, then (as the
    last hook, whatever is registered later) the cast of the layer's result back to
    float32 (remembered by the running call's mode, so the next white-list op takes the
    low original)."""

    def __init__(self, hooks: dict[int, Any], region: Region) -> None:
        super().__init__(hooks)
        self.region = region

    def __reduce__(self) -> tuple[Any, ...]:
        return (CastBackLast, (dict(self), self.region))

    def items(self) -> Any:
        yield from super().items()
        yield (-1, self._cast_back)

    def _cast_back(self, module: nn.Module, args: Any, output: Any) -> Any:
        local = self.region.local
        mode = local.mode if getattr(local, "depth", 0) else None
        return _up(output) if mode is None else mode.cast_back(output)


#: Built-in white-list layers whose ``forward`` is one call of a white-list function: at
#: O1 the call is decided by the function, so the layer needs no forward of its own.
_ONE_CALL_LAYERS: tuple[tuple[type[nn.Module], Callable[..., Any]], ...] = (
    (nn.Linear, F.linear),
    (nn.Bilinear, F.bilinear),
    (nn.Conv1d, F.conv1d),
    (nn.Conv2d, F.conv2d),
    (nn.Conv3d, F.conv3d),
    (nn.ConvTranspose1d, F.conv_transpose1d),
    (nn.ConvTranspose2d, F.conv_transpose2d),
    (nn.ConvTranspose3d, F.conv_transpose3d),
)


#: ``nn.ReLU``'s forward at import (what :func:`_direct_relu` stands in for)
_RELU_FORWARD = nn.ReLU.forward


def _direct_relu(mode: RuntimeListMode | None, x: Any, key: Any) -> Any:
    """``nn.ReLU``'s one call as its kernel makes it (input cast down once per call, result
    cast back), with no kernel; NotImplemented where the kernel decides."""
    if (
        mode is None
        or _dynamo_compiling()
        or _compiler._is_compiling_flag
        or not (
            type(x) is torch.Tensor
            or (isinstance(x, torch.Tensor) and only_plain_tensors((x,), {}))
        )
    ):
        return NotImplemented
    aside = _is_excluded(key)  # (as in WhiteForward._direct)
    if not aside:
        _set_excluded(key, True)
    try:
        out = torch.relu(mode.down(x))
        if not mode.back:
            return out
        return mode.cast_back_eager(out) if type(out) is torch.Tensor else mode.cast_back(out)
    finally:
        if not aside:
            _set_excluded(key, False)


def _direct_kind(module: nn.Module) -> str | None:
    """``"linear"`` for an ``nn.Linear``, ``"conv"`` for an ``nn.Conv1d/2d/3d``, running
    their class's own forward (their one call :meth:`WhiteForward._direct` makes)."""
    cls = type(module)
    if not torch_forward(cls):
        return None
    if cls is nn.Linear:
        return "linear"
    return "conv" if cls in (nn.Conv1d, nn.Conv2d, nn.Conv3d) else None


class O1Kind(enum.Enum):
    """How O1 runs one white-list module."""

    ONE_CALL = "one white-list call"
    INPUTS_LOW = "inputs cast down, its own code"
    WHOLE = "runs whole in low precision"


def o1_kind(module: nn.Module, region: Region) -> O1Kind:
    """How O1 runs ``module``, a module on the recipe's white list."""
    for cls, function in _ONE_CALL_LAYERS:
        if isinstance(module, cls):
            if (
                type(module).forward is not cls.forward
                or not torch_forward(cls)
                or "forward" in module.__dict__
            ):  # a forward of its own (its class's, its instance's, one patched on ``cls``)
                return O1Kind.INPUTS_LOW
            if region.table.get(function) == LOW:
                return O1Kind.ONE_CALL
    return O1Kind.WHOLE


def convert_o1(network: nn.Module, recipe: Recipe) -> nn.Module:
    """The structural copy of ``network`` whose modules run O1 at run time (see the
    module docstring); :func:`mixprec.explain` reads its plan."""
    root = structural_copy(network)
    region = Region(recipe)
    answers = recipe.module_precisions(root)  # the one policy: fp32, low, or its ops decide
    seen: set[int] = set()
    for path, module, scopes in _walk(root, "", (("", root),)):
        if id(module) in seen:
            continue
        seen.add(id(module))
        here = answers[path]
        parent = answers[scopes[-2][0]] if len(scopes) > 1 else None
        if here is Precision.FP32:  # a float32 pin, a parametrization (its math: float32)
            set_forward(module, Fp32Forward(module, recipe.device_type))
        elif here is Precision.LOW and parent is Precision.LOW:  # inside a low module
            set_forward(module, RuntimeForward(module, recipe, scopes, None, Precision.LOW))
        elif here is Precision.LOW:  # a white-list module or a low pin
            kind = o1_kind(module, region)
            pinned = recipe.pinned(module, path) is Precision.LOW
            inner: Callable[..., Any] | None = None
            if pinned or kind is O1Kind.WHOLE:
                reason = O1Kind.WHOLE.value
                inner = RuntimeForward(module, recipe, scopes, None, Precision.LOW, reason)
            inputs_low = kind is O1Kind.INPUTS_LOW and not pinned
            set_forward(module, WhiteForward(module, region, inner, inputs_low=inputs_low))
            set_forward_hooks(module, CastBackLast(module._forward_hooks, region))
        elif type(module).forward is not nn.Module.forward:
            under = any(isinstance(m, FAST_PATH_MODULES) for _, m in scopes[:-1])
            set_forward(module, ListedForward(module, region, under_fast_path=under))
    root.__dict__[CONVERSION_ATTR] = Conversion(recipe, static_plan(root, recipe))
    add_repr_note(root, f"mixprec: {recipe.describe()}")
    return root


def _precision(recipe: Recipe, scopes: Scopes) -> Precision | None:
    """A pin in scope, or LOW for a module run whole in low precision."""
    for path, module in reversed(scopes):
        pin = recipe.pinned(module, path)
        if pin is not None:
            return pin
    if any(isinstance(m, recipe.unit_modules) for _, m in scopes):
        return Precision.LOW
    return None


Scopes = tuple[tuple[str, nn.Module], ...]


def _walk(module: nn.Module, path: str, scopes: Scopes) -> Iterator[tuple[str, nn.Module, Scopes]]:
    """Every module with its qualified name and enclosing modules (shared ones per place)."""
    yield path, module, scopes
    for name, child in module._modules.items():
        if child is not None:
            child_path = f"{path}.{name}" if path else name
            yield from _walk(child, child_path, (*scopes, (child_path, child)))


def convert_autocast(network: nn.Module, recipe: Recipe) -> nn.Module:
    """The structural copy of ``network`` whose modules run under ``torch.autocast``
    (see the module docstring); :func:`mixprec.explain` reads its plan."""
    root = structural_copy(network)
    seen: set[int] = set()
    for _, module, scopes in _walk(root, "", (("", root),)):
        if id(module) in seen:
            continue
        seen.add(id(module))
        precision = _precision(recipe, scopes)
        if precision is Precision.FP32:
            set_forward(module, Fp32Forward(module, recipe.device_type))
        elif precision is Precision.LOW:  # a low pin, a recurrent layer or attention: whole low
            reason = "runs whole in low precision"
            set_forward(module, RuntimeForward(module, recipe, scopes, None, Precision.LOW, reason))
        elif type(module).forward is not nn.Module.forward:
            set_forward(
                module,
                AutocastForward(
                    module,
                    recipe.device_type,
                    recipe.dtype,
                    root=module is root,
                    under_fast_path=any(isinstance(m, FAST_PATH_MODULES) for _, m in scopes[:-1]),
                ),
            )
    root.__dict__[CONVERSION_ATTR] = Conversion(recipe, static_plan(root, recipe))
    add_repr_note(root, f"mixprec: {recipe.describe()}")
    return root


#: The op a built-in module runs (what its row in the static plan is decided by).
_MODULE_OPS: tuple[tuple[type[nn.Module], str], ...] = (
    (nn.Linear, "linear"),
    (nn.Bilinear, "bilinear"),
    (nn.Conv1d, "conv1d"),
    (nn.Conv2d, "conv2d"),
    (nn.Conv3d, "conv3d"),
    (nn.ConvTranspose1d, "conv_transpose1d"),
    (nn.ConvTranspose2d, "conv_transpose2d"),
    (nn.ConvTranspose3d, "conv_transpose3d"),
    (nn.LayerNorm, "layer_norm"),
    (nn.GroupNorm, "group_norm"),
    (nn.Embedding, "embedding"),
    *lists.MODULE_OPS,
)


def static_plan(root: nn.Module, recipe: Recipe) -> CastPlan:
    """The module-level view of the plan: a row per built-in one-op module (what
    ``torch.autocast`` computes it in, the weights it casts at use) and per module run
    whole in low precision, in module order (a shared module once per place).
    ``explain(model, *inputs)`` gives the casts a forward with those inputs makes."""
    rows: list[PlanRow] = []
    runtime: list[tuple[str, str]] = []
    low = recipe.dtype
    inside_unit: set[int] = set()
    for path, module, scopes in _walk(root, "", (("", root),)):
        if any(id(m) in inside_unit for _, m in scopes[:-1]):
            continue
        forward = forward_of(module)
        if isinstance(forward, WhiteForward) and forward.inner is not None:
            forward = forward.inner
        if isinstance(forward, RuntimeForward):
            inside_unit.add(id(module))
            rows.append(unit_weight_rows(module, path, recipe, inputs=True))
            continue
        if isinstance(forward, WhiteForward) and forward.inputs_low:
            rows.append(
                PlanRow.make(
                    path,
                    type(module).__name__,
                    low,
                    [("floating inputs", low)],
                    [("floating outputs", torch.float32)],
                    kind=RowKind.UNIT,
                    note="its own code decides its weights",
                )
            )
            inside_unit.add(id(module))
            continue
        if isinstance(forward, (AutocastForward, ListedForward)) and forward.as_written:
            reason = "has a built-in fast path chosen from run-time values; runs its own code"
            runtime.append((path, reason))
            rows.append(
                PlanRow.make(
                    path, type(module).__name__, "float32", kind=RowKind.RUNTIME, note=reason
                )
            )
        op = next((name for cls, name in _MODULE_OPS if user_class(module) is cls), None)
        if op is None:
            continue
        precision = (
            Precision.FP32 if isinstance(forward, Fp32Forward) else recipe.decide(op, scopes)
        )
        if precision is Precision.LOW:
            weights = [
                (f"{path}.{n}" if path else n, low)
                for n, p in module.named_parameters(recurse=False)
                if is_castable(p)
            ]
            rows.append(PlanRow.make(path, op, low, weights, kind=RowKind.MODULE))
        else:
            follows = precision is Precision.FOLLOW and recipe.level is not Level.O1
            shown = "follows inputs" if follows else "float32"
            rows.append(PlanRow.make(path, op, shown, kind=RowKind.MODULE))
    return CastPlan(
        level=recipe.level.value,
        dtype=dtype_name(low),
        rows=tuple(rows),
        runtime_parts=tuple(p for p, _ in runtime),
        runtime_reasons=tuple(r for _, r in runtime),
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
