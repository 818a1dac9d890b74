"""What a boost level turns on for one model on one machine, and why; the step's seams.

:func:`plan_boost` runs when the step is built. It decides each technique by a short
timing or a documented rule and records a :class:`Decision` (on/off and why) for each:

* **optimizer**: the optimizer's fused and foreach kernels are timed on clones of its
  parameters; the fastest is kept if it beats the current one by ``min_speedup``. A fused
  optimizer also lets the step skip overflowing steps on the device (no host sync).
* **channels_last** (conv nets): timed on a copy of the network with the first batch, at
  the first call; kept if faster. Under ``torch.distributed`` every rank takes the first
  rank's choice (as for the optimizer's kernels): replicas in different layouts would
  drift apart.
* **compile**: ``torch.compile`` of the network's ``forward`` (its hooks stay eager; names
  and checkpoints are unchanged). Rule: on for CUDA, off on CPU, where it measured slower on
  every benchmark model (and costs ~25 s per compile); ``compile=True`` forces it and
  the first call's time (the compile) is reported. The step's elementwise work (unscale
  and overflow check, the optimizer update) already runs in fused kernels, so it is not
  compiled separately.
* **freeze** (O2): gradient freezing (:mod:`mixprec.boost.freeze`).
* **adasum** (O2, DDP with 2^k ranks): the AdaSum communication hook.

The step calls :meth:`BoostPlan.before_forward` and :meth:`BoostPlan.after_backward`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mixprec._warn import warn
from mixprec.boost.adasum import adasum_hook, is_power_of_two
from mixprec.boost.config import BoostConfig, BoostLevel
from mixprec.boost.freeze import FreezeSchedule, freeze_schedule, split_groups
from mixprec.boost.timing import time_layouts, time_optimizer_impls

__all__ = ["BoostPlan", "Decision", "plan_boost"]


@dataclasses.dataclass
class Decision:
    """One technique: whether it is on, and why."""

    technique: str
    on: bool | None  # None: decided at the first call
    why: str

    def __str__(self) -> str:
        state = {True: "on", False: "off", None: "pending"}[self.on]
        return f"{self.technique}={state} ({self.why})"


@dataclasses.dataclass
class BoostPlan:
    """The decisions of one step's boost level, and the work they leave for the step."""

    level: BoostLevel
    config: BoostConfig
    decisions: dict[str, Decision]
    freeze: FreezeSchedule | None = None
    compile_seconds: float | None = None
    #: how the ranks agree on a choice timed at the first call (the step's replicas'
    #: ``adopt_first``: every rank takes the first rank's); None in one process
    adopt_first: Callable[[Any], Any] | None = None
    _first: bool = True
    _started: float = 0.0

    def before_forward(
        self, network: nn.Module, args: tuple[Any, ...], optimizer_step: int
    ) -> None:
        """First call: the layout trial and the compile; every call: freeze this step's groups."""
        if self._first:
            self._first = False
            self._first_call(network, args)
            self._started = time.perf_counter()
        if self.freeze is not None:
            self.freeze.begin(optimizer_step)

    def after_backward(self) -> None:
        if self.freeze is not None:
            self.freeze.end()
        if self.compile_seconds is None and self.decisions["compile"].on:
            self.compile_seconds = time.perf_counter() - self._started
            self.decisions[
                "compile"
            ].why += f"; first call incl. compile {self.compile_seconds:.1f} s"

    def _first_call(self, network: nn.Module, args: tuple[Any, ...]) -> None:
        target = (
            network.module if isinstance(network, nn.parallel.DistributedDataParallel) else network
        )
        layout = self.decisions["channels_last"]
        if layout.on is None:
            try:
                eager, cl = time_layouts(target, args)
            except Exception as error:  # a failed trial only means "off"
                layout.on, layout.why = False, f"trial failed: {type(error).__name__}"
            else:
                layout.on = eager / cl >= self.config.min_speedup
                layout.why = f"measured {eager / cl:.2f}x on the first batch"
            if self.adopt_first is not None:  # one layout on every replica (DDP's buckets)
                layout.on, why = self.adopt_first((layout.on, layout.why))
                layout.why = f"the first rank's choice: {why}"
        if layout.on:
            _to_channels_last(target, self._masters)
        if self.decisions["compile"].on:
            # the forward only: the module's hooks (the master weights' check of outside
            # writes reads version counters) stay eager, or every step would recompile
            target.forward = torch.compile(target.forward, backend=self.config.compile_backend)

    _masters: Any = None

    def summary(self) -> str:
        """``"O1: optimizer=on (...), ..."``."""
        return f"{self.level.value}: " + ", ".join(str(d) for d in self.decisions.values())


