"""``GroupLossScaleManager``: one dynamic loss scale per consecutive group of layers.

A single loss scale must suit the smallest and the largest gradient of the whole network.
When one layer's gradients are thousands of times larger than another's, the scale that
keeps the large ones finite in float16 lets the small ones underflow, and the scale that
saves the small ones overflows the large ones, step after step. Here every group of
consecutive layers (module names, in forward order) has its own dynamic scale ``S_g``:

* the loss is multiplied by the last group's scale ``S_last``;
* at each group boundary (the input of the group's first module) a backward hook multiplies
  the gradient flowing down from group ``g + 1`` into group ``g`` by ``S_g / S_{g+1}`` (in
  float32, cast back), so group ``g``'s parameter gradients carry ``S_g`` and are unscaled
  by it;
* group ``g`` *overflows* when its parameter gradients, or the gradient it passes down
  (before rescaling), hold an inf/NaN. A step where any group overflows is skipped. An
  inf flows down into every earlier group, so the *culprit* is the overflowing group
  nearest the loss; only its scale backs off. Every other group counts a clean step, and
  each grows after its own window of clean steps (the rule of
  :class:`~mixprec.DynamicLossScaleManager`, from :mod:`mixprec.training.scale_state`).

The last group's scale multiplies the loss, so it stays at least 1 (MindSpore's floor). The
other groups may back off below 1, down to ``2**-24``: a layer whose float16 gradients
overflow even unscaled (large activations or inputs) then trains at a scale under 1, where a
single scale, floored at 1, would skip every step. Internally such a group's rule runs on
``scale * 2**24`` (the same :class:`~mixprec.training.scale_state.LossScaleState`, floor 1).

A skip connection that jumps over a boundary would carry a gradient at the wrong scale, so
the network is traced (``torch.fx``) when the step is built, and any value computed in one
group and used past the next boundary is refused with its name. An untraceable network is
not checked (a warning says so).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mixprec._warn import warn
from mixprec.training.grads import _inverse_scale, _unscale_grads
from mixprec.training.scale_state import (
    LossScaleState,
    check_count,
    check_counter_below,
    check_factor,
    check_loss_scale,
    check_steps,
)
from mixprec.training.scaling import LossScaleManager

__all__ = ["GroupLossScaleManager", "check_boundaries", "check_names"]

#: groups below the last run their rule on ``scale * OFFSET``: their floor is ``1 / OFFSET``
OFFSET = 2.0**24


class _Rescale(torch.autograd.Function):
    """Identity forward; backward records the gradient's finiteness and rescales it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, manager: GroupLossScaleManager, index: int) -> Any:
        ctx.manager, ctx.index = manager, index
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return ctx.manager._cross(ctx.index, grad), None, None


