"""The training step, :class:`TrainStep` (built by :func:`mixprec.build_train_network`).

One call turns a model, its optimizer and a loss into a training step at a level::

    step = mixprec.build_train_network(model, optimizer, nn.CrossEntropyLoss(), level="O2")
    for images, labels in loader:
        loss = step(images, labels)        # forward, loss in fp32, scaled backward, step
        if step.overflow:                  # the step was skipped, and says why
            print(f"skipped: gradients overflowed at loss scale {step.loss_scale}")

Each call: forward (with master weights, outside writes reconciled first); the loss in float32
(output and label cast first); backward on the loss times the scale (a device tensor);
low-precision gradients moved onto float32 masters; unscale (float64 reciprocal) and the
overflow check, fused; one overflow decision for all ranks; the ``after_unscale`` seam;
clip; the optimizer step only when the gradients are finite (or when the manager says not
to drop); refresh of the low-precision weights; the loss-scale update on the device; the
``lr_scheduler`` on applied steps, ``after_skip`` on skipped ones. With
``accumulation_steps=N``, N calls make one optimizer step. Whenever a step is abandoned
(an exception in forward or backward, a skip, a raise) its gradients are cleared.

Under ``torch.distributed`` (:mod:`mixprec.distributed`): the step calls the user's DDP
wrapper (left as it was) with the converted network in place for the call, reduces
gradients on the last micro-batch only (``no_sync`` before it; FSDP2 every micro-batch),
agrees with its process group (under DDP from the all-reduced gradients, otherwise in one
all-reduce per optimizer step), and joins uneven inputs (``step.join()``): all
through the replica agreement it holds (``step.agreement``, :mod:`mixprec.distributed.step`).

Host syncs: at most one per optimizer step (reading the overflow flag before the optimizer
step). With an optimizer that takes ``found_inf`` itself (``fused=True`` Adam, AdamW, SGD)
there is none: the optimizer skips on the device, and ``overflow``, ``loss_scale`` and
``skipped_steps`` are read lazily.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from torch import nn
from torch.utils._pytree import tree_map

from mixprec._warn import warn
from mixprec.distributed.replicas import Replicas
from mixprec.distributed.step import Agreement, local_shard, without_ddp_prefix
from mixprec.policy.levels import Level
from mixprec.policy.ops import cast_tree
from mixprec.training.grads import _inverse_scale, mark_unscaled, total_norm
from mixprec.training.master import MasterWeights
from mixprec.training.scale_state import FLOAT32_MAX
from mixprec.training.scaling import LossScaleManager, NoLossScale, overflow_limit_message
from mixprec.training.step_state import (
    GradNorm,
    StepLedger,
    check_checkpoint,
    check_extra_state,
    choose_initial_scale,
    settled_initial_scale,
)

if TYPE_CHECKING:
    from mixprec.boost.plan import BoostPlan

__all__ = ["StepHooks", "StepMetrics", "StepSeam", "TrainConfig", "TrainStep"]

_S = TypeVar("_S", bound="StepSeam")


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
    #: the first optimizer step runs at scale 1 and picks the scale from its gradients
    auto_loss_scale: bool = False
    #: without loss_fn: the index, key or attribute of the loss in the network's output
    output_loss: int | str | None = None


class StepSeam:
    """A part plugged into the step: the one way anything joins it (the user's hooks, a
    boost plan, the overflow debugger). Every method does nothing by default; the step
    calls its seams (``step.seams``) in order.
    """

    @property
    def needs_host_decision(self) -> bool:
        """The seam must know on the host whether an optimizer step ran (so the step does
        not leave the skip to a fused optimizer on the device)."""
        return False

    @property
    def inspects_gradients(self) -> bool:
        """The seam looks at the unscaled gradients in :meth:`after_unscale` (the step then
        marks them unscaled, so that a ``mixprec.unscale_`` there leaves them alone); by
        default, whether the subclass overrides :meth:`after_unscale`."""
        return type(self).after_unscale is not StepSeam.after_unscale

    def before_forward(
        self, step: TrainStep, inputs: tuple[Any, ...], kwargs: dict[str, Any], label: Any
    ) -> None:
        """Before a micro-batch's forward: the network's inputs, and the label (None
        without a ``loss_fn``)."""

    def after_backward(self, step: TrainStep) -> None:
        """After a micro-batch's backward, also when it raised."""

    def after_unscale(self, step: TrainStep, params: list[torch.Tensor]) -> None:
        """On every optimizer step, once the gradients are unscaled and ``step.found_inf``
        is known, before clipping and the optimizer step."""

    def after_step(self, step: TrainStep, applied: bool | None, scale: torch.Tensor | None) -> None:
        """After an optimizer step and the scale update: ``applied`` is whether it ran (None:
        decided on the device), ``scale`` the loss scale it used (None: unscaled)."""