def _to_channels_last(network: nn.Module, masters: Any) -> None:
    network.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    for master in [] if masters is None else masters.masters:
        if master.dim() == 4:
            master.data = master.data.contiguous(memory_format=torch.channels_last)


def _decide_optimizer(optimizer: torch.optim.Optimizer, config: BoostConfig) -> Decision:
    groups = optimizer.param_groups
    current = (
        "fused"
        if any(g.get("fused") for g in groups)
        else ("foreach" if any(g.get("foreach") for g in groups) else "default")
    )
    if config.optimizer == "off":
        return Decision("optimizer", False, "boost_config optimizer='off'")
    if current != "default":
        return Decision("optimizer", False, f"already {current}")
    if optimizer.state:
        return Decision("optimizer", False, "the optimizer already holds state")
    if not any("fused" in g or "foreach" in g for g in groups):
        return Decision(
            "optimizer", False, f"{type(optimizer).__name__} has no fused/foreach kernels"
        )
    fused = has_fused_kernel(optimizer)
    if config.optimizer == "fused" and not fused:
        warn(f"boost: {type(optimizer).__name__} has no fused kernel; left as it is")
        return Decision("optimizer", False, "fused unavailable")
    kernels = ("default", "fused", "foreach") if fused else ("default", "foreach")
    impls = kernels if config.optimizer == "auto" else (config.optimizer,)
    times = time_optimizer_impls(optimizer, impls)
    if config.optimizer != "auto":
        choice, seconds = config.optimizer, times[config.optimizer]
        if isinstance(seconds, str):
            warn(
                f"boost: {type(optimizer).__name__} cannot run {choice} here ({seconds}); left off"
            )
            return Decision("optimizer", False, f"{choice} unavailable")
        why = f"boost_config optimizer={choice!r}"
    else:
        measured = {k: v for k, v in times.items() if k in impls and isinstance(v, float)}
        base = measured.get("default")
        choice = min(measured, key=measured.__getitem__)
        if base is None or choice == "default" or base / measured[choice] < config.min_speedup:
            ratios = ", ".join(
                f"{k} {base / v:.2f}x" for k, v in measured.items() if k != "default" and base
            )
            return Decision("optimizer", False, f"no kernel faster: {ratios or 'none available'}")
        why = f"{choice} measured {base / measured[choice]:.2f}x faster per step"
    for group in groups:
        group["fused"], group["foreach"] = choice == "fused", choice == "foreach"
    if choice == "fused":
        optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]
    return Decision("optimizer", True, f"{choice}: {why}" if config.optimizer == "auto" else why)


def has_fused_kernel(optimizer: torch.optim.Optimizer) -> bool:
    """Does the optimizer's class have a fused kernel that skips from ``found_inf``?

    Asked of torch itself: a fresh instance built with ``fused=True`` on one parameter
    where the optimizer's live must mark itself ``_step_supports_amp_scaling`` (an
    optimizer that takes and ignores ``fused``, or refuses it, has none).
    """
    if "fused" not in optimizer.defaults:
        return False
    device = next(
        (p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu")
    )
    probe = nn.Parameter(torch.zeros(1, device=device))
    options = {k: v for k, v in optimizer.defaults.items() if k == "lr"}
    cls: Any = type(optimizer)
    try:
        built = cls([probe], **options, fused=True)
    except Exception:  # any refusal means: no fused kernel here
        return False
    return bool(getattr(built, "_step_supports_amp_scaling", False))


def _has_conv(network: nn.Module) -> bool:
    return any(isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)) for m in network.modules())


