"""More than one process: what the training step agrees on, and with whom.

* :mod:`~mixprec.distributed.replicas`: the ranks a step agrees with (its DDP's or FSDP's
  process group, or one passed in), the one small all-reduce per optimizer step, and the
  agreement checks on the step's configuration and loss-scale state.
* :mod:`~mixprec.distributed.step`: the training step's share: the forward through the
  user's DDP wrapper, ``no_sync`` accumulation, the agreement, ``step.join()``.
* :mod:`~mixprec.distributed.join`: the step as a ``torch.distributed`` ``Joinable``, for
  uneven inputs.
* :mod:`~mixprec.distributed.shard`: FSDP2 at every level: ``fully_shard`` with one
  ``MixedPrecisionPolicy`` per module, chosen by the level.
"""

from mixprec.distributed.replicas import (
    Replicas,
    ddp_of,
    find_replicas,
    fsdp_of,
    is_distributed,
)
from mixprec.distributed.shard import ShardedLevel, fully_shard, sharded_level

__all__ = [
    "Replicas",
    "ShardedLevel",
    "ddp_of",
    "find_replicas",
    "fsdp_of",
    "fully_shard",
    "is_distributed",
    "sharded_level",
]