@dataclasses.dataclass(frozen=True)
class StepHooks:
    """The seams of a step; every one is optional and does nothing by default.

    Attributes:
        after_unscale: ``after_unscale(step, params)`` runs on every optimizer step after
            the gradients (``p.grad`` for ``p`` in ``params``, the Parameters the optimizer
            steps) are unscaled and the overflow flag is computed (``step.found_inf``, a
            0-dim tensor), before clipping and the optimizer step: inspect, log or clip
            there. The skip decision is already made from the gradients as they were.
        after_skip: ``after_skip(step)`` runs after a skipped optimizer step.
        lr_scheduler: stepped after every applied optimizer step, never after a skipped one.
    """

    after_unscale: Callable[[TrainStep, list[torch.Tensor]], None] | None = None
    after_skip: Callable[[TrainStep], None] | None = None
    lr_scheduler: Any = None

    @property
    def need_host_decision(self) -> bool:
        """``after_skip`` and the scheduler need to know on the host whether the step ran."""
        return self.after_skip is not None or self.lr_scheduler is not None


class _UserSeam(StepSeam):
    """The user's :class:`StepHooks` as a seam."""

    def __init__(self, hooks: StepHooks) -> None:
        self.hooks = hooks

    @property
    def needs_host_decision(self) -> bool:
        return self.hooks.need_host_decision

    @property
    def inspects_gradients(self) -> bool:
        return self.hooks.after_unscale is not None

    def after_unscale(self, step: TrainStep, params: list[torch.Tensor]) -> None:
        if self.hooks.after_unscale is not None:
            self.hooks.after_unscale(step, params)

    def after_step(self, step: TrainStep, applied: bool | None, scale: torch.Tensor | None) -> None:
        if applied is True and self.hooks.lr_scheduler is not None:
            self.hooks.lr_scheduler.step()
        if applied is False and self.hooks.after_skip is not None:
            self.hooks.after_skip(step)


class _BoostSeam(StepSeam):
    """A boost plan's per-call work (the first call's trials, the freeze schedule)."""

    def __init__(self, plan: BoostPlan) -> None:
        self.plan = plan

    def before_forward(
        self, step: TrainStep, inputs: tuple[Any, ...], kwargs: dict[str, Any], label: Any
    ) -> None:
        self.plan.before_forward(step.network, inputs, step.optimizer_steps)

    def after_backward(self, step: TrainStep) -> None:
        self.plan.after_backward()


class _OverflowSeam(StepSeam):
    """``debug_overflow=True``: keep each micro-batch, probe it when its step is skipped."""

    @property
    def needs_host_decision(self) -> bool:
        return True

    def __init__(self) -> None:
        from mixprec.diagnose.skip import OverflowDebugger  # an optional wing: lazily

        self.debugger = OverflowDebugger()
        self.batch: tuple[tuple[Any, ...], dict[str, Any], Any] | None = None

    def before_forward(
        self, step: TrainStep, inputs: tuple[Any, ...], kwargs: dict[str, Any], label: Any
    ) -> None:
        self.batch = (inputs, kwargs, label)

    def after_step(self, step: TrainStep, applied: bool | None, scale: torch.Tensor | None) -> None:
        if applied is False and self.batch is not None:
            inputs, kwargs, label = self.batch
            used = 1.0 if scale is None else float(scale)
            self.debugger.after_skip(
                step.network, inputs, kwargs, step.loss_fn, label, loss_scale=used
            )