def plan_boost(
    level: BoostLevel,
    config: BoostConfig,
    network: nn.Module,
    optimizer: torch.optim.Optimizer,
    ddp: nn.parallel.DistributedDataParallel | None,
    masters: Any,
) -> BoostPlan | None:
    """Decide every technique of ``level`` for ``network`` (the converted model) and apply
    what can be applied at build time. Returns None at O0."""
    if level is BoostLevel.O0:
        return None
    device = next((p.device for p in network.parameters()), torch.device("cpu"))
    d: dict[str, Decision] = {"optimizer": _decide_optimizer(optimizer, config)}
    if config.channels_last in (True, False):
        d["channels_last"] = Decision("channels_last", bool(config.channels_last), "boost_config")
    elif not _has_conv(network):
        d["channels_last"] = Decision("channels_last", False, "no 2-d convolutions")
    else:
        d["channels_last"] = Decision("channels_last", None, "timed on the first batch")
    if config.compile in (True, False):
        d["compile"] = Decision(
            "compile", bool(config.compile), f"boost_config, backend {config.compile_backend!r}"
        )
    elif device.type == "cuda":
        d["compile"] = Decision("compile", True, "rule: on for CUDA")
    else:
        d["compile"] = Decision(
            "compile", False, "rule: off on CPU, measured slower (see docs/measurements.md)"
        )
    if d["compile"].on and not hasattr(torch, "compile"):
        warn("boost: torch.compile is unavailable in this torch; compile left off")
        d["compile"] = Decision("compile", False, "torch.compile unavailable")
    plan = BoostPlan(level, config, d)
    plan._masters = masters
    freeze_on = config.freeze if config.freeze is not None else level is BoostLevel.O2
    if freeze_on:
        plan.freeze = _plan_freeze(plan, network, ddp)
    else:
        d["freeze"] = Decision(
            "freeze", False, "level O1" if config.freeze is None else "boost_config"
        )
    d["adasum"] = _plan_adasum(level, config, ddp)
    return plan


def _plan_freeze(
    plan: BoostPlan, network: nn.Module, ddp: nn.parallel.DistributedDataParallel | None
) -> FreezeSchedule | None:
    c = plan.config
    groups = split_groups(network, c.param_groups)
    if len(groups) < 2:
        plan.decisions["freeze"] = Decision("freeze", False, "fewer than 2 layers to group")
        return None
    if ddp is not None and not ddp.find_unused_parameters:
        raise ValueError(
            "boost_level='O2' freezes early layers on some steps, so those parameters get no "
            "gradient and DistributedDataParallel waits for them forever: wrap the model with "
            "DistributedDataParallel(model, find_unused_parameters=True), or pass "
            "boost_config={'freeze': False}"
        )
    schedule = freeze_schedule(len(groups), c.freeze_type, c.freeze_p, c.total_steps, c.seed)
    if plan.decisions["compile"].on:
        import torch._dynamo.config as dynamo_config

        limit = getattr(dynamo_config, "recompile_limit", None) or dynamo_config.cache_size_limit
        distinct = len(set(schedule))
        if distinct > limit:
            raise ValueError(
                f"boost: gradient freezing trains {distinct} different sets of groups, each a "
                f"separate torch.compile graph, above its recompile limit of {limit}: pass "
                f"boost_config={{'param_groups': {limit}}} (or fewer), or 'compile': False"
            )
    frozen_share = sum(1 for k in schedule if k) / len(schedule)
    plan.decisions["freeze"] = Decision(
        "freeze",
        True,
        f"{len(groups)} groups, freeze_type {c.freeze_type}, {frozen_share:.0%} of steps freeze",
    )
    return FreezeSchedule(groups, schedule)


def _plan_adasum(
    level: BoostLevel, config: BoostConfig, ddp: nn.parallel.DistributedDataParallel | None
) -> Decision:
    wanted = config.adasum is True or (config.adasum == "auto" and level is BoostLevel.O2)
    if not wanted:
        return Decision("adasum", False, "level O1" if config.adasum == "auto" else "boost_config")
    if ddp is None:
        return Decision("adasum", False, "single process")
    world = torch.distributed.get_world_size(ddp.process_group)
    if not is_power_of_two(world):
        if config.adasum is True:
            raise ValueError(f"boost_config adasum=True needs 2^k ranks; this group has {world}")
        return Decision("adasum", False, f"{world} ranks is not a power of two")
    try:
        ddp.register_comm_hook(ddp.process_group, adasum_hook)
    except RuntimeError as error:
        warn(f"boost: the AdaSum hook could not be registered ({error}); left off")
        return Decision("adasum", False, "another communication hook is registered")
    return Decision("adasum", True, f"{world} ranks")
