"""mixprec inside the Hugging Face Trainer and Accelerate.

transformers 5.x has no precision plugin: ``Trainer(bf16=True)`` and
``Accelerator(mixed_precision=...)`` wrap the model in an outer ``torch.autocast`` (which
does nothing for float16 on a CPU). mixprec fits in three ways:

* :class:`MixprecCallback` converts the model's children in place when the Trainer is
  built, logs the cast plan when training begins and the loss scale, skipped steps and
  last overflow (``mixprec/...``) with every log. Enough for bfloat16 (no loss scaling):
  ``Trainer(model, TrainingArguments(bf16=False, ...), callbacks=[MixprecCallback("O2", "bf16")])``.
* :class:`MixprecTrainer` (float16, or any level with loss scaling): a ``Trainer`` that
  takes the callback and adds what loss scaling needs: the loss is scaled before
  backward and unscaled before clipping (``max_grad_norm`` and the logged ``grad_norm``
  see true gradients); at the last micro-batch of ``gradient_accumulation_steps`` an
  overflow skips the optimizer step, and Accelerate's ``optimizer_step_was_skipped``
  says so, so the Trainer leaves the learning-rate schedule where it was and still
  counts the step in ``global_step``, as its own float16 path does; the scale is saved
  with every checkpoint (``mixprec_scaling.pt``) and restored on resume.
* :func:`prepare` for an Accelerate loop: checks the Accelerator, prepares the model and
  optimizer, builds :func:`mixprec.build_train_network`'s step and registers it for
  checkpointing (``accelerator.save_state`` keeps the loss scale); a skipped step shows
  in ``accelerator.optimizer_step_was_skipped`` and a prepared scheduler does not move.

``save_model``/``save_pretrained`` write the ordinary float32 weights, which
``from_pretrained`` loads into an unconverted model.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback

from mixprec._outer import LoopScaling, PluginCore, ScalingReport, report_skips
from mixprec._warn import warn
from mixprec.convert.structure import find_converted
from mixprec.policy.levels import Level, Pins
from mixprec.training.build import DEFAULT, build_train_network
from mixprec.training.scaling import LossScaleManager
from mixprec.training.step import StepSeam, TrainStep

__all__ = ["MixprecCallback", "MixprecTrainer", "prepare"]

logger = logging.getLogger("mixprec")

#: The file beside each Trainer checkpoint that holds the loss scaling's state.
STATE_FILE = "mixprec_scaling.pt"


class MixprecCallback(ScalingReport, TrainerCallback):
    """Converts the Trainer's model and logs what mixprec does.

    After each step it reports ``overflow``, ``skipped_steps``, ``loss_scale`` and the
    other figures of :class:`mixprec.TrainStep`.

    Args:
        level / dtype / fp32_modules / low_modules / emulate / declared_fp32: as
            :func:`mixprec.auto_mixed_precision` (pins name modules of the model).
        loss_scale_manager: used by :class:`MixprecTrainer`; left out: dynamic for
            float16, none for bfloat16; None: no loss scaling. A plain ``Trainer``
            cannot scale the loss: use :class:`MixprecTrainer` when there is a manager.

    Example:
        >>> trainer = Trainer(model, args, train_dataset=data, callbacks=[MixprecCallback("O2", "bf16")])
    """

    def __init__(
        self,
        level: str | Level = "O2",
        dtype: torch.dtype | str | None = None,
        *,
        fp32_modules: Pins = None,
        low_modules: Pins = None,
        loss_scale_manager: LossScaleManager | object | None = DEFAULT,
        emulate: bool = False,
        declared_fp32: bool = True,
    ) -> None:
        self.core = PluginCore(
            level, dtype, fp32_modules, low_modules, loss_scale_manager, emulate, declared_fp32
        )
        self.scaled_by_trainer = False
        self.resume_dir: str | None = None

    def convert(self, model: nn.Module) -> nn.Module:
        """Convert ``model``'s children in place; returns ``model``."""
        return self.core.convert_children_(model)

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        if model is None:
            return
        for flag in ("fp16", "bf16"):
            if getattr(args, flag, False):
                raise ValueError(
                    f"TrainingArguments({flag}=True) runs the model under an outer torch.autocast, "
                    "which overrides mixprec's float32 modules; pass fp16=False and bf16=False "
                    "and let mixprec set the precision"
                )
        self.convert(model)
        if self.scaling.enabled and not self.scaled_by_trainer:
            raise ValueError(
                f"loss scaling ({self.scaling.manager!r}) needs MixprecTrainer: a plain Trainer "
                "cannot scale the loss; use MixprecTrainer(..., mixprec=callback) or pass "
                "loss_scale_manager=None"
            )

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        if model is not None and logger.isEnabledFor(logging.INFO):
            from mixprec.convert.plan import explain

            for name, child in model.named_children():
                if next(iter(find_converted(child)), None) is not None:
                    logger.info("mixprec plan of %s:\n%s", name, explain(child))
        where = self.resume_dir
        if where is None and state.global_step > 0:
            where = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if where is not None and os.path.isfile(os.path.join(where, STATE_FILE)):
            self.scaling.load_state_dict(torch.load(os.path.join(where, STATE_FILE)))

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not args.should_save:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(folder):
            torch.save(self.scaling.state_dict(), os.path.join(folder, STATE_FILE))

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        logs = kwargs.get("logs")
        if logs is not None and not self.scaled_by_trainer:
            # the Trainer put a copy of ``logs`` in the history before the callbacks run
            logs.update(self.metrics())
            if state.log_history:
                state.log_history[-1].update(self.metrics())

    def metrics(self) -> dict[str, float]:
        """``mixprec/loss_scale``, ``mixprec/skipped_steps``, ``mixprec/overflow``."""
        found = self.scaling.metrics()
        found.pop("grad_norm", None)  # the Trainer logs its own (unscaled) grad_norm
        return {f"mixprec/{k}": v for k, v in found.items()}


