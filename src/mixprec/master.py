"""float32 master weights for a model that holds low-precision Parameters.

Under O2/O3 training the converted model computes with low-precision Parameters of its
own, so no weight is cast in the forward pass. The user's Parameters (the ones the
optimizer was built on) become the float32 *masters*:

1. after each backward, low-precision gradients are moved onto the masters, accumulated in
   float32 (:meth:`MasterWeights.collect_grads`);
2. the optimizer steps the masters, exactly as it would without mixprec;
3. the low-precision copies are refreshed from the masters (:meth:`MasterWeights.refresh`),
   with one fused ``_foreach_copy_`` per dtype.

The optimizer, its param groups, its state and any LR scheduler attached to it never see
a low-precision tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from mixprec.convert.cast_at_use import low_precision_parameters

__all__ = ["MasterWeights"]


class MasterWeights:
    """Pairs of (float32 master, low-precision model Parameter).

    Built by :meth:`install`, which gives a module converted at module level its own
    low-precision Parameters in place of the shared float32 ones.
    """

    def __init__(self, pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
        self.masters: list[torch.Tensor] = [master for master, _ in pairs]
        self.lows: list[torch.Tensor] = [low for _, low in pairs]
        # float32 gradient buffers, allocated once: a fresh 4-byte-per-weight allocation
        # every step costs more than the conversion itself (page faults)
        self._buffers: list[torch.Tensor | None] = [None] * len(self.masters)
        self._fresh = [False] * len(self.masters)

    @classmethod
    def install(cls, converted: nn.Module) -> MasterWeights:
        """Swap every Parameter ``converted`` computes with in low precision for a
        low-precision Parameter of its own; the float32 ones become the masters."""
        lows: dict[int, nn.Parameter] = {}
        pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        for owner, name, master, dtype in low_precision_parameters(converted):
            if not isinstance(master, nn.Parameter) or master.dtype == dtype:
                continue
            low = lows.get(id(master))
            if low is None:
                low = nn.Parameter(master.detach().to(dtype), requires_grad=master.requires_grad)
                lows[id(master)] = low
                pairs.append((master, low))
            owner._parameters[name] = low
        return cls(pairs)

    @torch.no_grad()
    def collect_grads(self) -> None:
        """Move the low-precision gradients onto the masters, in float32, and clear them
        (called after every backward, so micro-batches accumulate in float32)."""
        for i, (master, low) in enumerate(zip(self.masters, self.lows, strict=True)):
            if low.grad is None:
                continue
            buffer = self._buffers[i]
            if buffer is None or buffer.shape != master.shape or buffer.device != master.device:
                buffer = self._buffers[i] = torch.empty_like(master, dtype=torch.float32)
                self._fresh[i] = False
            if self._fresh[i] and master.grad is buffer:
                buffer.add_(low.grad)
            else:
                buffer.copy_(low.grad)
                self._fresh[i] = True
            master.grad = buffer
            low.grad = None

    def step_done(self) -> None:
        """The next backward starts a new accumulation."""
        self._fresh = [False] * len(self.masters)

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the (stepped) masters into the low-precision Parameters."""
        if self.lows:
            torch._foreach_copy_(self.lows, self.masters)

    def state(self) -> list[torch.Tensor]:
        return [master.detach() for master in self.masters]

    @torch.no_grad()
    def load(self, tensors: list[torch.Tensor]) -> None:
        if len(tensors) != len(self.masters):
            raise ValueError(
                f"checkpoint holds {len(tensors)} master weights; this model has {len(self.masters)}"
            )
        for master, tensor in zip(self.masters, tensors, strict=True):
            master.copy_(tensor)
        self.refresh()
