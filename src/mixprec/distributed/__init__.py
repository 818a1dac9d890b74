"""More than one process: what the training step agrees on, and with whom.

* :mod:`~mixprec.distributed.replicas`: the ranks a step agrees with (its DDP's or FSDP's
  process group, or one passed in), the one small all-reduce per optimizer step, and the
  agreement checks on the step's configuration and loss-scale state.
* :mod:`~mixprec.distributed.step`: the training step's share: the forward through the
  user's DDP wrapper, ``no_sync`` accumulation, the agreement, ``step.join()``.
* :mod:`~mixprec.distributed.join`: the step as a ``torch.distributed`` ``Joinable``, for
  uneven inputs.
* :mod:`~mixprec.distributed.pipeline`: a training step per stage of a
  ``torch.distributed.pipelining`` schedule (:func:`pipeline_step`).
* :mod:`~mixprec.distributed.shard`: FSDP2 at every level: ``fully_shard`` with one
  ``MixedPrecisionPolicy`` per module, chosen by the level.

``pipeline_step`` and ``PipelineStep`` are imported on first use (they build on the
training step, which itself imports this package).
"""

from typing import Any

from mixprec.distributed.replicas import (
    Replicas,
    ddp_of,
    find_replicas,
    fsdp_of,
    is_distributed,
)
from mixprec.distributed.shard import ShardedLevel, fully_shard, sharded_level

__all__ = [
    "PipelineStep",
    "Replicas",
    "ShardedLevel",
    "ddp_of",
    "find_replicas",
    "fsdp_of",
    "fully_shard",
    "is_distributed",
    "pipeline_step",
    "sharded_level",
]


def __getattr__(name: str) -> Any:
    if name in ("PipelineStep", "pipeline_step"):
        from mixprec.distributed import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'mixprec.distributed' has no attribute {name!r}")
