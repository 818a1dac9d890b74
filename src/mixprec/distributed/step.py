"""The training step's share of many processes (a mixin of :class:`mixprec.TrainStep`).

* the forward goes through the user's DDP wrapper, left as it was: its ``module`` is the
  converted network for the duration of the call only;
* gradients are reduced on the last micro-batch of an optimizer step only (``no_sync``
  for DDP, ``set_requires_gradient_sync(False)`` for FSDP2, before it);
* one agreement all-reduce per optimizer step (:meth:`Replicas.agree_step`); ranks whose
  loss-scale states differ skip together and raise at the next host read;
* the step is a ``Joinable`` (``step.join()``), see :mod:`mixprec.distributed.join`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from mixprec.distributed import join as _join
from mixprec.distributed.replicas import Replicas, disagreement

if TYPE_CHECKING:
    from mixprec.training.scaling import LossScaleManager
    from mixprec.training.step import TrainConfig
    from mixprec.training.step_state import StepLedger

__all__ = ["ReplicatedStep", "local_shard", "without_ddp_prefix"]


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2); any other tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return t if to_local is None else to_local()


_DDP_PREFIX = "network.module."


def without_ddp_prefix(network: nn.Module, state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    """``network.module.x`` becomes ``network.x`` when this step has ``network.x`` and not
    ``network.module.x`` (a checkpoint of a step whose network was the DDP wrapper)."""
    if not isinstance(state_dict, Mapping):
        return state_dict
    old = [k for k in state_dict if isinstance(k, str) and k.startswith(_DDP_PREFIX)]
    if not old:
        return state_dict
    own = set(network.state_dict(prefix="network.", keep_vars=True))
    renamed = {k: "network." + k.removeprefix(_DDP_PREFIX) for k in old}
    if any(k in own for k in old) or not all(new in own for new in renamed.values()):
        return state_dict
    return {renamed.get(k, k): v for k, v in state_dict.items()}


class ReplicatedStep(Joinable):
    """What a training step does with other ranks (every method a no-op in one process)."""

    network: nn.Module
    optimizer: torch.optim.Optimizer
    config: TrainConfig
    replicas: Replicas
    loss_scale_manager: LossScaleManager | None
    optimizer_steps: int
    LIMIT_CHECK_INTERVAL: ClassVar[int]
    _micro_step: int
    _ledger: StepLedger
    _disagree: torch.Tensor
    _agreed_steps: int

    def __init__(self) -> None:
        Joinable.__init__(self)

    if TYPE_CHECKING:

        @property
        def _warming_up(self) -> bool: ...

        def _abandon(self) -> None: ...

        def _update_scale(
            self, manager: Any, state: Any, found: torch.Tensor, chosen: torch.Tensor | None
        ) -> None: ...

    def _run_network(self, *args: Any, **kwargs: Any) -> Any:
        """The forward, through the user's DDP wrapper when there is one: its ``module`` is
        the converted network for the call only, and is the user's again afterwards."""
        ddp = self.replicas.ddp
        if ddp is None:
            return self.network(*args, **kwargs)
        own = ddp.module
        if own is self.network:
            return ddp(*args, **kwargs)
        ddp.module = self.network
        try:
            return ddp(*args, **kwargs)
        finally:
            ddp.module = own

    @contextlib.contextmanager
    def _communication(self, last: bool) -> Iterator[None]:
        """Gradients are reduced on the last micro-batch of an optimizer step only."""
        work = Join.notify_join_context(self)
        if work is not None:
            work.wait()
        fsdp: Any = self.replicas.fsdp
        ddp = self.replicas.ddp
        if last:
            yield
        elif ddp is not None:
            with ddp.no_sync():
                yield
        elif fsdp is not None:
            fsdp.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                fsdp.set_requires_gradient_sync(True)
        else:
            yield

    def _check_join(self) -> None:
        ddp = self.replicas.ddp
        if (
            ddp is not None
            and self.replicas.active
            and ddp._join_config.enable
            and not self._join_config.enable
        ):
            raise RuntimeError(
                "mixprec training step inside ddp.join(): a rank that runs out of inputs would "
                "not answer the step's agreement all-reduce. Use `with step.join():` instead "
                "(it joins the DDP wrapper and the step together)"
            )

    def join(self, *, enable: bool = True, throw_on_early_termination: bool = False) -> Join:
        """A ``torch.distributed`` ``Join`` context for uneven inputs across ranks.

        Under DDP it joins the wrapper and the step (``Join([ddp, step])``); use it where
        you would use ``ddp.join()``.

        Example:
            >>> with step.join():
            ...     for x, y in loader:          # ranks may hold different numbers of batches
            ...         step(x, y)
        """
        if self.replicas.fsdp is not None:
            raise RuntimeError("FSDP2 has no join(): give every rank the same number of batches")
        joinables: list[Joinable] = [self]
        if self.replicas.ddp is not None:
            joinables.insert(0, self.replicas.ddp)
        return Join(joinables, enable=enable, throw_on_early_termination=throw_on_early_termination)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _join.join_hook(self, **kwargs)

    @property
    def join_device(self) -> torch.device:
        return next(
            (p.device for g in self.optimizer.param_groups for p in g["params"]),
            torch.device("cpu"),
        )

    @property
    def join_process_group(self) -> Any:
        ddp = self.replicas.ddp
        return ddp.process_group if ddp is not None else self.replicas.group

    def _shadow_micro_batch(self) -> None:
        """A joined rank's share of the others' micro-batch (see :mod:`mixprec.distributed.join`)."""
        self._micro_step += 1
        if self._micro_step < self.config.accumulation_steps:
            return
        self._abandon()
        manager = self.loss_scale_manager
        state = None if manager is None else manager.device_state()
        check = manager is None or manager.get_drop_overflow_update()
        nothing = torch.zeros((), device=self.join_device)
        warm = self._warming_up and state is not None and state.dynamic
        chosen = torch.full_like(nothing, math.inf) if warm else None
        try:
            found, chosen = self._agree(nothing, chosen, state, check)
            if check:
                self._ledger.update(found)
            self._update_scale(manager, state, found, chosen)
        finally:
            self.optimizer_steps += 1

    def _agree(
        self, found: torch.Tensor, chosen: torch.Tensor | None, state: Any, check: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The one all-reduce of an optimizer step; ranks whose loss-scale states differ
        all skip, and raise at the next host read."""
        if not self.replicas.active:
            return (found if check else torch.zeros_like(found)), chosen
        found, chosen, disagree = self.replicas.agree_step(found, chosen, state)
        self._disagree = torch.maximum(self._disagree.to(disagree.device), disagree)
        self._agreed_steps += 1
        return (torch.maximum(found, disagree) if check else torch.zeros_like(found)), chosen

    def _check_agreement(self, host_read: bool) -> None:
        if not self.replicas.active:
            return
        if not host_read and self._agreed_steps % self.LIMIT_CHECK_INTERVAL:
            return
        if not self._disagree.item():
            return
        manager = self.loss_scale_manager
        state = None if manager is None else manager.device_state()
        facts = (
            {}
            if state is None
            else {
                "loss_scale": float(state.scale),
                "good_steps": int(state.good_steps),
                "bad_steps": int(state.bad_steps),
            }
        )
        message = disagreement(
            self.replicas.gather(facts),
            "on the loss-scale state",
            "Did only some ranks load a checkpoint? Load the step's state_dict on every rank. "
            "The steps since the ranks diverged were skipped on every rank",
        )
        raise RuntimeError(message or "mixprec: the ranks disagree on the loss-scale state")
