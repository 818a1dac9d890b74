"""The replica agreement: the training step's share of many processes, an object the step
holds (``step.agreement``).

* the forward goes through the user's DDP wrapper, left as it was: its ``module`` is the
  converted network for the duration of the call only (:meth:`Agreement.run`);
* gradients are reduced on the last micro-batch of an optimizer step only (``no_sync``
  for DDP, ``set_requires_gradient_sync(False)`` for FSDP2, before it:
  :meth:`Agreement.communication`);
* one agreement all-reduce per optimizer step (:meth:`Agreement.agree`); ranks whose
  loss-scale states differ skip together and raise at the next host read
  (:meth:`Agreement.check`);
* the agreement is the ``Joinable`` behind ``step.join()``, see :mod:`mixprec.distributed.join`.

In one process every part is a no-op. The agreement knows nothing of the step: it is given
the replicas, where the step's parameters live, and what a joined rank does in place of a
micro-batch (a callable of the step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from mixprec.distributed.join import StepJoinHook
from mixprec.distributed.replicas import Replicas, disagreement

__all__ = ["Agreement", "local_shard", "without_ddp_prefix"]


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


class Agreement(Joinable):
    """What a training step does with other ranks (every method a no-op in one process).

    Args:
        replicas: the ranks the step agrees with (:class:`~mixprec.distributed.Replicas`).
        device: where the step's parameters live (the device of the join all-reduce).
        shadow: what a rank that has run out of inputs does in place of each of the others'
            micro-batches (the step's bookkeeping; it calls :meth:`agree` on the last one).
    """

    def __init__(
        self,
        replicas: Replicas,
        device: Callable[[], torch.device],
        shadow: Callable[[], None],
    ) -> None:
        super().__init__()
        self.replicas = replicas
        self._device = device
        self._shadow = shadow
        self._disagree = torch.zeros(())  # sticky: 1.0 once the ranks' scale states differed
        self._agreed_steps = 0  # optimizer steps since the build (never checkpointed)

    @property
    def active(self) -> bool:
        """Whether there are other ranks to agree with."""
        return self.replicas.active

    def run(self, network: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """The forward, through the user's DDP wrapper when there is one: its ``module`` is
        ``network`` for the call only, and is the user's again afterwards."""
        ddp = self.replicas.ddp
        if ddp is None:
            return network(*args, **kwargs)
        own = ddp.module
        if own is network:
            return ddp(*args, **kwargs)
        ddp.module = network
        try:
            return ddp(*args, **kwargs)
        finally:
            ddp.module = own

    @contextlib.contextmanager
    def communication(self, last: bool) -> Iterator[None]:
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

    def check_join(self) -> None:
        """Refuse a step run inside ``ddp.join()`` alone (its agreement would hang)."""
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
        """A ``torch.distributed`` ``Join`` context for uneven inputs across ranks (under
        DDP it joins the wrapper and the step: ``Join([ddp, agreement])``)."""
        if self.replicas.fsdp is not None:
            raise RuntimeError("FSDP2 has no join(): give every rank the same number of batches")
        joinables: list[Joinable] = [self]
        if self.replicas.ddp is not None:
            joinables.insert(0, self.replicas.ddp)
        return Join(joinables, enable=enable, throw_on_early_termination=throw_on_early_termination)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        del kwargs  # DDP's options; the step's hook has none
        return StepJoinHook(self._shadow)

    @property
    def join_device(self) -> torch.device:
        return self._device()

    @property
    def join_process_group(self) -> Any:
        ddp = self.replicas.ddp
        return ddp.process_group if ddp is not None else self.replicas.group

    def agree(
        self, found: torch.Tensor, chosen: torch.Tensor | None, state: Any, check: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The one all-reduce of an optimizer step: the agreed overflow flag (zero when
        ``check`` is False) and first scale; ranks whose loss-scale states (``state``, a
        :class:`~mixprec.training.scale_state.ScaleState` or None) differ all skip."""
        if not self.replicas.active:
            return (found if check else torch.zeros_like(found)), chosen
        found, chosen, disagree = self.replicas.agree_step(found, chosen, state)
        self._disagree = torch.maximum(self._disagree.to(disagree.device), disagree)
        self._agreed_steps += 1
        return (torch.maximum(found, disagree) if check else torch.zeros_like(found)), chosen

    def check(self, state: Any, *, host_read: bool, interval: int) -> None:
        """Raise once the ranks' loss-scale states have differed: at a step that reads the
        host anyway (``host_read``), otherwise every ``interval``-th agreed step."""
        if not self.replicas.active:
            return
        if not host_read and self._agreed_steps % interval:
            return
        if not self._disagree.item():
            return
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