class _SkippingOptimizer(torch.optim.Optimizer):
    """An optimizer whose ``step`` goes through the loss scaling (skipped on overflow).

    Everything else (``param_groups``, ``state``, ``state_dict``) is the wrapped
    optimizer's, so checkpoints are the ordinary optimizer's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scaling: Callable[[], LoopScaling]):
        # no Optimizer.__init__: the wrapped optimizer owns the groups and the state
        self.optimizer = optimizer
        self._scaling = scaling

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        return self._scaling().step(self, lambda: self.optimizer.step(closure))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)

    def __repr__(self) -> str:
        return f"mixprec-scaled {self.optimizer!r}"


class MixprecTrainer(Trainer):
    """A ``Trainer`` with mixprec's levels and loss scaling.

    Args:
        *args / **kwargs: as ``transformers.Trainer``.
        mixprec: the :class:`MixprecCallback` with the level, dtype and loss scaling.

    Example:
        >>> trainer = MixprecTrainer(model, args, train_dataset=data,
        ...                          mixprec=MixprecCallback("O2", "fp16", emulate=True))
    """

    def __init__(self, *args: Any, mixprec: MixprecCallback, **kwargs: Any) -> None:
        if not isinstance(mixprec, MixprecCallback):
            raise TypeError(f"mixprec must be a MixprecCallback; got {mixprec!r}")
        mixprec.scaled_by_trainer = True
        self.mixprec = mixprec
        self._scaling_loss = False
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), mixprec]
        super().__init__(*args, **kwargs)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        optimizer = (
            super().create_optimizer(model) if model is not None else super().create_optimizer()
        )
        if not isinstance(optimizer, _SkippingOptimizer):
            optimizer = _SkippingOptimizer(optimizer, lambda: self.mixprec.scaling)
            self.optimizer = optimizer
        return optimizer

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> Any:
        # called once Accelerate has wrapped the optimizer: from now on a skipped step is
        # Accelerate's ``optimizer_step_was_skipped``, which keeps the Trainer from
        # stepping the learning-rate schedule (and the schedule stays the ordinary one)
        report_skips(self.optimizer, self.mixprec.scaling)
        return super().create_scheduler(num_training_steps, optimizer)

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        result = super().compute_loss(*args, **kwargs)
        if not self._scaling_loss:
            return result
        if isinstance(result, tuple):
            return (self.mixprec.scaling.scale(result[0]), *result[1:])
        return self.mixprec.scaling.scale(result)

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        scale = self.mixprec.scaling.loss_scale
        self._scaling_loss = True
        try:
            loss = super().training_step(*args, **kwargs)
        finally:
            self._scaling_loss = False
        if self.accelerator.sync_gradients and isinstance(
            self._scaled_optimizer, _SkippingOptimizer
        ):
            self.mixprec.scaling.unscale_(self._scaled_optimizer)  # before clipping and grad_norm
        return loss / scale

    @property
    def _scaled_optimizer(self) -> torch.optim.Optimizer | None:
        """The mixprec-scaled optimizer under Accelerate's wrapper."""
        optimizer = self.optimizer
        return getattr(optimizer, "optimizer", optimizer) if optimizer is not None else None

    def train(
        self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        if isinstance(resume_from_checkpoint, str):
            self.mixprec.resume_dir = resume_from_checkpoint
        elif resume_from_checkpoint:
            from transformers.trainer_utils import get_last_checkpoint

            self.mixprec.resume_dir = get_last_checkpoint(self.args.output_dir)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        super().log({**logs, **self.mixprec.metrics()}, *args, **kwargs)


class _AccelerateSync(StepSeam):
    """Tells Accelerate which micro-batch ends an optimizer step (``sync_gradients``), as
    ``accelerator.accumulate`` does, so a prepared scheduler steps once per optimizer step."""

    def __init__(self, accelerator: Any) -> None:
        self.gradient_state = accelerator.gradient_state

    def before_forward(
        self, step: TrainStep, inputs: tuple[Any, ...], kwargs: dict[str, Any], label: Any
    ) -> None:
        last = step._micro_step + 1 == step.config.accumulation_steps
        self.gradient_state._set_sync_gradients(last)


def prepare(
    accelerator: Any,
    network: nn.Module,
    optimizer: torch.optim.Optimizer,
    *others: Any,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    level: str | Level = "O2",
    **options: Any,
) -> tuple[Any, ...]:
    """mixprec's training step for an Accelerate loop: ``(step, *others prepared)``.

    Prepares ``network`` and ``optimizer`` with the Accelerator (device placement, DDP),
    builds :func:`mixprec.build_train_network` on them (``options`` are its keyword
    arguments: ``dtype``, ``loss_scale_manager``, ``emulate``, ...), and registers the
    step for checkpointing, so ``accelerator.save_state``/``load_state`` keep the loss
    scale. Call ``step(*inputs, label)`` for each batch: it runs forward, backward,
    unscale, the overflow check and the optimizer step. A skipped step is reported as
    Accelerate's own are (``accelerator.optimizer_step_was_skipped``, read lazily), so a
    scheduler prepared here does not move after it; ``step.overflow`` says the same. With
    ``accumulation_steps=N`` each call sets ``accelerator.sync_gradients`` (True on the
    N-th micro-batch only, as ``accelerator.accumulate`` would), so a prepared scheduler
    steps once per optimizer step (no ``accelerator.accumulate`` is needed).

    Warns when the Accelerator was given a ``mixed_precision``: on top of mixprec it is
    an outer autocast that overrides mixprec's float32 modules, and
    ``mixed_precision="fp16"`` on a CPU does nothing at all.

    Example:
        >>> accelerator = accelerate.Accelerator(cpu=True)
        >>> step, loader = prepare(accelerator, model, optimizer, loader, loss_fn=loss_fn, dtype="bf16")
    """
    precision = str(getattr(accelerator, "mixed_precision", "no"))
    if precision != "no":
        on_cpu = accelerator.device.type == "cpu"
        silent = " (on a CPU Accelerate's float16 does nothing at all)" if on_cpu else ""
        warn(
            f"Accelerator(mixed_precision={precision!r}) adds an outer torch.autocast that "
            f"overrides mixprec's precision{silent}; create it with mixed_precision='no' and "
            "let mixprec set the precision"
        )
    prepared = accelerator.prepare(network, optimizer, *others)
    model, opt, rest = prepared[0], prepared[1], prepared[2:]
    inner = getattr(opt, "optimizer", opt)
    step: TrainStep = build_train_network(model, inner, loss_fn, level, **options)
    report_skips(opt, step)
    step.seams.append(_AccelerateSync(accelerator))
    accelerator.register_for_checkpointing(step)
    return (step, *rest)
