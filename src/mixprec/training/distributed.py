"""More than one process: one overflow decision for every rank.

Under ``torch.distributed`` each rank checks its own gradients (with FSDP, its own shard;
with DDP under ``no_sync`` accumulation, its own micro-batches), so the flag is
all-reduced with MAX before anyone decides: every rank skips the same steps and keeps the
same loss scale, and no rank ever diverges.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["agree_on_overflow", "ddp_of", "is_distributed"]


def is_distributed() -> bool:
    """True inside an initialised process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agree_on_overflow(found_inf: torch.Tensor, group: Any = None) -> torch.Tensor:
    """All-reduce (MAX) a 0-dim overflow flag across ``group`` (in place); a no-op in a
    single process."""
    if is_distributed():
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    return found_inf


def ddp_of(network: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    """The ``DistributedDataParallel`` wrapper, if ``network`` is one."""
    return network if isinstance(network, nn.parallel.DistributedDataParallel) else None