class GroupLossScaleManager(LossScaleManager):
    """One dynamic loss scale per group of consecutive layers (MindSpore's boost manager).

    Args:
        init_loss_scale: every group's first scale.
        loss_scale_groups: the groups in forward order, each a list of module names
            (``named_modules`` names). Every parameter of the network must be in one group.
        scale_factor: back-off and growth factor.
        scale_window: clean steps before a group's scale grows.

    Example:
        >>> manager = GroupLossScaleManager(2**10, [["conv1", "conv2"], ["fc1", "fc2", "fc3"]])
        >>> step = mixprec.build_train_network(model, opt, loss, "O2", dtype="fp16",
        ...                                    loss_scale_manager=manager)
        >>> manager.get_loss_scales()
        [1024.0, 1024.0]
    """

    def __init__(
        self,
        init_loss_scale: float,
        loss_scale_groups: Sequence[Sequence[str]],
        scale_factor: float = 2,
        scale_window: int = 2000,
    ) -> None:
        self._groups = _check_groups(loss_scale_groups)
        factor = check_factor(scale_factor, "scale_factor")
        window = check_count(scale_window, "scale_window")
        init = check_loss_scale(init_loss_scale, "init_loss_scale")
        last = len(self._groups) - 1
        self._offsets = [OFFSET if g < last else 1.0 for g in range(last + 1)]
        self._states = [
            LossScaleState.create(init * offset, factor, window, name="init_loss_scale")
            for offset in self._offsets
        ]
        self._core = self._states[-1]  # the loss is scaled by the last group's scale
        self._scale_factor, self._scale_window = factor, window
        self._boundary_bad = torch.zeros(len(self._groups))
        self._last_flags = torch.zeros(len(self._groups))
        self._group_of: dict[int, int] = {}

    # ------------------------------------------------------------------ reading
    @property
    def loss_scale_groups(self) -> list[list[str]]:
        return [list(group) for group in self._groups]

    def get_loss_scales(self) -> list[float]:
        """Every group's scale, in forward order (reads the device)."""
        return torch.stack([self._scale(g) for g in range(len(self._states))]).tolist()

    def _scale(self, group: int) -> torch.Tensor:
        """Group ``group``'s scale, a 0-dim float32 tensor (no sync)."""
        return self._states[group].scale / self._offsets[group]

    def last_overflows(self) -> list[bool]:
        """Which groups overflowed on the last step (reads the device)."""
        return [bool(flag) for flag in self._last_flags.tolist()]

    # ------------------------------------------------------------------ wiring
    def attach(
        self, network: nn.Module, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()
    ) -> None:
        """Install the boundary hooks on ``network`` and map its parameters to groups;
        ``pairs`` are (master, low copy) Parameters, so masters map to their copy's group.

        Raises:
            ValueError: a name that is not a submodule, a parameter in no group or in two.
        """
        modules = check_names(network, self._groups)
        group_of: dict[int, int] = {}
        for index, group in enumerate(self._groups):
            for name in group:
                for param in modules[name].parameters():
                    if group_of.setdefault(id(param), index) != index:
                        raise ValueError(
                            f"loss_scale_groups: a parameter of {name!r} is already in group "
                            f"{group_of[id(param)]}; each parameter belongs to one group"
                        )
        for pname, param in network.named_parameters():
            if param.requires_grad and id(param) not in group_of:
                raise ValueError(
                    f"loss_scale_groups covers no module holding parameter {pname!r}: every "
                    f"trained parameter must be in one group (groups: {self._groups})"
                )
        for master, low in pairs:
            if id(low) in group_of:
                group_of[id(master)] = group_of[id(low)]
        self._group_of = group_of
        for index in range(1, len(self._groups)):
            entry = modules[self._groups[index][0]]
            entry.register_forward_pre_hook(_BoundaryHook(self, index))

    def _cross(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        """The gradient leaving group ``index`` into group ``index - 1``."""
        bad = (~torch.isfinite(grad).all()).float()
        flags = self._boundary_bad.to(grad.device)
        self._boundary_bad = flags.index_put((torch.tensor(index, device=grad.device),), bad, True)
        ratio = self._scale(index - 1) / self._scale(index)
        return (grad.float() * ratio.to(grad.device)).to(grad.dtype)

    # ------------------------------------------------------------------ the step's calls
    def unscale_(
        self,
        params: Sequence[torch.Tensor],
        agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Unscale each parameter's gradient by its group's scale; returns the step's
        overflow flag (0-dim float32). ``agree`` all-reduces the per-group flags (MAX)
        across the step's ranks, so every rank backs off the same groups. No host sync."""
        by_group: list[list[torch.Tensor | None]] = [[] for _ in self._groups]
        last = len(self._groups) - 1  # a loss's own parameters carry the loss's scale
        for p in params:
            by_group[self._group_of.get(id(p), last)].append(p.grad)
        device = self._core.scale.device
        found = [
            _unscale_grads(grads, _inverse_scale(self._scale(g)))
            for g, grads in enumerate(by_group)
        ]
        flags = torch.stack([f.to(device) for f in found])
        flags = torch.maximum(flags, self._boundary_bad.to(device))
        self._last_flags = flags if agree is None else agree(flags)
        self._boundary_bad = torch.zeros_like(flags)
        return self._last_flags.amax()

    def reset_flags(self) -> None:
        """Forget boundary flags of an abandoned backward."""
        self._boundary_bad = torch.zeros_like(self._boundary_bad)

    # ------------------------------------------------------------------ the step's protocol
    def check_network(self, network: nn.Module) -> None:
        check_boundaries(network, self._groups)

    def unscale_step(
        self,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        inverse: torch.Tensor,
        agree: Callable[[torch.Tensor], torch.Tensor] | None,
    ) -> torch.Tensor:
        del grads, inverse  # each group by its own scale
        return self.unscale_(params, agree)

    def abandon(self) -> None:
        self.reset_flags()

    def update_on_device(self, found: torch.Tensor, chosen: torch.Tensor | None) -> None:
        del found, chosen  # the per-group flags of the last unscale_step decide
        self.adjust_groups()

    def adjust_groups(self) -> None:
        """Apply the rule per group from the last :meth:`unscale_`: only the culprit (the
        overflowing group nearest the loss) counts an overflow. No host sync."""
        flags = self._last_flags > 0
        above = torch.flip(torch.cummax(torch.flip(flags.int(), (0,)), 0).values, (0,))
        above = torch.cat([above[1:], torch.zeros_like(above[:1])])
        culprit = flags & (above == 0)
        for index, state in enumerate(self._states):
            state.assign(state.adjust(~culprit[index]))

    def update_loss_scale(self, overflow: bool | torch.Tensor | Sequence[bool]) -> None:
        """Host API: ``overflow`` per group (a list or a bool tensor, forward order) or one
        bool for the group nearest the loss."""
        if isinstance(overflow, (bool, int)) or (
            isinstance(overflow, torch.Tensor) and overflow.numel() == 1
        ):
            flags = torch.zeros(len(self._groups))
            flags[-1] = float(bool(overflow))
        else:
            flags = torch.as_tensor(overflow, dtype=torch.float32).flatten()
            if flags.numel() != len(self._groups):
                raise ValueError(
                    f"overflow must hold one flag per group ({len(self._groups)}); got {overflow!r}"
                )
        self._last_flags = flags.to(self._core.scale.device)
        self.adjust_groups()

    def device_state(self) -> LossScaleState:
        return self._core

    def device_states(self) -> list[LossScaleState]:
        """Every group's state, in forward order (the ranks compare them all)."""
        return list(self._states)

    def _to(self, device: torch.device) -> None:
        self._states = [s.to(device) for s in self._states]
        self._core = self._states[-1]
        self._boundary_bad = self._boundary_bad.to(device)
        self._last_flags = self._last_flags.to(device)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "loss_scales": torch.stack([self._scale(g) for g in range(len(self._states))]),
            "good_steps": torch.stack([s.good_steps for s in self._states]).detach().clone(),
            "bad_steps": torch.stack([s.bad_steps for s in self._states]).detach().clone(),
            "loss_scale_groups": self.loss_scale_groups,
            "scale_factor": self._scale_factor,
            "scale_window": self._scale_window,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        owner = "GroupLossScaleManager.load_state_dict"
        if not isinstance(state, Mapping):
            raise TypeError(f"{owner}: state must be a dict; got {state!r}")
        keys = set(self.state_dict())
        if set(state) != keys:
            raise ValueError(
                f"{owner}: state has missing keys {sorted(keys - set(state))} and unknown keys "
                f"{sorted(set(state) - keys)}; expected exactly {sorted(keys)}"
            )
        if [list(g) for g in state["loss_scale_groups"]] != self.loss_scale_groups:
            raise ValueError(
                f"{owner}: the checkpoint's groups {state['loss_scale_groups']!r} differ from "
                f"this manager's {self.loss_scale_groups!r}"
            )
        factor = check_factor(state["scale_factor"], "scale_factor")
        window = check_count(state["scale_window"], "scale_window")
        rows = {}
        for name in ("loss_scales", "good_steps", "bad_steps"):
            values = torch.as_tensor(state[name]).flatten().tolist()
            if len(values) != len(self._groups):
                raise ValueError(
                    f"{owner}: {name} must hold {len(self._groups)} values; got {values!r}"
                )
            rows[name] = values
        for scale, good, bad, offset in zip(*rows.values(), self._offsets, strict=True):
            check_loss_scale(scale * offset, f"loss_scales (times {offset:g})")
            check_counter_below(check_steps(_whole(good), "good_steps"), "good_steps", window)
            check_steps(_whole(bad), "bad_steps")
        self._scale_factor, self._scale_window = factor, window
        for index, state_g in enumerate(self._states):
            state_g.scale.fill_(rows["loss_scales"][index] * self._offsets[index])
            state_g.good_steps.fill_(int(rows["good_steps"][index]))
            state_g.bad_steps.fill_(int(rows["bad_steps"][index]))
            self._states[index] = dataclasses.replace(state_g, factor=factor, window=window)
        self._core = self._states[-1]

    def __repr__(self) -> str:
        return (
            f"GroupLossScaleManager(loss_scales={self.get_loss_scales()}, groups={len(self._groups)}, "
            f"scale_factor={self._scale_factor!r}, scale_window={self._scale_window!r})"
        )


class _BoundaryHook:
    """Forward pre-hook on a group's first module: its tensor inputs get a :class:`_Rescale`."""

    def __init__(self, manager: GroupLossScaleManager, index: int) -> None:
        self.manager, self.index = manager, index

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not torch.is_grad_enabled():
            return None
        return tuple(
            _Rescale.apply(a, self.manager, self.index)
            if isinstance(a, torch.Tensor) and a.requires_grad and a.is_floating_point()
            else a
            for a in args
        )


def _whole(value: object) -> object:
    """A counter read back from a tensor: a whole float as an int, anything else as it is
    (so that ``check_steps`` refuses 2.5 instead of truncating it)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def check_names(network: nn.Module, groups: Sequence[Sequence[str]]) -> dict[str, nn.Module]:
    """The network's modules by name, once every name in ``groups`` is one of them.

    Raises:
        ValueError: naming the misspelt name and the closest module names.
    """
    modules = dict(network.named_modules())
    for group in groups:
        for name in group:
            if name not in modules:
                close = difflib.get_close_matches(name, list(modules), n=3)
                hint = f"did you mean {close}? " if close else ""
                raise ValueError(
                    f"loss_scale_groups names {name!r}, which is not a submodule of the "
                    f"network; {hint}its modules include {list(modules)[1:9]}"
                )
    return modules


def _check_groups(groups: object) -> list[list[str]]:
    shape = "a list of groups, each a non-empty list of module names"
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence) or not groups:
        raise TypeError(f"loss_scale_groups must be {shape}; got {groups!r}")
    checked: list[list[str]] = []
    seen: set[str] = set()
    for group in groups:
        if isinstance(group, str) or not isinstance(group, Sequence) or not group:
            raise TypeError(f"loss_scale_groups must be {shape}; got group {group!r}")
        for name in group:
            if not isinstance(name, str):
                raise TypeError(f"loss_scale_groups must be {shape}; got {name!r} in {group!r}")
            if name in seen:
                raise ValueError(f"loss_scale_groups names module {name!r} twice")
            seen.add(name)
        checked.append(list(group))
    return checked


def check_boundaries(network: nn.Module, groups: Sequence[Sequence[str]]) -> None:
    """Refuse a value that crosses a group boundary other than at the group's first module.

    Raises:
        ValueError: naming the value, the module or op using it, and both groups.
    """
    import torch.fx as fx

    check_names(network, groups)
    entries = {name: index for index, group in enumerate(groups) for name in group}

    class _Tracer(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return qualname in entries or super().is_leaf_module(m, qualname)

    try:
        graph = _Tracer().trace(network)
    except Exception as error:  # any tracing failure means "cannot check"
        warn(
            f"GroupLossScaleManager: the network cannot be traced ({type(error).__name__}), so "
            "skip connections across group boundaries are not checked; make sure every value "
            "enters a group only through the group's first module"
        )
        return
    firsts = {group[0]: index for index, group in enumerate(groups)}
    group_of: dict[fx.Node, int] = {}
    latest: tuple[int, str] | None = None  # the latest group entered, and by which module
    for node in graph.nodes:
        if node.op == "call_module" and node.target in entries:
            index = entries[str(node.target)]
            if latest is not None and index < latest[0]:
                raise ValueError(
                    f"loss_scale_groups must be in forward order: {node.target!r} (group "
                    f"{index}) runs after {latest[1]!r} (group {latest[0]}); list the groups "
                    f"in the order the forward runs them"
                )
            latest = (index, str(node.target))
        sources = [u for u in node.all_input_nodes if group_of.get(u, -1) >= 0]
        if node.op == "call_module" and node.target in entries:
            own = entries[str(node.target)]
        else:
            own = max((group_of[u] for u in sources), default=-1)
        group_of[node] = own
        for u in sources:
            source = group_of[u]
            through_entry = firsts.get(str(node.target)) == own and source == own - 1
            if source < own and not (node.op == "call_module" and through_entry):
                user = node.target if node.op == "call_module" else node.name
                raise ValueError(
                    f"loss_scale_groups: {u.name!r} (computed in group {source}, {groups[source]}) "
                    f"is used by {user!r} in group {own} ({groups[own]}) without passing the "
                    f"boundary at {groups[own][0]!r}: this skip connection would carry group "
                    f"{source}'s gradient at group {own}'s scale. Move the boundary so the skip "
                    "lies inside one group"
                )
