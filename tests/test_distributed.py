"""Two real processes on the gloo backend: every rank skips the same steps."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import mixprec as amp

pytestmark = pytest.mark.distributed

STEPS = 8
POISON = {3: 1, 6: 0}  # step -> the rank whose batch gets an inf


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, out: str, mode: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        torch.manual_seed(0)  # the same initial weights on every rank
        model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
        network: nn.Module = nn.parallel.DistributedDataParallel(model) if mode == "ddp" else model
        level = "O2"
        if mode == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            fully_shard(
                model,
                mp_policy=MixedPrecisionPolicy(
                    param_dtype=torch.bfloat16, reduce_dtype=torch.float32
                ),
            )
            level = "O0"  # fully_shard casts the parameters; mixprec scales and agrees
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        step = amp.build_train_network(
            network,
            optimizer,
            nn.CrossEntropyLoss(),
            level=level,
            dtype=None if level == "O0" else "bf16",
            loss_scale_manager=amp.DynamicLossScaleManager(1024, 2, 2),
        )
        generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        record: dict[str, list[object]] = {"scale": [], "overflow": [], "params": []}
        for i in range(STEPS):
            x = torch.randn(16, 8, generator=generator)
            y = torch.randint(0, 4, (16,), generator=generator)
            if POISON.get(i) == rank:
                x[0, 0] = float("inf")
            step(x, y)
            record["scale"].append(step.loss_scale)
            record["overflow"].append(step.overflow)
            params = [
                getattr(p, "_local_tensor", p) for p in model.parameters()
            ]  # a DTensor's shard
            record["params"].append(torch.cat([p.detach().flatten() for p in params]))
        torch.save(record, Path(out) / f"rank{rank}.pt")
        dist.barrier()  # nobody tears gloo down while the other rank still talks
    finally:
        dist.destroy_process_group()


def _run(tmp_path: Path, mode: str) -> list[dict[str, list[object]]]:
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path), mode), nprocs=2, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


def test_ddp_ranks_skip_the_same_steps_and_stay_identical(tmp_path: Path) -> None:
    rank0, rank1 = _run(tmp_path, "ddp")
    expected = [i in POISON for i in range(STEPS)]
    assert rank0["overflow"] == rank1["overflow"] == expected
    assert rank0["scale"] == rank1["scale"]
    assert rank0["scale"] == [1024, 2048, 2048, 1024, 1024, 2048, 1024, 1024]
    for a, b in zip(rank0["params"], rank1["params"], strict=True):
        assert torch.equal(a, b)  # type: ignore[arg-type]
    # a skipped step changes nothing
    for i in POISON:
        assert torch.equal(rank0["params"][i], rank0["params"][i - 1])  # type: ignore[arg-type]


def test_overflow_flag_is_agreed_without_gradient_sync(tmp_path: Path) -> None:
    """Without DDP the ranks' gradients differ (as FSDP shards do): the flag alone is
    all-reduced, so the rank whose batch was clean skips too."""
    rank0, rank1 = _run(tmp_path, "plain")
    expected = [i in POISON for i in range(STEPS)]
    assert rank0["overflow"] == rank1["overflow"] == expected
    assert rank0["scale"] == rank1["scale"]


def test_fsdp2_ranks_agree_on_overflow(tmp_path: Path) -> None:
    """FSDP2 (fully_shard) on CPU/gloo: each rank checks only its shard of the gradients,
    and still every rank skips the poisoned steps; sharded weights never hold a skipped update."""
    rank0, rank1 = _run(tmp_path, "fsdp2")
    expected = [i in POISON for i in range(STEPS)]
    assert rank0["overflow"] == rank1["overflow"] == expected
    assert rank0["scale"] == rank1["scale"]
    for record in (rank0, rank1):
        for i in POISON:
            assert torch.equal(record["params"][i], record["params"][i - 1])  # type: ignore[arg-type]
