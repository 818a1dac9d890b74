"""Run a function in N gloo processes on 127.0.0.1, each joined or killed within a bound."""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: every collective gives up after this long (a hang becomes an error, not a stuck test)
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=15)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int, world: int, port: int, out: str, backend: str, fn: Callable[..., Any], args: Any
) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        torch.set_num_threads(1)
        result = fn(rank, world, *args)
        torch.save(result, Path(out) / f"rank{rank}.pt")
        dist.barrier()  # nobody tears gloo down while another rank still talks
    finally:
        dist.destroy_process_group()
    # Done: leave without the interpreter's exit, whose C++ destructors can meet a gloo or
    # TCP-store thread still winding down and abort a rank that finished ("terminate called
    # without an active exception", SIGABRT: seen once in CI on a run whose ranks had all
    # saved their results).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(
    fn: Callable[..., Any],
    tmp_path: Path,
    *args: Any,
    world: int = 2,
    bound: float = 90.0,
    backend: str = "gloo",
) -> list[Any]:
    """``fn(rank, world, *args)`` on every rank; returns each rank's result.

    Raises:
        TimeoutError: some process was still running after ``bound`` seconds (all killed).
    """
    context = mp.start_processes(
        _entry,
        args=(world, free_port(), str(tmp_path), backend, fn, args),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + bound
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__}: still running after {bound:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
