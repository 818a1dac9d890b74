"""mixprec inside Lightning: a Trainer precision plugin and a Fabric precision plugin.

``MixedPrecision`` goes in ``Trainer(plugins=[...])``; ``FabricMixedPrecision`` in
``Fabric(plugins=[...])``. Both are constructed like a conversion and do what
:func:`mixprec.build_train_network` does around the optimizer step:

* the LightningModule's children are converted in place (the module itself stays the
  object Lightning holds: its strategies drop what a plugin returns, and its forward
  redirection needs the original); pins name modules from the LightningModule;
* the loss is scaled before backward, the gradients are unscaled before anything reads
  them (``on_before_optimizer_step``, gradient clipping), and a step whose gradients
  overflowed is skipped: the optimizer does not step, ``global_step`` does not count it
  and learning-rate schedulers do not move;
* the loss scale and its counters are in the checkpoint (resume is exact), and the loss
  scale, skipped steps and the last step's overflow are logged (``mixprec/...``) through
  the module's logger; the module whose gradient overflowed is in ``overflow_module``.

Under ``strategy="ddp"`` the gradients are reduced before the check, so every rank
skips the same steps. Under ``ModelParallelStrategy`` shard the model with
:func:`mixprec.distributed.fully_shard` in ``configure_model`` (at the plugin's level and
dtype): the plugin leaves it to FSDP2 to cast, and the ranks agree on an overflow found
in any rank's shards.

Example:
    >>> trainer = lightning.Trainer(plugins=[MixedPrecision("O2", "bf16")], max_steps=10)
    >>> trainer.fit(model, data)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn
from torch.optim import LBFGS, Optimizer

from mixprec._outer import PluginCore, PrecisionSettings, ScalingReport, SkipAwareScheduler
from mixprec.policy.levels import Level, Pins
from mixprec.training.build import DEFAULT
from mixprec.training.scaling import LossScaleManager

__all__ = ["FabricMixedPrecision", "MixedPrecision", "SkipAwareScheduler"]


class _Shared(ScalingReport):
    """The settings and loss scaling both plugins hold (a :class:`PluginCore`)."""

    @property
    def settings(self) -> PrecisionSettings:
        """The level, dtype and pins the model is converted with."""
        return self.core.settings

    def state_dict(self) -> dict[str, Any]:
        """The loss scale, its counters and the step counts."""
        return self.scaling.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (learning-rate schedulers stay in step)."""
        self.scaling.load_state_dict(state_dict)

    def __repr__(self) -> str:
        s = self.settings
        return (
            f"{type(self).__name__}(level={s.level.value!r}, dtype={s.dtype}, "
            f"loss_scale_manager={self.scaling.manager!r}, emulate={s.emulate})"
        )


