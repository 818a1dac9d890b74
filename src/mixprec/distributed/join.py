"""Uneven inputs: the training step as a ``torch.distributed`` ``Joinable``.

``with step.join():`` (``Join([ddp, step])`` under DDP, ``Join([step])`` otherwise) lets
ranks run out of data at different times. A rank that is done keeps answering the others'
collectives until everyone is done: DDP's hook answers the gradient all-reduces, this
hook the step's agreement all-reduce, once per optimizer step of the others (it counts
their micro-batches, as every rank makes the same number of calls until it joins). It
applies the agreed flag to its own loss scale and counters, so every rank ends with the
same loss-scale state; DDP then copies the last rank's Parameters and buffers to all.

A rank that joins in the middle of an accumulation drops its partial gradients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.distributed.algorithms.join import JoinHook

if TYPE_CHECKING:
    from mixprec.distributed.step import ReplicatedStep

__all__ = ["StepJoinHook"]


class StepJoinHook(JoinHook):
    """Shadows the step's agreement all-reduce on a rank that has run out of inputs."""

    def __init__(self, step: ReplicatedStep) -> None:
        self.step = step

    def main_hook(self) -> None:
        self.step._shadow_micro_batch()

    def post_hook(self, is_last_joiner: bool) -> None:
        del is_last_joiner  # every rank already holds the same loss-scale state


def join_hook(step: ReplicatedStep, **kwargs: Any) -> JoinHook:
    """The join hook of ``step`` (``Joinable.join_hook``); keyword arguments are DDP's."""
    del kwargs
    return StepJoinHook(step)
