"""float32 master weights for a model that holds low-precision Parameters.

Under O2/O3 training the converted model computes with low-precision Parameters of its
own, so no weight is cast in the forward pass. The user's Parameters (the ones the
optimizer was built on) become the float32 *masters*:

1. after each backward, low-precision gradients are moved onto the masters and
   accumulated there in float32 (:meth:`MasterWeights.collect_grads`, fused foreach copies);
2. the optimizer steps the masters, exactly as it would without mixprec (a fused
   ``AdamW(fused=True)`` or a foreach optimizer steps them with its fused kernels);
3. the low-precision copies are refreshed from the masters (:meth:`MasterWeights.refresh`,
   one ``_foreach_copy_`` per dtype).

Hooks on the user's Parameters run as on the original model, once per backward: a
``register_hook`` hook on the float32 gradient (what it returns replaces it), then a
``register_post_accumulate_grad_hook`` hook once the master's ``.grad`` holds it (both after
the backward, when the gradients reach the masters).

One source of truth, the masters: before every forward of the converted model (through
the step, called directly, or a submodule of it called directly), :meth:`MasterWeights.sync`
copies every master into its low copy (one ``_foreach_copy_`` per dtype), so any write to a
master is seen, also one that bumps no version counter (``p.data.mul_()``, ``p.data.clamp_()``
as in WGAN weight clipping, a fused optimizer's kernel). The low copies are
:class:`LowParameter` objects, whose ``.data`` shares their version counter: a write to a low
copy (``step.network[0].weight.data.mul_()``, in place, ``load_state_dict`` with
low-precision values) bumps it and is copied up to the master instead (when both copies were
written, the master's write wins unless it bumped no counter). The copy down goes through an
alias with a counter of its own, so a forward of a second micro-batch does not invalidate the
graph of the first (a pipeline schedule). ``requires_grad`` is compared on both copies too
(freezing or unfreezing either copy after the build freezes or unfreezes both). Loading
higher-precision values into ``step.network`` writes them to the masters directly, so
nothing is lost to the low dtype; ``step.network.state_dict()`` holds the float32 masters.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.convert.cast_at_use import CastState, low_precision_parameters
from mixprec.convert.structure import forward_of
from mixprec.training.grads import _NoGrad

__all__ = ["LowParameter", "MasterWeights"]

#: the C ``.data`` getter and setter (a read gives a fresh version counter)
_DATA: Any = vars(torch._C.TensorBase)["data"]


class LowParameter(nn.Parameter):
    """A master's low-precision copy in the converted model. ``.data`` is ``detach()``, which
    shares this Parameter's version counter, so a write through it is seen (the plain
    ``.data`` has a counter of its own); ``isinstance(p, nn.Parameter)`` holds. ``master`` is
    the float32 Parameter it copies."""

    master: torch.Tensor | None

    @property
    def data(self) -> torch.Tensor:
        return self.detach()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """A value of another dtype (``vector_to_parameters`` of a float32 vector) goes to
        the master as it is and to this copy cast: the copy keeps its dtype."""
        master = getattr(self, "master", None)
        if master is not None and value.dtype != self.dtype:
            _DATA.__set__(master, value.to(master.dtype))
        _DATA.__set__(self, value.to(self.dtype))

    def __deepcopy__(self, memo: dict[int, Any]) -> LowParameter:
        if id(self) in memo:
            return memo[id(self)]
        result: LowParameter = super().__deepcopy__(memo)
        result.master = copy.deepcopy(getattr(self, "master", None), memo)
        return result

    def __reduce_ex__(self, protocol: Any) -> Any:
        rebuild, args = super().__reduce_ex__(protocol)[:2]
        return (_rebuild_low, (rebuild, args))


def _rebuild_low(rebuild: Any, args: tuple[Any, ...]) -> LowParameter:
    """Unpickle a :class:`LowParameter` (``nn.Parameter``'s rebuild, then the class)."""
    param = rebuild(*args)
    param.__class__ = LowParameter
    return param


def _alias(low: torch.Tensor) -> torch.Tensor:
    """``low``'s storage under a version counter of its own: the copy down writes through it."""
    alias: torch.Tensor = _DATA.__get__(low)
    return alias


def _key(t: torch.Tensor) -> tuple[int, int]:
    return (t._version, t.data_ptr())


class MasterWeights:
    """Pairs of (float32 master, low-precision model Parameter).

    With ``masters_are_stepped`` (master weights, the default) the masters are the truth
    and every forward copies them down; without (``master_weights=False``: the optimizer
    steps the low copies) only writes that bump a version counter are reconciled, and the
    low copies are copied up to the user's Parameters after every optimizer step."""

    def __init__(
        self, pairs: list[tuple[nn.Parameter, nn.Parameter]], *, masters_are_stepped: bool = True
    ) -> None:
        self.masters: list[torch.Tensor] = [master for master, _ in pairs]
        self.lows: list[torch.Tensor] = [low for _, low in pairs]
        self.masters_are_stepped = masters_are_stepped
        # float32 gradient buffers, allocated once: a fresh allocation every step costs
        # more than the copy (page faults)
        self._buffers: list[torch.Tensor] = []
        self._accumulating = False
        self._has_grad: list[bool] = []
        self._seen: list[tuple[int, int, int, int, bool, bool]] = []
        self._aliases: list[torch.Tensor] = []
        self._storages: list[int] | None = None  # the low copies' data pointers, as aliased
        #: requires_grad as last agreed by both copies (a change to either one wins)
        self._trained = [master.requires_grad for master in self.masters]
        self._record()

    @classmethod
    def install(cls, converted: nn.Module, *, masters_are_stepped: bool = True) -> MasterWeights:
        """Give every Parameter ``converted`` casts at use a low-precision Parameter of
        its own; the float32 ones become the masters. Refuses anything but float32.

        Without ``masters_are_stepped`` the optimizer steps the low copies: they are plain
        ``nn.Parameter`` objects then (torch's optimizers pick foreach kernels only for those)."""
        records = low_precision_parameters(converted)
        slots = [(record.owner, record.name) for record in records]
        lows: dict[int, nn.Parameter] = {}
        pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        kind = LowParameter if masters_are_stepped else nn.Parameter
        for owner, name, master, dtype in records:
            if not isinstance(master, nn.Parameter) or master.dtype == dtype:
                continue
            low = lows.get(id(master))
            if low is None:
                low = kind(master.detach().to(dtype), requires_grad=master.requires_grad)
                if isinstance(low, LowParameter):
                    low.master = master
                lows[id(master)] = low
                pairs.append((master, low))
            setattr(owner, name, low)
        masters = cls(pairs, masters_are_stepped=masters_are_stepped)
        masters._hook_loading(slots, {id(low): master for master, low in pairs})
        converted.register_forward_pre_hook(masters._sync_hook)  # every entry sees the truth
        call = forward_of(converted)
        state = getattr(call, "state", None)
        if isinstance(state, CastState):
            state.on_direct_call = masters.sync  # a submodule called directly, too
        return masters

    def _sync_hook(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            self._sync_eagerly()
        else:
            self.sync()  # (eager: no compiler wrapper to go through on every forward)

    @torch.compiler.disable  # eager under torch.compile: it reads version counters
    def _sync_eagerly(self) -> None:
        self.sync()

    def _hook_loading(
        self, slots: Sequence[tuple[nn.Module, str]], master_of: dict[int, Any]
    ) -> None:
        owners: dict[int, tuple[nn.Module, list[str]]] = {}
        for owner, name in slots:
            owners.setdefault(id(owner), (owner, []))[1].append(name)
        for owner, names in owners.values():
            hook = functools.partial(_load_masters_first, names, master_of)
            owner.register_load_state_dict_pre_hook(hook)
            owner.register_state_dict_post_hook(functools.partial(_save_masters, names, master_of))

    # ---------------------------------------------------------------- one source of truth
    def _record(self) -> None:
        """Note each pair's version counters, storages and agreed ``requires_grad`` (what
        :meth:`sync` compares with); a low copy whose storage is new gets a new alias."""
        pairs = zip(self.masters, self.lows, self._trained, strict=True)
        self._seen = seen = [
            (m._version, m.data_ptr(), low._version, low.data_ptr(), trained, trained)
            for m, low, trained in pairs
        ]
        storages = [entry[3] for entry in seen]
        if storages != self._storages:
            self._aliases = [_alias(low) for low in self.lows]
            self._storages = storages

    def _now(self) -> list[tuple[int, int, int, int, bool, bool]]:
        """What :meth:`_record` notes, as the copies are now."""
        return [
            (
                m._version,
                m.data_ptr(),
                low._version,
                low.data_ptr(),
                m.requires_grad,
                low.requires_grad,
            )
            for m, low in zip(self.masters, self.lows, strict=True)
        ]

    def sync(self) -> None:
        """Reconcile outside writes before a forward: a low copy written since the last
        forward (its version counter moved, its master's did not) is copied up to its
        master; every other master is copied down (with master weights; without, only
        the ones whose counter moved). Not while a backward recomputes a checkpointed
        forward: that computes with the weights of the forward it replays."""
        if torch._C._current_graph_task_id() != -1:
            return
        with _NoGrad():
            if self._now() == self._seen:  # the usual case: nothing written since the last step
                if self.masters_are_stepped and self.lows:  # (a write that moved no counter)
                    torch._foreach_copy_(self._aliases, self.masters)
                return
            changed = False
            down: list[int] = []
            for i, (master, low) in enumerate(zip(self.masters, self.lows, strict=True)):
                if master.requires_grad != low.requires_grad:  # frozen or unfrozen after build
                    if master.requires_grad != self._trained[i]:
                        low.requires_grad_(master.requires_grad)
                    else:
                        master.requires_grad_(low.requires_grad)
                if master.requires_grad != self._trained[i]:
                    self._trained[i] = master.requires_grad
                    changed = True
                seen = self._seen[i]
                if _key(master) != seen[:2]:
                    down.append(i)
                    changed = True
                elif _key(low) != seen[2:4]:
                    master.copy_(low)
                    changed = True
                elif self.masters_are_stepped:  # a write that moved no counter: copy anyway
                    down.append(i)
            if changed:
                self._record()
            if down:
                torch._foreach_copy_(
                    [self._aliases[i] for i in down], [self.masters[i] for i in down]
                )

    # ---------------------------------------------------------------- gradients
    def collect_grads(self) -> None:
        """Move the low-precision gradients onto the masters, in float32, and clear them
        (after every backward, so micro-batches accumulate in float32)."""
        with _NoGrad():
            masters, lows, buffers = self.masters, self.lows, self._buffers
            if len(buffers) != len(masters):
                buffers = self._buffers = [
                    torch.zeros_like(m, dtype=torch.float32) for m in masters
                ]
            if not self._accumulating:
                self._has_grad = [False] * len(masters)
            has_grad = self._has_grad
            moved: list[int] = []
            add_to: list[torch.Tensor] = []
            add_from: list[torch.Tensor] = []
            copy_to: list[torch.Tensor] = []
            copy_from: list[torch.Tensor] = []
            for i, low in enumerate(lows):
                grad = low.grad
                if grad is None:
                    continue
                master = masters[i]
                if grad.is_sparse:  # nn.Embedding(sparse=True)
                    sparse = grad.float()
                    master_grad = master.grad
                    master.grad = (
                        sparse if not has_grad[i] or master_grad is None else master_grad + sparse
                    )
                    has_grad[i] = True
                    low.grad = None
                    continue
                if master._backward_hooks:
                    grad = _run_grad_hooks(master, grad.float())
                if has_grad[i]:
                    add_to.append(buffers[i])
                    add_from.append(grad)
                else:
                    copy_to.append(buffers[i])
                    copy_from.append(grad)
                moved.append(i)
            if add_to:
                torch._foreach_add_(add_to, add_from)
            if copy_to:
                torch._foreach_copy_(copy_to, copy_from)
            hooked = []
            for i in moved:
                has_grad[i] = True
                master = masters[i]
                master.grad = buffers[i]
                lows[i].grad = None
                if master._post_accumulate_grad_hooks:
                    hooked.append(master)
            self._accumulating = True
            for master in hooked:  # as autograd runs them on the original, once per backward
                for post_hook in tuple(_post_hooks(master)):
                    post_hook(master)

    def step_done(self) -> None:
        """The next backward starts a new accumulation."""
        self._accumulating = False

    def clear_grads(self) -> None:
        """Abandon an accumulation: every gradient of both copies is dropped."""
        self._accumulating = False
        for master, low in zip(self.masters, self.lows, strict=True):
            master.grad = None
            low.grad = None

    def refresh(self) -> None:
        """Copy the (stepped) masters into the low-precision Parameters."""
        with _NoGrad():
            self._record()
            if self.lows:
                torch._foreach_copy_(self._aliases, self.masters)

    def lows_stepped(self, *args: Any) -> None:
        """Without master weights: after an optimizer step of the low copies, copy them up
        to the user's Parameters (a fused kernel moves no version counter to see)."""
        del args  # an optimizer step post hook's (optimizer, args, kwargs)
        with _NoGrad():
            if self.lows:
                torch._foreach_copy_(self.masters, self.lows)
            self._record()

    # ---------------------------------------------------------------- checkpoints
    def state(self) -> list[torch.Tensor]:
        return [master.detach() for master in self.masters]

    def check(self, tensors: object) -> list[torch.Tensor]:
        """Validate checkpointed masters (count, types, shapes) without writing anything."""
        if not isinstance(tensors, (list, tuple)):
            raise ValueError(
                f"checkpoint masters must be a list of tensors; got {type(tensors).__name__}"
            )
        if len(tensors) != len(self.masters):
            raise ValueError(
                f"checkpoint holds {len(tensors)} master weights; this model has {len(self.masters)}"
            )
        for i, (master, tensor) in enumerate(zip(self.masters, tensors, strict=True)):
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                raise ValueError(
                    f"checkpoint master weight {i} is not a floating tensor: {tensor!r}"
                )
            if tensor.shape != master.shape:
                raise ValueError(
                    f"checkpoint master weight {i} has shape {tuple(tensor.shape)}; this model's "
                    f"has {tuple(master.shape)}"
                )
        return list(tensors)

    @torch.no_grad()
    def load(self, tensors: list[torch.Tensor]) -> None:
        for master, tensor in zip(self.masters, self.check(tensors), strict=True):
            master.copy_(tensor)
        self.refresh()


def _run_grad_hooks(master: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The hooks the user registered on a master (``register_hook``), run on this
    backward's float32 gradient as autograd would run them; a returned tensor replaces it."""
    for hook in tuple((master._backward_hooks or {}).values()):
        replaced = hook(grad)
        if replaced is not None:
            grad = replaced
    return grad


def _post_hooks(master: torch.Tensor) -> Any:
    hooks = getattr(master, "_post_accumulate_grad_hooks", None)
    return () if not hooks else hooks.values()


@torch.no_grad()
def _save_masters(
    names: list[str],
    master_of: dict[int, torch.Tensor],
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
) -> None:
    """``step.network.state_dict()`` holds the float32 masters (the trained truth), not
    the low copies the forward computes with; ``keep_vars=True`` gives the master Parameters."""
    del local_metadata
    for name in names:
        key = prefix + name
        low = module._parameters.get(name)
        master = None if low is None else master_of.get(id(low))
        if master is not None and key in state_dict:
            kept = isinstance(state_dict[key], nn.Parameter)
            state_dict[key] = master if kept else master.detach()


def _load_masters_first(
    names: list[str],
    master_of: dict[int, torch.Tensor],
    module: nn.Module,
    state_dict: Mapping[str, Any],
    prefix: str,
    *args: Any,
) -> None:
    """Before ``step.network`` loads values of a higher precision than its low copies,
    write them to the masters at full precision."""
    for name in names:
        value = state_dict.get(prefix + name)
        low = module._parameters.get(name)
        master = None if low is None else master_of.get(id(low))
        if (
            master is not None
            and low is not None
            and isinstance(value, torch.Tensor)
            and value.dtype != low.dtype
            and value.shape == master.shape
        ):
            with torch.no_grad():
                master.copy_(value)
