"""Gradient freezing (boost level O2), in MindSpore's manner.

The trained parameters are split into ``param_groups`` ordered groups of consecutive layers
(registration order; a layer's weight and bias, and a norm that follows a layer, stay
together). A schedule gives each optimizer step an index ``k``: that step trains groups
``k, k+1, ...`` only. Groups ``0..k-1`` get ``requires_grad=False`` for the step, so
autograd stops before them (backward skips the early layers entirely) and the optimizer
leaves them, and their state, untouched. ``k = 0`` trains everything.

Schedules (MindSpore's ``freeze_type``), with ``freeze_p`` the share of steps that train
everything:

* ``0``, continuous: the fixed pattern ``0 0 .. 0 1 2 .. G-1`` repeated, with enough zeros
  that their share is ``freeze_p``;
* ``1``, interval: a step freezes (draws ``k`` in ``1..G-1``, smaller ``k`` more likely,
  weight ``G - k``) whenever the share of freezing steps so far is below ``1 - freeze_p``;
  else it trains everything. Drawn from ``random.Random(seed)``: the same seed gives the
  same schedule on every run and every rank.

Defaults are MindSpore's: ``param_groups=10``, ``freeze_type=1``, ``freeze_p=0.7``,
``total_steps=65536`` (the schedule repeats after that many steps).
"""

from __future__ import annotations

import dataclasses
import random

from torch import nn

from mixprec.policy.lists import BLACK_MODULES

__all__ = ["FreezeSchedule", "freeze_schedule", "split_groups"]


def _units(network: nn.Module) -> list[list[nn.Parameter]]:
    """Parameters by the module that holds them, in registration order; a norm joins the
    layer before it."""
    units: list[list[nn.Parameter]] = []
    for module in network.modules():
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not params:
            continue
        if units and isinstance(module, BLACK_MODULES):
            units[-1].extend(params)
        else:
            units.append(params)
    return units


def split_groups(network: nn.Module, param_groups: int) -> list[list[nn.Parameter]]:
    """``param_groups`` groups of consecutive layers, as even in parameter count as the
    layers allow (fewer groups when the network has fewer layers).

    Example:
        >>> [len(g) for g in split_groups(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), 2)]
        [2, 2]
    """
    units = _units(network)
    count = min(param_groups, len(units))
    sizes = [sum(p.numel() for p in unit) for unit in units]
    total, done = sum(sizes), 0
    groups: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    for index, unit in enumerate(units):
        current.extend(unit)
        done += sizes[index]
        left_units, left_groups = len(units) - index - 1, count - len(groups) - 1
        if left_groups == 0:
            continue
        if done >= total * (len(groups) + 1) / count or left_units == left_groups:
            groups.append(current)
            current = []
    groups.append(current)
    return [g for g in groups if g]


def freeze_schedule(
    groups: int, freeze_type: int, freeze_p: float, total_steps: int, seed: int
) -> list[int]:
    """The first-trained group of each step (0 = train all), ``total_steps`` long.

    Example:
        >>> freeze_schedule(3, 0, 0.5, 6, seed=0)
        [0, 0, 1, 2, 0, 0]
    """
    if groups <= 1:
        return [0] * total_steps
    if freeze_type == 0:
        zeros = int(freeze_p * (groups - 1) / (1 - freeze_p) + 0.5) if freeze_p < 1 else 1
        pattern = [0] * zeros + list(range(1, groups))
        if freeze_p >= 1:
            pattern = [0]
        return [pattern[i % len(pattern)] for i in range(total_steps)]
    rng = random.Random(seed)
    choices = list(range(1, groups))
    weights = [groups - k for k in choices]
    schedule, frozen = [], 0
    for i in range(total_steps):
        if i and frozen / i < 1 - freeze_p:
            schedule.append(rng.choices(choices, weights)[0])
            frozen += 1
        else:
            schedule.append(0)
    return schedule


@dataclasses.dataclass
class FreezeSchedule:
    """Groups and their schedule; :meth:`begin` freezes a step's groups, :meth:`end`
    restores ``requires_grad``."""

    groups: list[list[nn.Parameter]]
    schedule: list[int]
    _frozen: list[nn.Parameter] = dataclasses.field(default_factory=list)

    def index(self, step: int) -> int:
        return self.schedule[step % len(self.schedule)]

    def begin(self, step: int) -> int:
        """Freeze the groups before this step's index; returns the index."""
        self.end()
        k = self.index(step)
        for group in self.groups[:k]:
            for p in group:
                if p.requires_grad:
                    p.requires_grad_(False)
                    self._frozen.append(p)
        return k

    def end(self) -> None:
        for p in self._frozen:
            p.requires_grad_(True)
        self._frozen = []
