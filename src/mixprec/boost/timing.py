"""Short timings that decide whether a boost technique pays on this model and machine.

Nothing here touches the user's state: the optimizer is timed on clones of its parameters,
the layouts on a deep copy of the network (its norms' running statistics stay untouched).
Each timing is the median of a few repetitions after a warm-up.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["interleaved_medians", "median_seconds", "time_layouts", "time_optimizer_impls"]

#: repetitions stop after this much time per candidate (seconds) or 15 repetitions
_BUDGET_S = 0.25


def median_seconds(run: Callable[[], object], warmup: int = 2, budget: float = _BUDGET_S) -> float:
    """The median wall time of ``run()`` over up to 15 repetitions (at least 3)."""
    for _ in range(warmup):
        run()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (len(times) < 15 and time.perf_counter() - start < budget):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_medians(
    runs: dict[str, Callable[[], object]], warmup: int = 2, budget: float = _BUDGET_S
) -> dict[str, float]:
    """Median seconds of each ``run()``, the candidates timed in turn, round by round, so
    a burst of load from other processes hits every candidate alike."""
    for run in runs.values():
        for _ in range(warmup):
            run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    start, rounds = time.perf_counter(), 0
    while rounds < 3 or (rounds < 15 and time.perf_counter() - start < budget * len(runs)):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
        rounds += 1
    return {name: statistics.median(values) for name, values in times.items()}


def _impl_flags(impl: str) -> dict[str, bool | None]:
    fused: bool | None = None if impl == "default" else impl == "fused"
    foreach: bool | None = None if impl == "default" else impl == "foreach"
    return {"fused": fused, "foreach": foreach}


def time_optimizer_impls(
    optimizer: torch.optim.Optimizer, impls: tuple[str, ...]
) -> dict[str, float | str]:
    """Seconds per ``optimizer.step()`` for each implementation, on clones of its
    parameters with random gradients; an implementation the optimizer refuses maps to
    the reason (a str)."""
    groups = []
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.requires_grad]
        clones = [p.detach().clone().requires_grad_(True) for p in params]
        for c in clones:
            c.grad = torch.randn_like(c) * 1e-3
        groups.append((group, clones))
    results: dict[str, float | str] = {}
    for impl in impls:
        try:
            cls: Any = type(optimizer)
            trial = cls(
                [
                    {**{k: v for k, v in g.items() if k != "params"}, "params": c}
                    | _impl_flags(impl)
                    for g, c in groups
                ]
            )
            results[impl] = median_seconds(trial.step)
        except (RuntimeError, ValueError, TypeError) as error:
            results[impl] = f"{type(error).__name__}: {error}"
    return results


def _fwd_bwd(network: nn.Module, args: tuple[Any, ...]) -> None:
    params = [p for p in network.parameters() if p.requires_grad]
    out = network(*args)
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    loss = sum(t.float().sum() for t in leaves if t.requires_grad)
    if isinstance(loss, torch.Tensor):
        torch.autograd.grad(loss, params, allow_unused=True)


def time_layouts(network: nn.Module, args: tuple[Any, ...]) -> tuple[float, float]:
    """Seconds per forward + backward in the contiguous and the channels-last layout, on
    a copy of ``network`` and the batch ``args``."""
    trial = copy.deepcopy(network)
    other = copy.deepcopy(network).to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    cl_args = tuple(
        a.contiguous(memory_format=torch.channels_last)
        if isinstance(a, torch.Tensor) and a.dim() == 4
        else a
        for a in args
    )
    medians = interleaved_medians(
        {
            "contiguous": lambda: _fwd_bwd(trial, args),
            "channels_last": lambda: _fwd_bwd(other, cl_args),
        }
    )
    return medians["contiguous"], medians["channels_last"]
