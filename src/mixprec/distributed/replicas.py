"""The ranks a training step agrees with, and what they agree on.

An optimizer step under ``torch.distributed`` all-reduces (MAX) one small vector over the
step's process group (under DDP only on the first and every 50th step: DDP's all-reduced
gradients already carry every rank's inf/NaN)::

    [found_inf, -first_scale, scale, -scale, good_steps, -good_steps, bad_steps, -bad_steps, ...]

(the last six once per loss-scale state: one per group of a ``GroupLossScaleManager``)

so that every rank skips the same steps (``found_inf``, from each rank's own gradients or,
under FSDP, its own shard), an fp16 step's first scale is the smallest any rank chose,
and the loss-scale state is compared for free: ``max(x) == -max(-x)`` exactly when every
rank holds the same ``x``. Ranks that disagree skip the step together (nothing diverges)
and raise together, with every rank's values. The configuration (level, dtype, what
``auto`` chose, the loss-scale state, pins, boost choices, ...) is compared once, when the
step is built; boost's timed optimizer-kernel choice is the first rank's on every rank.

The process group is, in order: the ``process_group`` passed in, the
``DistributedDataParallel``'s own group, the FSDP2 device mesh's groups (one all-reduce
per mesh dimension), else the whole world. One process (or a group of one) communicates
nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Replicas", "ddp_of", "find_replicas", "fsdp_of", "is_distributed"]

T = TypeVar("T")

#: what the vector's state entries mean, in order (each entry appears as x and -x)
_STATE_FIELDS = ("scale", "good_steps", "bad_steps")


def is_distributed() -> bool:
    """True inside an initialised process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def ddp_of(network: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    """The ``DistributedDataParallel`` wrapper, if ``network`` is one."""
    return network if isinstance(network, nn.parallel.DistributedDataParallel) else None


def fsdp_of(network: nn.Module) -> nn.Module | None:
    """The outermost module of ``network`` that FSDP2's ``fully_shard`` manages, if any."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - a torch without FSDP2
        return None
    return next((m for m in network.modules() if isinstance(m, FSDPModule)), None)


def _mesh_groups(fsdp: nn.Module) -> tuple[Any, ...]:
    from torch.distributed.tensor import DTensor

    for p in fsdp.parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            return tuple(mesh.get_group(d) for d in range(mesh.ndim))
    return (dist.group.WORLD,)


@dataclasses.dataclass(frozen=True)
class Replicas:
    """The ranks one training step agrees with.

    Attributes:
        groups: the process groups its agreement all-reduces run over (more than one for a
            multi-dimensional FSDP2 mesh); empty in a single process.
        ddp: the user's ``DistributedDataParallel`` wrapper, left as it was built.
        fsdp: the outermost ``fully_shard``-ed module, if any.
    """

    groups: tuple[Any, ...] = ()
    ddp: nn.parallel.DistributedDataParallel | None = None
    fsdp: nn.Module | None = None

    @property
    def active(self) -> bool:
        """Whether there is anyone to agree with."""
        return bool(self.groups)

    @property
    def group(self) -> Any:
        """The (first) process group, or None in a single process."""
        return self.groups[0] if self.groups else None

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """MAX-reduce ``tensor`` in place over every group (a no-op in one process)."""
        for group in self.groups:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        return tensor

    # ------------------------------------------------------------------ every step
    def agree_step(
        self, found: torch.Tensor, chosen: torch.Tensor | None, states: Sequence[Any]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """One all-reduce: the agreed overflow flag, the agreed first scale (the smallest
        any rank chose; None when none was chosen) and a 0-dim flag, 1.0 when the ranks'
        loss-scale states (``states``, every one a manager keeps: one per group of a
        ``GroupLossScaleManager``) differ (no host sync)."""
        device = found.device
        first = torch.full((), -math.inf, device=device) if chosen is None else -chosen.float()
        values = [found.float().reshape(()), first.to(device)]
        for state in states:
            for name in _STATE_FIELDS:
                x = getattr(state, name).to(device=device, dtype=torch.float32)
                values += [x, -x]
        vector = self.all_reduce_max(torch.stack(values))
        pairs = vector[2:].view(-1, 2)
        disagree = (pairs.sum(dim=1) != 0).any().float()
        agreed_first = None if chosen is None else -vector[1]
        return vector[0], agreed_first, disagree

    # ------------------------------------------------------------------ once
    def gather(self, value: object) -> list[tuple[int, object]]:
        """``(global rank, value)`` from every rank of every group (a collective)."""
        rank = dist.get_rank()
        seen: dict[int, object] = {}
        for group in self.groups:
            out: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(out, (rank, value), group=group)
            seen.update(dict(out))
        return sorted(seen.items())

    def adopt_first(self, value: T) -> T:
        """The first rank's ``value`` on every rank (a broadcast over each group in turn:
        ranks that agree on every group's first rank agree everywhere)."""
        for group in self.groups:
            box = [value]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
            value = box[0]
        return value

    def adopt_optimizer_kernels(self, optimizer: torch.optim.Optimizer, decision: T) -> T:
        """Every rank runs the first rank's optimizer kernels (``fused``/``foreach``), which
        boost chooses by timing them on each rank (replicas stepping with different kernels
        drift apart); returns the first rank's ``decision`` (boost's record of the choice)."""
        if not self.active:
            return decision
        own = [(g.get("fused"), g.get("foreach")) for g in optimizer.param_groups]
        chosen, decision = self.adopt_first((own, decision))
        for group, (fused, foreach) in zip(optimizer.param_groups, chosen, strict=True):
            group["fused"], group["foreach"] = fused, foreach
        if any(fused for fused, _ in chosen):
            optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]
        else:
            optimizer.__dict__.pop("_step_supports_amp_scaling", None)
        return decision

    def check(self, facts: Mapping[str, object], when: str, advice: str) -> None:
        """Raise the same ``ValueError`` on every rank unless all ranks hold the same
        ``facts`` (a collective: every rank of the group must call it)."""
        if not self.active:
            return
        mismatch = disagreement(self.gather(dict(facts)), when, advice)
        if mismatch:
            raise ValueError(mismatch)