def _as_loss(value: Any, source: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or not (value.is_floating_point()):
        what = (
            f"a {value.dtype} tensor"
            if isinstance(value, torch.Tensor)
            else f"{type(value).__name__}: {value!r}"
        )
        raise TypeError(
            f"{source} must return the loss as a floating scalar tensor (computed from the "
            f"output, so it has a gradient); got {what}"
        )
    if value.dim() != 0:
        hint = (
            " (a reduced loss: pass a loss_fn, or reduce it in the forward)"
            if source == "the network"
            else " (reduce it: .mean() or .sum())"
        )
        raise TypeError(
            f"{source} must return the loss as a floating scalar tensor; got a "
            f"{str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}{hint}"
        )
    return value.float()


def _describe(output: Any) -> str:
    if isinstance(output, torch.Tensor):
        return f"a {str(output.dtype).removeprefix('torch.')} tensor of shape {tuple(output.shape)}"
    if isinstance(output, Mapping):
        return f"a {type(output).__name__} with keys {list(output)[:8]}"
    if isinstance(output, (tuple, list)):
        return f"a {type(output).__name__} of ({', '.join(_describe(v) for v in output[:8])})"
    return type(output).__name__


def _loss_of(output: Any, pick: int | str | None = None) -> Any:
    """The loss a network returned: ``output[pick]`` (or ``output.pick``) when ``pick`` is
    given, else the output itself, ``output["loss"]``, ``output.loss`` or a scalar
    ``output[0]``."""
    if pick is not None:
        try:
            if isinstance(pick, str) and not isinstance(output, Mapping):
                return getattr(output, pick)
            return output[pick]
        except (KeyError, IndexError, AttributeError, TypeError) as error:
            raise ValueError(
                f"output_loss={pick!r}: the network returned {_describe(output)}, which has "
                f"no entry {pick!r}"
            ) from error
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and "loss" in output:
        return output["loss"]
    if getattr(output, "loss", None) is not None:
        return output.loss
    if isinstance(output, (tuple, list)) and output:
        first = output[0]
        if isinstance(first, torch.Tensor) and first.dim() == 0:
            return first
        scalars = [i for i, v in enumerate(output) if isinstance(v, torch.Tensor) and v.dim() == 0]
        hint = f" (e.g. output_loss={scalars[0]}, the scalar there)" if scalars else ""
        raise TypeError(
            f"without loss_fn the network must return its loss; it returned "
            f"{_describe(output)}: say which entry is the loss with build_train_network("
            f"..., output_loss=<index>){hint}, or pass a loss_fn"
        )
    raise TypeError(
        f"without loss_fn the network must return its loss (a tensor, a dict with 'loss', or an "
        f"object with .loss, or name it with output_loss=); it returned {_describe(output)}"
    )


def _detached(output: Any) -> Any:
    if isinstance(output, torch.Tensor):  # the common case, without a tree walk
        return output.detach()
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, output)


#: the base class's ``zero_grad``: the step clears gradients itself where it is not overridden
_ZERO_GRAD = torch.optim.Optimizer.zero_grad


def _profiling() -> bool:
    """Whether a profiler records (then torch's own labelled calls are made, for their ranges)."""
    return bool(torch.autograd.profiler._is_profiler_enabled)


class StepMetrics(Mapping[str, Any]):
    """A step's figures for logging, each read from the device only when looked up.

    Keys: ``loss_scale`` (the scale the next step uses), ``skipped_steps``,
    ``consecutive_overflows``, ``grad_norm`` (see :attr:`TrainStep.grad_norm`) and
    ``overflow_module`` (with ``debug_overflow=True``, the module the last skipped step's
    first non-finite value came from; None when not known).

    Example:
        >>> logger.log({k: v for k, v in step.metrics().items()})   # reads all: one wait
    """

    KEYS: ClassVar[tuple[str, ...]] = (
        "loss_scale",
        "skipped_steps",
        "consecutive_overflows",
        "grad_norm",
        "overflow_module",
    )

    def __init__(self, step: TrainStep) -> None:
        self._step = step

    def __getitem__(self, key: str) -> Any:
        if key not in self.KEYS:
            raise KeyError(f"{key!r} is not a step metric; the metrics are {list(self.KEYS)}")
        if key == "overflow_module":
            report = self._step.last_overflow_report
            culprit = None if report is None else (report.forward or report.backward)
            return None if culprit is None else culprit.module
        return getattr(self._step, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.KEYS)

    def __len__(self) -> int:
        return len(self.KEYS)

    def __repr__(self) -> str:
        return f"StepMetrics({', '.join(self.KEYS)}; read on access)"


