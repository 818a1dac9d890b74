"""Probes: run a network once, watch every module, and leave no trace.

:func:`preserved` is the contract every diagnostic run keeps: the random number
generators are forked (a dropout mask drawn by the probe is not drawn from the training
stream), every buffer the run writes (BatchNorm running statistics and their counter, a
cache or an EMA kept as a buffer) is put back, and parameter ``.grad`` is never touched
(gradients are taken with :func:`torch.autograd.grad`). Python attributes a forward
assigns to (plain counters, non-tensor caches) are not restored.

:class:`Recorder` hooks every module: in execution order it records whether each
module's inputs and outputs are finite and their largest finite magnitude, and during
backward the same for the gradient of each module's inputs and outputs and of each
parameter. The statistics stay on the device as 0-dim tensors until
:meth:`Recorder.events` reads them all with one host sync.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["Event", "Phase", "Recorder", "preserved", "tensor_leaves"]


class Phase(str, enum.Enum):
    """Which value an event looked at."""

    INPUT = "input"
    OUTPUT = "output"
    INPUT_GRAD = "input gradient"
    OUTPUT_GRAD = "output gradient"
    PARAM_GRAD = "parameter gradient"


@dataclasses.dataclass(frozen=True)
class Event:
    """One value seen by a probe, in the order it was seen.

    Attributes:
        path: qualified name of the module (``""`` the network itself) or parameter.
        module_type: the module's class name (``"Parameter"`` for a parameter gradient).
        phase: which value.
        enclosing: the innermost module running around this module's call (None for
            the network itself and for parameters).
        dtype: the value's dtype (the widest when a module has several floating values).
        has_inf: any infinity.
        has_nan: any NaN.
        largest: the largest finite magnitude.
    """

    path: str
    module_type: str
    phase: Phase
    enclosing: str | None
    dtype: torch.dtype
    has_inf: bool
    has_nan: bool
    largest: float

    @property
    def finite(self) -> bool:
        return not (self.has_inf or self.has_nan)


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The floating tensors in a nested structure (model outputs such as dicts or
    transformers' ``ModelOutput`` included)."""
    if isinstance(tree, torch.Tensor):
        leaves: list[Any] = [tree]
    elif hasattr(tree, "to_tuple") and callable(tree.to_tuple):
        leaves = pytree.tree_leaves(tree.to_tuple())
    else:
        leaves = pytree.tree_leaves(tree)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _stats(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.dtype] | None:
    """``[has_inf, has_nan, largest finite]`` of some tensors, on their device, no sync."""
    tensors = [t.detach() for t in tensors if t.numel()]
    if not tensors:
        return None
    rows = []
    for t in tensors:
        magnitude = t.abs()
        finite = torch.isfinite(magnitude)
        rows.append(
            torch.stack(
                [
                    torch.isinf(magnitude).any().float(),
                    torch.isnan(magnitude).any().float(),
                    torch.where(finite, magnitude, 0).amax().float(),
                ]
            ).to(tensors[0].device)
        )
    widest = max((t.dtype for t in tensors), key=lambda d: torch.finfo(d).max)
    return torch.stack(rows).amax(dim=0), widest


@dataclasses.dataclass
class _Pending:
    path: str
    module_type: str
    phase: Phase
    enclosing: str | None
    stats: torch.Tensor
    dtype: torch.dtype


class Recorder:
    """Forward and backward probes on every module of a network (see module docstring).

    Use as a context manager; the hooks are removed on exit, also on error.
    """

    def __init__(self, network: nn.Module, *, backward: bool = True) -> None:
        self.network = network
        self.backward = backward
        self._pending: list[_Pending] = []
        self._stack: list[str] = []
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> Recorder:
        try:
            for path, module in self.network.named_modules():
                self._handles.append(
                    module.register_forward_pre_hook(self._pre_hook(path), with_kwargs=True)
                )
                self._handles.append(
                    module.register_forward_hook(self._post_hook(path), always_call=True)
                )
            if self.backward:
                for name, param in self.network.named_parameters():
                    if param.requires_grad:
                        self._handles.append(param.register_hook(self._param_hook(name)))
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        """Remove every hook (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def events(self) -> list[Event]:
        """Everything recorded so far, in order (one host sync)."""
        if not self._pending:
            return []
        values = torch.stack([p.stats.cpu() for p in self._pending]).tolist()
        return [
            Event(p.path, p.module_type, p.phase, p.enclosing, p.dtype, v[0] > 0, v[1] > 0, v[2])
            for p, v in zip(self._pending, values, strict=True)
        ]

    # ------------------------------------------------------------------ hooks
    def _record(
        self,
        path: str,
        module_type: str,
        phase: Phase,
        tensors: list[torch.Tensor],
        enclosing: str | None,
    ) -> None:
        found = _stats(tensors)
        if found is not None:
            stats, dtype = found
            self._pending.append(_Pending(path, module_type, phase, enclosing, stats, dtype))

    def _watch_grad(
        self, path: str, module: nn.Module, phase: Phase, tensors: Any, enclosing: str | None
    ) -> None:
        if not (self.backward and torch.is_grad_enabled()):
            return
        for t in tensor_leaves(tensors):
            if t.requires_grad:
                hook = self._grad_hook(path, type(module).__name__, phase, enclosing)
                self._handles.append(t.register_hook(hook))

    def _pre_hook(self, path: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            enclosing = self._stack[-1] if self._stack else None
            leaves = tensor_leaves((args, kwargs))
            self._record(path, type(module).__name__, Phase.INPUT, leaves, enclosing)
            self._watch_grad(path, module, Phase.INPUT_GRAD, leaves, enclosing)
            self._stack.append(path)

        return hook

    def _post_hook(self, path: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if self._stack and self._stack[-1] == path:
                self._stack.pop()
            enclosing = self._stack[-1] if self._stack else None
            leaves = tensor_leaves(output)
            self._record(path, type(module).__name__, Phase.OUTPUT, leaves, enclosing)
            self._watch_grad(path, module, Phase.OUTPUT_GRAD, leaves, enclosing)

        return hook

    def _grad_hook(self, path: str, module_type: str, phase: Phase, enclosing: str | None) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self._record(path, module_type, phase, [grad], enclosing)

        return hook

    def _param_hook(self, name: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self._record(name, "Parameter", Phase.PARAM_GRAD, [grad], None)

        return hook


@contextlib.contextmanager
def preserved(network: nn.Module) -> Iterator[None]:
    """Run the body with the RNGs forked and every buffer of ``network`` restored after.

    A buffer that was written in place gets its old values back (in the same tensor
    object); a buffer that was replaced by a new tensor gets its old tensor back.

    Example:
        >>> with preserved(model):
        ...     model.train()(x)  # BatchNorm statistics are as they were afterwards
    """
    saved = [
        (module, name, tensor, tensor.detach().clone())
        for module in network.modules()
        for name, tensor in module._buffers.items()
        if tensor is not None
    ]
    tensors = [*network.parameters(), *network.buffers()]
    devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for module, name, tensor, copy in saved:
                    if module._buffers.get(name) is not tensor:
                        module._buffers[name] = tensor
                    # always: kernels such as batch_norm write running statistics
                    # without bumping the version counter
                    tensor.copy_(copy)
