"""The training step, :class:`TrainStep` (built by :func:`mixprec.build_train_network`).

One call turns a model, its optimizer and a loss into a training step at a level::

    step = mixprec.build_train_network(model, optimizer, nn.CrossEntropyLoss(), level="O2")
    for images, labels in loader:
        loss = step(images, labels)        # forward, loss in fp32, scaled backward, step
        if step.overflow:                  # the step was skipped, and says why
            print(f"skipped: gradients overflowed at loss scale {step.loss_scale}")

Each call: forward; the loss in float32 (output and label cast first); backward on the
scaled loss; (with master weights) low-precision gradients moved onto float32 masters;
unscale (float64 reciprocal) and the overflow check, fused; one overflow decision for all
ranks; clip; the optimizer step only when the gradients are finite (or when the
loss-scale manager says not to drop); refresh of the low-precision weights; the
loss-scale update. With ``accumulation_steps=N``, N calls make one optimizer step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from mixprec.distributed import agree_on_overflow
from mixprec.grads import any_non_finite, inverse_scale, unscale_grads_
from mixprec.levels import Level
from mixprec.master import MasterWeights
from mixprec.ops import cast_tree
from mixprec.scaling import LossScaleManager

__all__ = ["TrainConfig", "TrainStep"]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What a training step does, resolved from the level and the keyword arguments."""

    level: Level
    dtype: torch.dtype | None
    cast_model_type: torch.dtype
    keep_batchnorm_fp32: bool
    master_weights: bool
    accumulation_steps: int
    clip_grad_norm: float | None
    reason: str = ""


def _loss_of(output: Any) -> torch.Tensor:
    """The loss a network returned: a tensor, ``output["loss"]``, ``output.loss`` or ``output[0]``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and "loss" in output:
        return output["loss"]
    if getattr(output, "loss", None) is not None:
        return output.loss
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(
        f"without loss_fn the network must return its loss (a tensor, a dict with 'loss', or an "
        f"object with .loss); got {type(output).__name__}"
    )


class TrainStep(nn.Module):
    """One training step per call (see :func:`build_train_network`).

    Attributes:
        network: the converted model (evaluate with ``step.network.eval()``).
        optimizer: the optimizer; it steps float32 weights.
        overflow: whether the last optimizer step was skipped for non-finite gradients.
        skipped_steps: how many optimizer steps were skipped so far.
        loss_scale: the current loss scale (1.0 without a manager).
    """

    def __init__(
        self,
        network: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        config: TrainConfig,
        manager: LossScaleManager | None,
        masters: MasterWeights | None,
    ) -> None:
        super().__init__()
        self.network = network
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.config = config
        self.loss_scale_manager = manager
        self.masters = masters
        self.overflow = False
        self.skipped_steps = 0
        self.optimizer_steps = 0
        self._micro_step = 0

    @property
    def level(self) -> Level:
        return self.config.level

    @property
    def dtype(self) -> torch.dtype | None:
        return self.config.dtype

    @property
    def loss_scale(self) -> float:
        return (
            1.0
            if self.loss_scale_manager is None
            else float(self.loss_scale_manager.get_loss_scale())
        )

    def forward(self, *inputs: Any, **kwargs: Any) -> torch.Tensor:
        """Run one micro-batch; returns its unscaled float32 loss (detached)."""
        if self.loss_fn is not None:
            if not inputs:
                raise TypeError(
                    "step(*inputs, label): the label is the last positional argument; got none"
                )
            *net_inputs, label = inputs
            output = self.network(*net_inputs, **kwargs)
            loss = self.loss_fn(cast_tree(output, torch.float32), cast_tree(label, torch.float32))
        else:
            loss = _loss_of(self.network(*inputs, **kwargs))
        loss = loss.float()
        if loss.dim() != 0:
            raise ValueError(f"the loss must be a scalar tensor; got shape {tuple(loss.shape)}")
        (loss * (self.loss_scale / self.config.accumulation_steps)).backward()
        if self.masters is not None:
            self.masters.collect_grads()
        self._micro_step += 1
        if self._micro_step == self.config.accumulation_steps:
            self._micro_step = 0
            self._step()
        return loss.detach()

    def _step(self) -> None:
        params = [
            p
            for group in self.optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        grads = [p.grad for p in params]
        manager = self.loss_scale_manager
        check = manager is None or manager.get_drop_overflow_update()
        scale = self.loss_scale
        overflow = False
        if scale != 1.0 and grads:
            inverse = inverse_scale(
                torch.tensor(scale, dtype=torch.float64, device=grads[0].device)
            )
            found_inf = unscale_grads_(grads, inverse)  # unscale and check in one fused pass
            if check:
                overflow = bool(agree_on_overflow(found_inf).item())  # the one host sync per step
        elif check:
            overflow = any_non_finite(grads)
        if overflow:
            self.skipped_steps += 1
        else:
            if self.config.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, self.config.clip_grad_norm)
            self.optimizer.step()
            if self.masters is not None:
                self.masters.refresh()
        self.optimizer_steps += 1
        self.overflow = overflow
        if self.masters is not None:
            self.masters.step_done()
        if manager is not None:
            manager.update_loss_scale(overflow)
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ checkpoints
    def get_extra_state(self) -> dict[str, Any]:
        if self._micro_step:
            raise RuntimeError(
                f"cannot checkpoint in the middle of gradient accumulation ({self._micro_step} of "
                f"{self.config.accumulation_steps} micro-batches done): save after an optimizer step"
            )
        return {
            "loss_scale_manager": None
            if self.loss_scale_manager is None
            else self.loss_scale_manager.state_dict(),
            "masters": None if self.masters is None else self.masters.state(),
            "overflow": self.overflow,
            "skipped_steps": self.skipped_steps,
            "optimizer_steps": self.optimizer_steps,
        }

    def set_extra_state(self, state: Any) -> None:
        if not isinstance(state, Mapping):
            raise ValueError(f"not a mixprec training-step checkpoint: {type(state).__name__}")
        if (state.get("loss_scale_manager") is None) != (self.loss_scale_manager is None):
            raise ValueError("the checkpoint and this step disagree on having a loss-scale manager")
        if self.loss_scale_manager is not None:
            self.loss_scale_manager.load_state_dict(state["loss_scale_manager"])
        if (state.get("masters") is None) != (self.masters is None):
            raise ValueError("the checkpoint and this step disagree on master weights")
        if self.masters is not None:
            self.masters.load(state["masters"])
        self.overflow = bool(state["overflow"])
        self.skipped_steps = int(state["skipped_steps"])
        self.optimizer_steps = int(state["optimizer_steps"])
        self._micro_step = 0

    def extra_repr(self) -> str:
        c = self.config
        dtype = "-" if c.dtype is None else str(c.dtype).removeprefix("torch.")
        level = f"{c.level.value} ({c.reason})" if c.reason else c.level.value
        params = str(c.cast_model_type).removeprefix("torch.")
        return (
            f"level={level}, dtype={dtype}, parameters={params}, master_weights={c.master_weights}, "
            f"loss_scale_manager={self.loss_scale_manager!r}, accumulation_steps={c.accumulation_steps}, "
            f"clip_grad_norm={c.clip_grad_norm}"
        )