def _fused_skip_ready(optimizer: torch.optim.Optimizer) -> bool:
    """Can the optimizer skip a step on the device from ``found_inf``?

    Fused Adam, AdamW and SGD can. A fused SGD with momentum whose momentum buffers do
    not exist yet would keep uninitialised buffers after a skipped first step (torch
    allocates them with ``empty_like``), so until its first applied step the decision
    is made on the host.
    """
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    for group in optimizer.param_groups:
        if group.get("momentum", 0) and isinstance(optimizer, torch.optim.SGD):
            for p in group["params"]:
                if optimizer.state.get(p, {}).get("momentum_buffer") is None:
                    return False
    return True


class TrainStep(nn.Module):
    """One training step per call (see :func:`build_train_network`).

    Attributes:
        network: the converted model (evaluate with ``step.network.eval()``).
        optimizer: the optimizer; with master weights it steps the float32 masters.
        overflow: whether the last optimizer step was skipped for non-finite gradients.
        skipped_steps: how many optimizer steps were skipped so far.
        loss_scale: the loss scale the next step uses (1.0 without a manager).
        found_inf: the last step's overflow flag as a 0-dim float32 tensor (no sync).
        grad_norm: the unscaled gradient norm of the last applied step (before clipping).
        last_output: what the network returned for the last micro-batch, detached (the
            logits for metrics, a recurrent state); None before the first call.
        last_overflow_report: with ``debug_overflow=True``, the
            :class:`~mixprec.diagnose.OverflowReport` of the last skipped step (the first
            non-finite module forward and backward, and a fix); None before a skip.

    ``overflow``, ``skipped_steps`` and ``loss_scale`` live on the device; reading one may
    wait for it.
    """

    #: a warning after this many consecutive skipped steps
    OVERFLOW_WARNING_AFTER: ClassVar[int] = 50
    #: a RuntimeError after more consecutive skipped steps than this
    MAX_CONSECUTIVE_OVERFLOWS: ClassVar[int] = 1000
    #: without a host sync per step, the limits are checked on every this-many-th step
    LIMIT_CHECK_INTERVAL: ClassVar[int] = 50
    #: plain Python state the step sets on every call: set straight into the instance's
    #: ``__dict__``, without ``nn.Module.__setattr__``'s walk of its registries
    _PLAIN: ClassVar[frozenset[str]] = frozenset(
        {"_micro_step", "optimizer_steps", "found_inf", "last_output", "_warned"}
    )

    def __init__(
        self,
        network: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        config: TrainConfig,
        manager: LossScaleManager | None,
        masters: MasterWeights | None,
        hooks: StepHooks | None = None,
        replicas: Replicas | None = None,
        *,
        debug_overflow: bool = False,
    ) -> None:
        super().__init__()
        self.network = network
        #: the replica agreement (DDP/FSDP2 forward, no_sync, the one all-reduce, join)
        self.agreement = Agreement(
            replicas or Replicas(), self._join_device, self._shadow_micro_batch
        )
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.config = config
        #: the loss-scale policy; :class:`NoLossScale` without a manager
        self.scaling: LossScaleManager = NoLossScale() if manager is None else manager
        self.masters = masters
        #: the parts plugged in, called in order (see :class:`StepSeam`)
        self.seams: list[StepSeam] = [_UserSeam(hooks or StepHooks())]
        self.optimizer_steps = 0
        self.found_inf = torch.zeros(())
        #: the last applied step's gradient norm, computed when needed (see GradNorm)
        self._norms = GradNorm(
            self._total_norm,
            eager=config.clip_grad_norm is not None
            or self.agreement.replicas.fsdp is not None
            or not type(optimizer).__module__.startswith("torch.optim."),
        )
        #: the network's output of the last micro-batch (detached; None before the first)
        self.last_output: Any = None
        self._micro_step = 0
        self._ledger = StepLedger()
        self._warned = False
        self._units: dict[torch.device, torch.Tensor] = {}
        if debug_overflow:
            self.seams.insert(0, _OverflowSeam())

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._PLAIN:
            self.__dict__[name] = value
        else:
            super().__setattr__(name, value)

    def _seam(self, kind: type[_S]) -> _S | None:
        return next((seam for seam in self.seams if isinstance(seam, kind)), None)

    @property
    def hooks(self) -> StepHooks:
        """The user's seams (``after_unscale``, ``after_skip``, ``lr_scheduler``)."""
        seam = self._seam(_UserSeam)
        assert seam is not None
        return seam.hooks

    @hooks.setter
    def hooks(self, hooks: StepHooks) -> None:
        seam = self._seam(_UserSeam)
        assert seam is not None
        seam.hooks = hooks

    @property
    def boost(self) -> BoostPlan | None:
        """The boost level's decisions (None at boost level O0)."""
        seam = self._seam(_BoostSeam)
        return None if seam is None else seam.plan

    @boost.setter
    def boost(self, plan: BoostPlan | None) -> None:
        self.seams = [seam for seam in self.seams if not isinstance(seam, _BoostSeam)]
        if plan is not None:
            self.seams.insert(0, _BoostSeam(plan))

    @property
    def training(self) -> bool:
        """The network's mode: ``step.train()``/``step.eval()`` set it and
        ``step.network.train()``/``.eval()`` change it; either is what the other reads."""
        network = self.__dict__.get("_modules", {}).get("network")
        return bool(self.__dict__.get("_training", True) if network is None else network.training)

    @training.setter
    def training(self, mode: bool) -> None:
        self.__dict__["_training"] = mode
        network = self.__dict__.get("_modules", {}).get("network")
        if network is not None:
            network.training = mode

    @property
    def last_overflow_report(self) -> Any:
        seam = self._seam(_OverflowSeam)
        return None if seam is None else seam.debugger.last_report

    # ------------------------------------------------------------------ what happened
    @property
    def level(self) -> Level:
        return self.config.level

    @property
    def dtype(self) -> torch.dtype | None:
        return self.config.dtype

    @property
    def overflow(self) -> bool:
        return self._ledger.read()[0]

    @property
    def skipped_steps(self) -> int:
        return self._ledger.read()[1]

    @property
    def consecutive_overflows(self) -> int:
        """Skipped optimizer steps in a row, up to the last one."""
        return self._ledger.read()[2]

    @property
    def loss_scale_manager(self) -> LossScaleManager | None:
        """The manager the step was built with (None: no loss scaling)."""
        return None if isinstance(self.scaling, NoLossScale) else self.scaling

    @property
    def loss_scale(self) -> float:
        if self._warming_up:
            return 1.0
        state = self.scaling.device_state()
        return float(state.scale) if state is not None else float(self.scaling.get_loss_scale())

    @property
    def grad_norm(self) -> float:
        """The L2 norm of the unscaled gradients of the last applied optimizer step (before
        clipping; NaN before the first). Kept on the device; reading it waits for it.

        Without ``clip_grad_norm`` it is computed when first read: a read after a call gives
        that call's step's norm (its gradients are kept until the next call begins), and from
        then on every applied step computes it. A read whose gradients went unread is NaN."""
        return float(self._norms.read())

    def metrics(self) -> StepMetrics:
        """What a training loop logs, as a read-only mapping read lazily: nothing waits for
        the device until a value is read (see :class:`StepMetrics`). Asking for it makes
        the gradient norm known: the last step's is computed now, on the device, and every
        applied step's from now on (so a lookup made after the next call has begun, as a
        loop that logs without waiting makes, finds a norm)."""
        self._norms.read()  # (a 0-dim tensor on the device: no wait)
        return StepMetrics(self)

    def _total_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        if self.agreement.replicas.fsdp is not None:  # DTensors: torch reduces the shards
            return torch.nn.utils.get_total_norm(grads)
        return total_norm(grads)

    @property
    def _warming_up(self) -> bool:
        return self.config.auto_loss_scale and self.optimizer_steps == 0

    # ------------------------------------------------------------------ the step
    def forward(self, *inputs: Any, **kwargs: Any) -> torch.Tensor:
        """Run one micro-batch; returns its unscaled float32 loss (detached)."""
        config = self.config
        steps = config.accumulation_steps
        last = self._micro_step + 1 == steps
        agreement = self.agreement
        loss_fn = self.loss_fn
        self._norms.release()  # the last step's gradients go before this backward
        try:
            if loss_fn is not None and not inputs:
                raise TypeError(
                    "step(*inputs, label): the label is the last positional argument; got none"
                )
            network_args = inputs[:-1] if loss_fn is not None else inputs
            label = inputs[-1] if loss_fn is not None else None
            for seam in self.seams:
                seam.before_forward(self, network_args, kwargs, label)
            # in one process without DDP, FSDP2 or a Join there is nothing to set up
            with contextlib.nullcontext() if agreement.idle else agreement.communication(last):
                output = agreement.run(self.network, *network_args, **kwargs)
                self.last_output = _detached(output)
                if loss_fn is not None:
                    loss = _as_loss(
                        loss_fn(cast_tree(output, torch.float32), cast_tree(label, torch.float32)),
                        "loss_fn",
                    )
                else:
                    loss = _as_loss(_loss_of(output, config.output_loss), "the network")
                scale = self._scale_tensor(loss.device)
                if scale is not None:
                    (loss * (scale / steps if steps > 1 else scale)).backward()
                else:
                    (loss / steps if steps > 1 else loss).backward()
            if self.masters is not None:
                self.masters.collect_grads()
        except BaseException:
            self._abandon()
            raise
        finally:
            for seam in self.seams:
                seam.after_backward(self)
        if last:
            self._micro_step = 0
            self._step()
        else:
            self._micro_step += 1
        return loss.detach()

    def _scale_tensor(self, device: torch.device) -> torch.Tensor | None:
        return None if self._warming_up else self.scaling.scale_on(device)

    # ------------------------------------------------------------------ a backward run elsewhere
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the next optimizer step's loss scale (a device tensor, no sync), for
        a backward the caller runs itself (a pipeline schedule,
        :mod:`mixprec.distributed.pipeline`); the loss itself without a manager and on the
        first step of an automatic scale. Then call :meth:`step_gradients`."""
        self._norms.release()
        scale = self._scale_tensor(loss.device)
        return loss if scale is None else loss * scale

    def step_gradients(self) -> None:
        """The optimizer step on the gradients a caller's own backward of a
        :meth:`scale_loss` loss left on the Parameters: what a call does after its backward
        (unscale, agree with the other ranks, clip, step or skip, update the scale).

        Raises:
            RuntimeError: in the middle of an accumulation of calls.
        """
        if self._micro_step:
            raise RuntimeError(
                f"step_gradients() in the middle of gradient accumulation ({self._micro_step} "
                f"of {self.config.accumulation_steps} micro-batches done by calls)"
            )
        self._norms.release()
        if self.masters is not None:
            self.masters.collect_grads()
        self._step()

    def _abandon(self) -> None:
        """Drop every gradient of an abandoned step (and its accumulation)."""
        self._micro_step = 0
        self.scaling.abandon()
        if self.masters is not None:
            self.masters.clear_grads()
        self.optimizer.zero_grad(set_to_none=True)
        self.network.zero_grad(set_to_none=True)

    def _step(self) -> None:
        optimizer = self.optimizer
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                grad = p.grad
                if grad is not None:
                    params.append(p)
                    grads.append(grad)
        manager = self.scaling
        check = manager.get_drop_overflow_update()
        device = grads[0].device if grads else self.found_inf.device
        ledger = self._ledger.snapshot()
        agreement = self.agreement
        interval = self.LIMIT_CHECK_INTERVAL
        warming = self._warming_up
        done = False
        applied: bool | None = True  # without a check, every step is applied
        try:
            local = grads
            if not all(type(g) is torch.Tensor for g in grads):
                with torch.no_grad():  # FSDP2: each rank checks its own shard
                    local = [local_shard(g) for g in grads]
            scale = None if warming else manager.scale_on(device)
            # one fused pass unscales and checks; with no scale it multiplies by exactly 1,
            # which on CPU is several times faster than an inf-norm reduction
            inverse = self._unit(device) if scale is None else _inverse_scale(scale)
            chosen = None
            # a policy's own per-part flags (a group's boundary) are each rank's even
            # under DDP: agreed whenever there are ranks (other policies send nothing)
            replicas = agreement.replicas
            found = manager.unscale_step(
                params, local, inverse, replicas.all_reduce_max if replicas.active else None
            )
            if warming:
                state = manager.device_state()
                if state is not None and state.dynamic:
                    chosen = choose_initial_scale(local, self.config.dtype or torch.float16)
            found, chosen = agreement.agree(found, chosen, manager, check, interval=interval)
            self.found_inf = found
            inspecting = [seam for seam in self.seams if seam.inspects_gradients]
            if inspecting:
                mark_unscaled(grads, found)  # an unscale_ in a seam leaves them alone
                for seam in inspecting:
                    seam.after_unscale(self, params)
            on_device = self._decides_on_device(check, manager)
            if check:
                if on_device:
                    self._ledger.update(found)
                    applied = None
                else:
                    applied = not self._ledger.record(found)[0]  # the one sync
            agreement.check(
                manager, skipped=None if applied is None else not applied, interval=interval
            )
            if applied is not False:
                norms = self._norms
                if norms.eager:
                    norm = self._total_norm(grads)
                    clip = self.config.clip_grad_norm
                    if clip is not None:
                        torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
                    if applied is None:  # decided on the device: a skipped step keeps the last
                        norm = torch.where(found > 0, norms.last(norm.device), norm)
                    norms.set(norm)
                else:  # computed if read before the next call
                    norms.defer(grads, None if applied else found)
                self._optimizer_step(found if on_device else None)
                if self.masters is not None:
                    self.masters.refresh()
            self._update_scale(found, chosen)
            done = True  # the optimizer stepped and the scale moved: the step counts
            for seam in self.seams:
                seam.after_step(self, applied, scale)
        finally:
            if done:  # a step whose optimizer (or anything before it) raised is not counted
                self.optimizer_steps += 1
            else:
                self._ledger.restore(ledger)
            if self.masters is not None:
                self.masters.step_done()
            self._clear_grads()
        if check:
            self._check_limits(known=applied is not None)

    def _unit(self, device: torch.device) -> torch.Tensor:
        """A 0-dim float32 1.0 on ``device``, made once (the inverse scale of an unscaled step)."""
        unit = self._units.get(device)
        if unit is None:
            unit = self._units[device] = torch.ones((), device=device)
        return unit

    def _clear_grads(self) -> None:
        """``optimizer.zero_grad(set_to_none=True)``; done here, without its profiler range,
        unless the optimizer overrides it or a profiler records."""
        optimizer = self.optimizer
        if (
            type(optimizer).zero_grad is not _ZERO_GRAD
            or "zero_grad" in vars(optimizer)
            or _profiling()
        ):
            optimizer.zero_grad(set_to_none=True)
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None

    def _decides_on_device(self, check: bool, manager: LossScaleManager) -> bool:
        """Whether the skip is the fused optimizer's, on the device (no host read)."""
        return (
            check
            and bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))
            and manager.decides_on_device()
            and not any(seam.needs_host_decision for seam in self.seams)
            and _fused_skip_ready(self.optimizer)
        )

    def _optimizer_step(self, found_inf: torch.Tensor | None) -> None:
        if found_inf is None:
            self.optimizer.step()
            return
        optimizer: Any = self.optimizer
        optimizer.grad_scale, optimizer.found_inf = None, found_inf  # the fused skip
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf

    def _update_scale(self, found: torch.Tensor, chosen: torch.Tensor | None) -> None:
        settled = None if chosen is None else settled_initial_scale(chosen)
        self.scaling.after_step(found, settled, lambda: self._ledger.read()[0])

    def _check_limits(self, known: bool) -> None:
        if not known and self.optimizer_steps % self.LIMIT_CHECK_INTERVAL:
            return
        run = self._ledger.read()[2]
        if run > self.MAX_CONSECUTIVE_OVERFLOWS:
            fixed = self.scaling.is_fixed() and not self._warming_up
            raise RuntimeError(
                "mixprec training step: "
                + overflow_limit_message(run, min(self.loss_scale, FLOAT32_MAX), fixed=fixed)
            )
        if run >= self.OVERFLOW_WARNING_AFTER and not self._warned:
            self._warned = True
            warn(
                f"mixprec training step: {run} optimizer steps in a row were skipped because "
                f"the gradients held inf/NaN (loss scale {self.loss_scale:g}); nothing is "
                f"training. After {self.MAX_CONSECUTIVE_OVERFLOWS} this becomes an error.",
                RuntimeWarning,
            )
        elif run < self.OVERFLOW_WARNING_AFTER and self._warned:
            self._warned = False

    # ------------------------------------------------------------------ other ranks
    @property
    def replicas(self) -> Replicas:
        """The ranks this step agrees with (see :class:`~mixprec.distributed.Replicas`)."""
        return self.agreement.replicas

    def join(self, *, enable: bool = True, throw_on_early_termination: bool = False) -> Any:
        """A ``torch.distributed`` ``Join`` context for uneven inputs across ranks.

        Under DDP it is the wrapper's own ``ddp.join()``, which joins the step too (either
        spelling works); without DDP, ``Join([step.agreement])``.

        Example:
            >>> with step.join():
            ...     for x, y in loader:          # ranks may hold different numbers of batches
            ...         step(x, y)
        """
        return self.agreement.join(
            enable=enable, throw_on_early_termination=throw_on_early_termination
        )

    def _join_device(self) -> torch.device:
        return next(
            (p.device for g in self.optimizer.param_groups for p in g["params"]),
            torch.device("cpu"),
        )

    def _shadow_micro_batch(self) -> None:
        """A joined rank's share of the others' micro-batch (see :mod:`mixprec.distributed.join`)."""
        self._norms.release()
        self._micro_step += 1
        if self._micro_step < self.config.accumulation_steps:
            return
        self._abandon()
        state = self.scaling.device_state()
        check = self.scaling.get_drop_overflow_update()
        nothing = torch.zeros((), device=self._join_device())
        warm = self._warming_up and state is not None and state.dynamic
        chosen = torch.full_like(nothing, math.inf) if warm else None
        try:
            # answer the others' per-part flags with none of its own
            self.scaling.unscale_step([], [], nothing + 1, self.agreement.replicas.all_reduce_max)
            found, chosen = self.agreement.agree(
                nothing, chosen, self.scaling, check, interval=self.LIMIT_CHECK_INTERVAL
            )
            if check:
                self._ledger.update(found)
            # the others raise together when the states differed: so does a joined rank
            on_device = self._decides_on_device(check, self.scaling)
            skipped = None if on_device else check
            self.agreement.check(self.scaling, skipped=skipped, interval=self.LIMIT_CHECK_INTERVAL)
            self._update_scale(found, chosen)
        finally:
            self.optimizer_steps += 1

    # ------------------------------------------------------------------ checkpoints
    def get_extra_state(self) -> dict[str, Any]:
        if self._micro_step:
            raise RuntimeError(
                f"cannot checkpoint in the middle of gradient accumulation ({self._micro_step} of "
                f"{self.config.accumulation_steps} micro-batches done): save after an optimizer step"
            )
        overflow, skipped, run = self._ledger.read()
        manager = self.loss_scale_manager
        return {
            "format": 2,
            "loss_scale_manager": None if manager is None else manager.state_dict(),
            "masters": None if self.masters is None else self.masters.state(),
            "overflow": overflow,
            "skipped_steps": skipped,
            "consecutive_overflows": run,
            "optimizer_steps": self.optimizer_steps,
        }

    def set_extra_state(self, state: Any) -> None:
        state = check_extra_state(state, self.loss_scale_manager, self.masters)
        if self.loss_scale_manager is not None:
            self.loss_scale_manager.load_state_dict(state["loss_scale_manager"])
        if self.masters is not None:
            self.masters.load(state["masters"])
        self._ledger.load(state["overflow"], state["skipped_steps"], state["consecutive_overflows"])
        self.optimizer_steps = state["optimizer_steps"]
        self._micro_step = 0

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a checkpoint; it is checked whole (keys, shapes, the scale and counters, the
        master weights) before anything is written. Checkpoints of mixprec 0.1.0 load, and so
        do those of a step that held the DDP wrapper itself (``network.module.*`` keys)."""
        state_dict = without_ddp_prefix(self.network, state_dict)
        check_checkpoint(
            dict(self.named_children()), state_dict, strict, self.loss_scale_manager, self.masters
        )
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if self.masters is not None:
            self.masters.refresh()  # the masters are the checkpoint's truth
        return result

    def extra_repr(self) -> str:
        c = self.config
        dtype = "-" if c.dtype is None else str(c.dtype).removeprefix("torch.")
        level = f"{c.level.value} ({c.reason})" if c.reason else c.level.value
        params = str(c.cast_model_type).removeprefix("torch.")
        return (
            f"level={level}, dtype={dtype}, parameters={params}, master_weights={c.master_weights}, "
            f"loss_scale_manager={self.loss_scale_manager!r}, accumulation_steps={c.accumulation_steps}, "
            f"clip_grad_norm={c.clip_grad_norm}"
            + ("" if self.boost is None else f",\nboost={self.boost.summary()}")
        )