class MixedPrecision(_Shared, Precision):
    """A Lightning Trainer precision plugin: mixprec's levels and loss scaling.

    Args:
        level: ``"O0"``-``"O3"``, ``"autocast"`` or ``"auto"`` (as
            :func:`mixprec.auto_mixed_precision`).
        dtype: ``"bf16"``/``"fp16"`` or a torch dtype; None for the device's usual one.
        fp32_modules / low_modules: pins (qualified names from the LightningModule, or a
            ``(module, name) -> bool`` filter).
        loss_scale_manager: a mixprec loss-scale manager; left out: dynamic for float16,
            none for bfloat16; None: no loss scaling.
        emulate: emulate the low-precision GEMMs with float32 kernels (any CPU).
        declared_fp32: keep the modules a transformers model declares float32 in float32.
        log_metrics: log ``mixprec/loss_scale``, ``mixprec/skipped_steps``,
            ``mixprec/overflow`` (and ``mixprec/grad_norm`` when clipping by norm) each step.

    Example:
        >>> trainer = lightning.Trainer(plugins=[MixedPrecision("O2", "fp16", emulate=True)])
    """

    precision = "32-true"  # the stored Parameters stay float32 (cast at use)

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
        log_metrics: bool = True,
    ) -> None:
        self.core = PluginCore(
            level, dtype, fp32_modules, low_modules, loss_scale_manager, emulate, declared_fp32
        )
        if not isinstance(log_metrics, bool):
            raise TypeError(f"log_metrics must be a bool (True or False); got {log_metrics!r}")
        self.log_metrics = log_metrics
        self._schedulers: list[SkipAwareScheduler] = []

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Convert the LightningModule's children in place; returns the module itself."""
        return self.core.convert_children_(module)

    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        """Make every learning-rate scheduler skip-aware."""
        for config in lr_schedulers:
            if not isinstance(config.scheduler, SkipAwareScheduler):
                config.scheduler = SkipAwareScheduler(config.scheduler, self.scaling)
            self._schedulers.append(config.scheduler)
        return model, optimizers, lr_schedulers

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        """The hooks' loss, then the scaled loss for backward."""
        return self.scaling.scale(super().pre_backward(tensor, module))

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: Any,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure, unscale, the hooks and clipping, then step unless overflowed."""
        if not self.scaling.enabled:
            result = self.scaling.step(
                optimizer,
                lambda: super(MixedPrecision, self).optimizer_step(
                    optimizer, model, closure, **kwargs
                ),
            )
            self._log(model)
            return result
        if isinstance(optimizer, LBFGS):
            raise TypeError("loss scaling and the LBFGS optimizer are not compatible")
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            return None  # training_step returned None: no backward, no step
        self.scaling.unscale_(optimizer)
        self._after_closure(model, optimizer)
        result = self.scaling.step(optimizer, lambda: optimizer.step(**kwargs), model)
        if self.scaling.overflow:
            _uncount_step(model)
        self._log(model)
        return result

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Unscale first (once per step: the step does not unscale again), then clip.

        In automatic optimization the step has unscaled already; in manual optimization
        ``self.clip_gradients(opt, ...)`` after ``manual_backward`` is where the gradients
        are unscaled, so the clip bounds the true gradients, and ``opt.step()`` still skips
        them if they overflowed.
        """
        if clip_val > 0 and self.scaling.enabled:
            self.scaling.unscale_(optimizer)
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clip the unscaled gradients; the norm before clipping is logged."""
        params = list(self.main_params(optimizer))
        norm = torch.nn.utils.clip_grad_norm_(params, clip_val)
        full = getattr(norm, "full_tensor", None)  # FSDP2: the norm of every rank's shards
        self.scaling.grad_norm = norm if full is None else full()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for scheduler in self._schedulers:
            scheduler.seen = scheduler.taken()

    def _log(self, model: Any) -> None:
        if not self.log_metrics or getattr(model, "_trainer", None) is None:
            return
        metrics = {f"mixprec/{k}": v for k, v in self.scaling.metrics().items()}
        model.log_dict(metrics, on_step=True, on_epoch=False, logger=True, prog_bar=False)


def _uncount_step(model: Any) -> None:
    """Take a skipped optimizer step out of Lightning's step count (``global_step``).

    Lightning counts the step as completed after this hook returns; one less now makes
    the count the number of steps the optimizer took.
    """
    loop = model.trainer.fit_loop.epoch_loop
    if model.automatic_optimization:
        progress = loop.automatic_optimization.optim_progress.optimizer.step
    else:
        progress = loop.manual_optimization.optim_step_progress
    progress.total.completed -= 1
    progress.current.completed -= 1


class FabricMixedPrecision(_Shared, FabricPrecision):
    """A Lightning Fabric precision plugin: mixprec's levels and loss scaling.

    Arguments as :class:`MixedPrecision` (without ``log_metrics``). ``fabric.backward``
    scales the loss; ``fabric.clip_gradients`` unscales first (once per step, however
    often it is called); ``optimizer.step()`` skips a step whose gradients overflowed
    (returns None). Put the plugin in ``fabric.save``'s state to checkpoint the loss
    scale, and wrap a learning-rate scheduler with :meth:`skip_aware`.

    Example:
        >>> plugin = FabricMixedPrecision("O2", "bf16")
        >>> fabric = lightning.Fabric(accelerator="cpu", plugins=[plugin])
    """

    precision = "32-true"

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

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Convert the module's children in place; returns the module itself."""
        return self.core.convert_children_(module)

    def backward(
        self, tensor: torch.Tensor, model: nn.Module | None, *args: Any, **kwargs: Any
    ) -> None:
        """Backward on the scaled loss."""
        super().backward(self.scaling.scale(tensor), model, *args, **kwargs)

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale the gradients in place (once per step; later calls do nothing)."""
        self.scaling.unscale_(optimizer)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step unless the gradients overflowed (then None); update the loss scale."""
        return self.scaling.step(optimizer, lambda: optimizer.step(**kwargs))

    def skip_aware(self, scheduler: Any) -> SkipAwareScheduler:
        """``scheduler`` wrapped so that a skipped optimizer step does not move it."""
        return SkipAwareScheduler(scheduler, self.scaling)
