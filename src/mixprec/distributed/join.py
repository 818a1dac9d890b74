"""Uneven inputs: the step's agreement as a ``torch.distributed`` ``Joinable``.

``with step.join():`` (``Join([ddp, agreement])`` under DDP, ``Join([agreement])``
otherwise) lets ranks run out of data at different times. A rank that is done keeps
answering the others' collectives until everyone is done: DDP's hook answers the gradient
all-reduces, this hook the step's agreement all-reduce, once per optimizer step of the
others (it counts their micro-batches, as every rank makes the same number of calls until
it joins). It applies the agreed flag to its own loss scale and counters, so every rank
ends with the same loss-scale state; DDP then copies the last rank's Parameters and
buffers to all.

A rank that joins in the middle of an accumulation drops its partial gradients.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.algorithms.join import JoinHook

__all__ = ["StepJoinHook"]


class StepJoinHook(JoinHook):
    """Runs ``shadow`` (the step's share of the others' micro-batch) on a rank that has run
    out of inputs, once per micro-batch of the others."""

    def __init__(self, shadow: Callable[[], None]) -> None:
        self.shadow = shadow

    def main_hook(self) -> None:
        self.shadow()

    def post_hook(self, is_last_joiner: bool) -> None:
        del is_last_joiner  # every rank already holds the same loss-scale state
