"""Pipeline parallelism: a mixprec training step per stage of a ``torch.distributed.pipelining``
schedule.

Each process holds one stage (a consecutive part of the model) and runs it at the level,
as MindSpore's pipeline cells do (``_TrainPipelineWithLossScaleCell``): one optimizer step
per schedule step over ``n_microbatches`` micro-batches, with

* the loss (float32, from float32 output and target) multiplied by the loss scale on the
  last stage, micro-batch by micro-batch, so every stage's gradients carry the scale (the
  activation gradients sent back between stages too);
* each stage checking its own gradients, and the overflow flag all-reduced (MAX) over the
  pipeline's process group: every stage steps or every stage skips; the loss-scale states
  (every group of a :class:`~mixprec.GroupLossScaleManager`) ride in the same all-reduce
  and are compared, so every stage unscales by the same scale and updates it alike (a
  difference skips on every stage and raises on every stage, naming each stage's value);
* an fp16 first scale chosen from the first step's gradients, the smallest any stage chose;
* clipping by the norm of the whole model's gradients (over every stage's).

The stage's Parameters stay float32 and are cast at use (as under DDP): torch's stage
divides their gradients by the number of micro-batches, and sends activations (and their
gradients) in the dtype the level computes them in: half the traffic at O2/O3. The whole
step is :class:`~mixprec.TrainStep`'s, on the gradients the schedule left
(:meth:`~mixprec.TrainStep.step_gradients`).

Example:
    >>> step = mixprec.distributed.pipeline_step(part, optimizer, nn.CrossEntropyLoss(), "O2",
    ...     dtype="fp16", stage_index=rank, num_stages=world, n_microbatches=4)
    >>> loss = step(x) if rank == 0 else step(target=y)   # the last stage returns the loss
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from mixprec.policy.levels import Level
from mixprec.policy.ops import cast_tree
from mixprec.training.build import DEFAULT, _Default
from mixprec.training.step import _as_loss

if TYPE_CHECKING:
    from mixprec.training.scaling import LossScaleManager
    from mixprec.training.step import TrainStep

__all__ = ["PipelineStep", "pipeline_step"]


def _check_index(value: object, name: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {value!r}")
    if value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}; got {value!r}")
    return value


def _schedule_class(schedule: object) -> type:
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    if not (isinstance(schedule, type) and issubclass(schedule, PipelineScheduleSingle)):
        raise TypeError(
            "schedule must be a torch.distributed.pipelining schedule class with one stage "
            f"per process (ScheduleGPipe, Schedule1F1B); got {schedule!r}"
        )
    return schedule


class _ClipAcross:
    """Clip every stage's gradients by the norm over all stages (the ``after_unscale``
    seam: every stage runs it on every optimizer step, before the optimizer step)."""

    def __init__(self, max_norm: float, group: Any) -> None:
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
            raise TypeError(
                f"clip_grad_norm must be a positive finite number or None; got {max_norm!r}"
            )
        if not math.isfinite(max_norm) or max_norm <= 0:
            raise ValueError(
                f"clip_grad_norm must be a positive finite number or None; got {max_norm!r}"
            )
        self.max_norm = float(max_norm)
        self.group = group

    def __call__(self, step: TrainStep, params: list[torch.Tensor]) -> None:
        del step  # the seam's signature
        grads = [p.grad for p in params if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=device)
        squares = local.float().square()
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=self.group)
        torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, squares.sqrt())


class PipelineStep:
    """One pipeline stage's training step (built by :func:`pipeline_step`).

    Attributes:
        train_step: the stage's :class:`~mixprec.TrainStep` (its converted part, optimizer,
            loss-scale manager and agreement with the other stages).
        stage: torch's ``PipelineStage`` around the converted part.
        schedule: the schedule over ``n_microbatches`` micro-batches.
    """

    def __init__(
        self,
        train_step: TrainStep,
        stage: Any,
        schedule_class: type,
        n_microbatches: int,
        loss_fn: Callable[[Any, Any], torch.Tensor],
    ) -> None:
        self.train_step = train_step
        self.stage = stage
        self._loss_fn = loss_fn
        self._losses: list[torch.Tensor] = []
        self._n_microbatches = n_microbatches
        self.schedule = schedule_class(stage, n_microbatches, loss_fn=self._scaled_loss)

    def _scaled_loss(self, output: Any, target: Any) -> torch.Tensor:
        loss = self._loss_fn(cast_tree(output, torch.float32), cast_tree(target, torch.float32))
        loss = _as_loss(loss, "loss_fn")
        self._losses.append(loss.detach())
        return self.train_step.scale_loss(loss)

    def __call__(self, *inputs: Any, target: Any = None, **kwargs: Any) -> torch.Tensor | None:
        """One optimizer step over the whole batch: the first stage takes the inputs, the
        last the target; returns the mean unscaled float32 loss of the micro-batches on the
        last stage, None on the others."""
        if self.stage.is_last and target is None:
            raise ValueError("the last stage computes the loss: pass target=")
        self._losses.clear()
        try:
            self.schedule.step(*inputs, target=target, **kwargs)
        except BaseException:
            self.train_step.optimizer.zero_grad(set_to_none=True)
            self.train_step.network.zero_grad(set_to_none=True)
            raise
        self.train_step.step_gradients()
        # the micro-batches' losses (the first step's metadata inference computes one more)
        losses = self._losses[-self._n_microbatches :]
        return torch.stack(losses).mean() if losses else None

    # ------------------------------------------------------------------ what happened
    @property
    def overflow(self) -> bool:
        """Whether the last optimizer step was skipped (on every stage)."""
        return self.train_step.overflow

    @property
    def loss_scale(self) -> float:
        return self.train_step.loss_scale

    @property
    def skipped_steps(self) -> int:
        return self.train_step.skipped_steps

    @property
    def optimizer_steps(self) -> int:
        return self.train_step.optimizer_steps

    def state_dict(self) -> dict[str, Any]:
        """The stage's checkpoint (its part's weights, the scale and the counters)."""
        return self.train_step.state_dict()

    def load_state_dict(self, state_dict: Any) -> Any:
        return self.train_step.load_state_dict(state_dict)


def pipeline_step(
    stage_module: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    level: str | Level = "O0",
    *,
    stage_index: int,
    num_stages: int,
    n_microbatches: int,
    schedule: type | None = None,
    dtype: torch.dtype | str | None = None,
    loss_scale_manager: LossScaleManager | _Default | None = DEFAULT,
    clip_grad_norm: float | None = None,
    lr_scheduler: Any = None,
    process_group: Any = None,
    device: torch.device | str | None = None,
) -> PipelineStep:
    """A training step for one stage of a pipeline, at a level (see the module docstring).

    Args:
        stage_module: this stage's part of the float32 model.
        optimizer: built on ``stage_module``'s parameters.
        loss_fn: ``loss_fn(output, target)``; every stage passes it (torch runs the
            backward only when there is a loss), the last stage calls it.
        level: as in :func:`mixprec.build_train_network`.
        stage_index / num_stages: this stage and the pipeline's length.
        n_microbatches: micro-batches per optimizer step (the batch is split along dim 0).
        schedule: a one-stage-per-process schedule class of ``torch.distributed.pipelining``
            (default ``ScheduleGPipe``; ``Schedule1F1B``).
        dtype: the low dtype.
        loss_scale_manager: left out, the level's default (float16: dynamic, its first
            scale from the first gradients); None for none; or a manager.
        clip_grad_norm: max norm of the whole model's unscaled gradients: the norm over
            every stage's (one more small all-reduce per step), as one process would clip.
        lr_scheduler: stepped after each applied optimizer step, never after a skipped one.
        process_group: the pipeline's stages (default: the whole world).
        device: where this stage runs (default: where its parameters are).

    Returns:
        A :class:`PipelineStep`: ``loss = step(*inputs, target=target)``.

    Raises:
        TypeError: a bad stage index, count or schedule.
        ValueError: an index outside the pipeline; without ``torch.distributed``; a process
            group whose size is not ``num_stages``.

    Example:
        >>> step = pipeline_step(part, opt, nn.MSELoss(), "O2", dtype="bf16", stage_index=rank,
        ...                      num_stages=2, n_microbatches=4)
    """
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from mixprec.training.build import build_train_network

    num_stages = _check_index(num_stages, "num_stages", 1)
    stage_index = _check_index(stage_index, "stage_index", 0, num_stages)
    n_microbatches = _check_index(n_microbatches, "n_microbatches", 1)
    schedule_class = _schedule_class(ScheduleGPipe if schedule is None else schedule)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable (every stage passes it); got {loss_fn!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("pipeline_step needs torch.distributed: call dist.init_process_group")
    group = dist.group.WORLD if process_group is None else process_group
    if dist.get_world_size(group) != num_stages:
        raise ValueError(
            f"num_stages={num_stages}, but the process group holds "
            f"{dist.get_world_size(group)} ranks: one stage per rank"
        )
    step = build_train_network(
        stage_module,
        optimizer,
        loss_fn,
        level,
        dtype=dtype,
        cast_model_type=torch.float32,  # cast at use: the stage divides float32 gradients
        loss_scale_manager=loss_scale_manager,
        lr_scheduler=lr_scheduler,
        after_unscale=None if clip_grad_norm is None else _ClipAcross(clip_grad_norm, group),
        process_group=process_group,
    )
    own = next((p.device for p in step.network.parameters()), torch.device("cpu"))
    where = own if device is None else torch.device(device)
    stage = PipelineStage(step.network, stage_index, num_stages, where, group=process_group)
    return PipelineStep(step, stage, schedule_class, n_microbatches, loss_fn)
