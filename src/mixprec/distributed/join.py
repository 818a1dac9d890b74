"""Uneven inputs: the step's agreement joined with DDP's own ``join()``.

``with ddp.join():`` (DDP's own idiom) and ``with step.join():`` (the same context under
DDP; ``Join([agreement])`` without DDP) let ranks run out of data at different times. A
rank that is done keeps answering the others' collectives until everyone is done: DDP's
hook answers the gradient all-reduces, the step's hook the step's agreement all-reduce,
once per optimizer step of the others (it counts their micro-batches, as every rank makes
the same number of calls until it joins). It applies the agreed flag to its own loss scale
and counters, so every rank ends with the same loss-scale state; DDP then copies the last
rank's Parameters and buffers to all.

So that a bare ``ddp.join()`` joins the step too, building a step on a DDP wrapper sets
the wrapper's ``join_hook`` (an instance attribute: the class's method is untouched) to
:class:`DDPJoinWithStep`, which returns DDP's own hook followed by the step's, for the
step last built or run on that wrapper.

A rank that joins in the middle of an accumulation drops its partial gradients.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.algorithms.join import JoinHook

__all__ = ["DDPJoinWithStep", "StepJoinHook", "join_with_step"]


class StepJoinHook(JoinHook):
    """Runs ``shadow`` (the step's share of the others' micro-batch) on a rank that has run
    out of inputs, once per micro-batch of the others; after ``before`` (DDP's own hook,
    when the step joins with DDP: DDP's collectives come first in every micro-batch)."""

    def __init__(self, shadow: Callable[[], None], before: JoinHook | None = None) -> None:
        self.shadow = shadow
        self.before = before

    def main_hook(self) -> None:
        if self.before is not None:
            self.before.main_hook()
        self.shadow()

    def post_hook(self, is_last_joiner: bool) -> None:
        # every rank already holds the same loss-scale state; DDP syncs the Parameters
        if self.before is not None:
            self.before.post_hook(is_last_joiner)


class DDPJoinWithStep:
    """A DDP wrapper's ``join_hook``: DDP's own hook, then the current step's shadow."""

    def __init__(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        self._ddp = weakref.ref(ddp)
        self.shadow: Callable[[], Callable[[], None] | None] = lambda: None

    def __call__(self, **kwargs: Any) -> JoinHook:
        ddp = self._ddp()
        assert ddp is not None  # the wrapper holds this hook
        own = type(ddp).join_hook(ddp, **kwargs)
        shadow = self.shadow()
        return own if shadow is None else StepJoinHook(shadow, before=own)


def join_with_step(ddp: nn.parallel.DistributedDataParallel, shadow: Callable[[], None]) -> None:
    """Make ``ddp.join()`` join the step whose joined-rank work is ``shadow`` (a bound
    method, held weakly: a step that is gone joins nothing)."""
    hook = ddp.__dict__.get("join_hook")
    if not isinstance(hook, DDPJoinWithStep):
        hook = DDPJoinWithStep(ddp)
        ddp.join_hook = hook  # type: ignore[method-assign]
    hook.shadow = weakref.WeakMethod(shadow)
