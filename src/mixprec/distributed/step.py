"""The replica agreement: the training step's share of many processes, an object the step
holds (``step.agreement``).

* the forward goes through the user's DDP wrapper, left as it was: its ``module`` is the
  converted network for the duration of the call only (:meth:`Agreement.run`);
* under DDP gradients are reduced on the last micro-batch of an optimizer step only
  (``no_sync`` before it); under FSDP2 on every micro-batch (each rank keeps its shard
  only) unless the model was sharded with ``sync_every_micro_batch=False``
  (:meth:`Agreement.communication`);
* the overflow agreed (:meth:`Agreement.agree`): under DDP read from its all-reduced
  gradients (no collective of the step's own but on the first and every 50th step, which
  compare the loss-scale states), otherwise one small all-reduce per optimizer step;
  ranks whose loss-scale states differ skip together and raise together
  (:meth:`Agreement.check`);
* uneven inputs: ``ddp.join()`` (= ``step.join()``) joins the step too; without DDP the
  agreement is the ``Joinable`` behind ``step.join()``, see :mod:`mixprec.distributed.join`.

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

from mixprec.distributed.join import StepJoinHook, join_with_step
from mixprec.distributed.replicas import Replicas, disagreement, plain
from mixprec.distributed.shard import sharded_level

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
        if replicas.ddp is not None and replicas.active:
            join_with_step(replicas.ddp, shadow)  # a bare ddp.join() joins the step too

    @property
    def active(self) -> bool:
        """Whether there are other ranks to agree with."""
        return self.replicas.active

    @property
    def idle(self) -> bool:
        """Whether :meth:`communication` has nothing to do: no DDP wrapper, no FSDP2 and no
        ``Join`` context around the step (the step then skips it)."""
        replicas = self.replicas
        return replicas.ddp is None and replicas.fsdp is None and not self._join_config.enable

    def run(self, network: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """The forward, through the user's DDP wrapper when there is one: its ``module`` is
        ``network`` for the call only, and is the user's again afterwards."""
        ddp = self.replicas.ddp
        if ddp is None:
            return network(*args, **kwargs)
        if self.replicas.active:
            join_with_step(ddp, self._shadow)  # the step last run on the wrapper joins
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
        """Under DDP gradients are reduced on the last micro-batch of an optimizer step only
        (and on the very first backward of a ``static_graph=True`` DDP, which records the
        graph then); under FSDP2 on every micro-batch unless the model was sharded with
        ``sync_every_micro_batch=False``."""
        work = Join.notify_join_context(self)
        if work is not None:
            work.wait()
        fsdp: Any = self.replicas.fsdp
        ddp = self.replicas.ddp
        if last:
            yield
        elif ddp is not None:
            if ddp.static_graph and not ddp._static_graph_delay_allreduce_enqueued:
                yield  # DDP's first synced backward records the static graph
                return
            with ddp.no_sync():
                yield
        elif fsdp is not None:
            shard = sharded_level(fsdp)
            if shard is None or shard.sync_every_micro_batch:
                yield  # each micro-batch reduce-scatters: a rank keeps its shard only
                return
            fsdp.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                fsdp.set_requires_gradient_sync(True)
        else:
            yield

    def join(self, *, enable: bool = True, throw_on_early_termination: bool = False) -> Join:
        """A ``torch.distributed`` ``Join`` context for uneven inputs across ranks: under
        DDP the wrapper's own ``ddp.join()`` (which joins the step too), otherwise
        ``Join([agreement])``."""
        if self.replicas.fsdp is not None:
            raise RuntimeError("FSDP2 has no join(): give every rank the same number of batches")
        ddp = self.replicas.ddp
        if ddp is not None:
            if self.replicas.active:
                join_with_step(ddp, self._shadow)
            return ddp.join(enable=enable, throw_on_early_termination=throw_on_early_termination)
        return Join([self], enable=enable, throw_on_early_termination=throw_on_early_termination)

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
        self,
        found: torch.Tensor,
        chosen: torch.Tensor | None,
        manager: Any,
        check: bool,
        *,
        interval: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The agreed overflow flag (zero when ``check`` is False) and first scale; ranks
        whose loss-scale states (every state of ``manager``, a
        :class:`~mixprec.LossScaleManager` or None) differ all skip.

        Under DDP (outside ``step.join()``) the gradients are already all-reduced: any rank's
        inf/NaN is in every rank's, so ``found`` and ``chosen`` are already the same on every
        rank and nothing is sent, except on the first optimizer step and every
        ``interval``-th, which compare the loss-scale states. Otherwise: one all-reduce."""
        if not self.replicas.active:
            return (found if check else torch.zeros_like(found)), chosen
        due = self._agreed_steps % interval == 0
        self._agreed_steps += 1
        if self.by_gradients and not due:
            return (found if check else torch.zeros_like(found)), chosen
        states = [] if manager is None else manager.device_states()
        found, chosen, disagree = self.replicas.agree_step(found, chosen, states)
        self._disagree = torch.maximum(self._disagree.to(disagree.device), disagree)
        return (torch.maximum(found, disagree) if check else torch.zeros_like(found)), chosen

    @property
    def by_gradients(self) -> bool:
        """Whether the overflow is read from DDP's all-reduced gradients (no collective of
        the step's own): under DDP, unless the wrapper ever ran in ``ddp.join()`` (or
        ``step.join()``, the same): its joined ranks learn the others' overflows from the
        agreement all-reduce."""
        ddp = self.replicas.ddp
        return ddp is not None and not ddp._join_config.enable

    def check(self, manager: Any, *, skipped: bool | None, interval: int) -> None:
        """Raise once the ranks' loss-scale states have differed. A difference makes every
        rank skip, so a step known to be applied (``skipped`` False) reads nothing more
        from the host; one known skipped reads the flag; one decided on the device (None)
        reads it every ``interval``-th agreed step (the first included)."""
        if not self.replicas.active or skipped is False:
            return
        if skipped is None and (self._agreed_steps - 1) % interval:
            return
        if not self._disagree.item():
            return
        facts = {} if manager is None else plain(manager.state_dict())
        message = disagreement(
            self.replicas.gather(facts),
            "on the loss-scale state",
            "Did only some ranks load a checkpoint? Load the step's state_dict on every rank. "
            "The steps since the ranks diverged were skipped on every rank",
        )
        raise RuntimeError(message or "mixprec: the ranks disagree on the loss-scale state")