def plain(value: object) -> object:
    """``value`` with tensors as Python numbers and lists, for comparing across ranks."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def disagreement(gathered: list[tuple[int, Any]], when: str, advice: str) -> str:
    """The error for facts gathered from the ranks ('' when they agree)."""
    lines = []
    keys = list(gathered[0][1]) if gathered else []
    for key in keys:
        values = [facts.get(key) for _, facts in gathered]
        if any(v != values[0] for v in values):
            listed = ", ".join(
                f"rank {rank}: {v!r}" for (rank, _), v in zip(gathered, values, strict=True)
            )
            lines.append(f"{key}: {listed}")
    if not lines:
        return ""
    return f"mixprec: the ranks disagree {when} on " + "; ".join(lines) + f". {advice}"


def find_replicas(network: nn.Module, process_group: Any = None) -> Replicas:
    """The ranks a step on ``network`` agrees with (see the module docstring).

    Raises:
        TypeError: ``process_group`` is not a ``torch.distributed.ProcessGroup``.
        ValueError: ``process_group`` without an initialised process group; this rank is
            not in it; it differs from the ``DistributedDataParallel``'s own group.
    """
    ddp = ddp_of(network)
    fsdp = fsdp_of(network)
    if dist.is_available() and process_group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not in the step's process group "
            "(dist.new_group gave it GroupMember.NON_GROUP_MEMBER): build the step only on "
            "the group's ranks"
        )
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"process_group must be a torch.distributed.ProcessGroup (dist.new_group(...)) or "
            f"None; got {process_group!r}"
        )
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError(
                "process_group was given, but torch.distributed is not initialised "
                "(call dist.init_process_group first)"
            )
        return Replicas(ddp=ddp, fsdp=fsdp)
    if ddp is not None and process_group is not None and process_group != ddp.process_group:
        raise ValueError(
            "process_group differs from the DistributedDataParallel's own process group: the "
            "step must agree with the ranks that reduce its gradients; leave process_group "
            "out (it defaults to the DDP's group)"
        )
    if process_group is not None:
        groups: tuple[Any, ...] = (process_group,)
    elif ddp is not None:
        groups = (ddp.process_group,)
    elif fsdp is not None:
        groups = _mesh_groups(fsdp)
    else:
        groups = (dist.group.WORLD,)
    for group in groups:
        if dist.get_rank(group) < 0:
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not in the step's process "
                f"group (ranks {dist.get_process_group_ranks(group)}): build the step only on "
                "the group's ranks"
            )
    if all(dist.get_world_size(group) == 1 for group in groups):
        groups = ()
    return Replicas(groups, ddp, fsdp)
