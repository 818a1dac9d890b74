"""FSDP2 at every level, and a step on a subgroup: real gloo processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mixprec as amp
from mixprec.distributed import fully_shard
from mixprec.training.build import DEFAULT
from spawn import run

pytestmark = pytest.mark.distributed

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
POISON = {1: 1, 2: 0}  # step -> the rank whose batch gets an inf
STEPS = 4

#: (level, dtype, manager) -> dtypes seen: Linear input, Linear output, LayerNorm input, output
CASES: dict[str, tuple[str, str | None, str, tuple[torch.dtype, ...]]] = {
    "O0-own-policy-no-scale": ("O0", None, "none", (BF16, BF16, BF16, BF16)),
    "O0-own-policy-fixed-1": ("O0", None, "fixed1", (BF16, BF16, BF16, BF16)),
    "O0-own-policy-backoff-to-1": ("O0", None, "backoff", (BF16, BF16, BF16, BF16)),
    "O1-bf16": ("O1", "bf16", "default", (BF16, FP32, FP32, FP32)),
    "O2-bf16": ("O2", "bf16", "default", (BF16, BF16, FP32, FP32)),
    "O2-fp16-dynamic": ("O2", "fp16", "default", (FP16, FP16, FP32, FP32)),
    "O3-bf16": ("O3", "bf16", "default", (BF16, BF16, BF16, FP32)),
    "autocast-bf16": ("autocast", "bf16", "default", (FP32, BF16, BF16, BF16)),
}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))


def _manager(kind: str) -> Any:
    return {
        "none": None,
        "fixed1": amp.FixedLossScaleManager(1.0),
        "backoff": amp.DynamicLossScaleManager(2, 2, 1000),  # two overflows: 2 -> 1 -> 1
        "default": DEFAULT,
    }[kind]


def _local(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.to_local().detach().flatten() for p in model.parameters()])  # type: ignore[operator]


def _train(rank: int, level: str, dtype: str | None, manager: str, poison: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    model = _model()
    if level == "O0" and dtype is None and manager != "control":
        torch_fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=BF16))
    elif manager == "control":
        torch_fully_shard(model)  # float32 throughout
    else:
        fully_shard(model, level, dtype)
    seen: list[torch.dtype] = []
    hooks = [
        model[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype)),
        model[0].register_forward_hook(lambda m, a, out: seen.append(out.dtype)),
        model[1].register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype)),
        model.register_forward_hook(lambda m, a, out: seen.append(out.dtype)),
    ]
    step = amp.build_train_network(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        nn.CrossEntropyLoss(),
        level,
        dtype=dtype,
        loss_scale_manager=None if manager == "control" else _manager(manager),
    )
    generator = torch.Generator().manual_seed(100 + rank)
    record: dict[str, Any] = {"loss": [], "overflow": [], "scale": [], "params": []}
    for i in range(STEPS):
        x = torch.randn(16, 8, generator=generator)
        y = torch.randint(0, 4, (16,), generator=generator)
        if poison and POISON.get(i) == rank:
            x[0, 0] = float("inf")
        record["loss"].append(float(step(x, y)))
        record["overflow"].append(step.overflow)
        record["scale"].append(step.loss_scale)
        record["params"].append(_local(model))
        if i == 0:
            record["seen"] = tuple(seen)
            for hook in hooks:
                hook.remove()
    return record


def _fsdp(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out: dict[str, Any] = {"control": _train(rank, "O0", None, "control", poison=False)}
    for name, (level, dtype, manager, _) in CASES.items():
        out[name] = _train(rank, level, dtype, manager, poison=True)
        out[name + "/clean"] = _train(rank, level, dtype, manager, poison=False)["loss"]
    model = _model()
    torch_fully_shard(model)
    try:
        amp.build_train_network(model, torch.optim.SGD(model.parameters()), None, "O2")
    except ValueError as error:
        out["refused"] = str(error)
    dist.barrier()
    return out


def _subgroup(rank: int, world: int) -> dict[str, Any]:
    """Ranks 0 and 1 train on a subgroup; rank 2 is elsewhere (would hang a WORLD flag)."""
    group = dist.new_group([0, 1])
    model = _model()
    if rank == 2:
        try:
            amp.build_train_network(
                model, torch.optim.SGD(model.parameters()), nn.MSELoss(), process_group=group
            )
        except ValueError as error:
            return {"error": str(error)}
        return {"error": "no error"}
    record: dict[str, Any] = {}
    for mode in ("ddp", "plain"):
        model = _model()
        network = (
            nn.parallel.DistributedDataParallel(model, process_group=group)
            if mode == "ddp"
            else model
        )
        step = amp.build_train_network(
            network,
            torch.optim.SGD(model.parameters(), lr=0.05),
            nn.MSELoss(),
            loss_scale_manager=amp.DynamicLossScaleManager(1024, 2, 100),
            process_group=None if mode == "ddp" else group,
        )
        generator = torch.Generator().manual_seed(rank)
        overflow = []
        for i in range(3):
            x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)
            if i == 1 and rank == 1:
                x[0, 0] = float("inf")
            step(x, y)
            overflow.append(step.overflow)
        record[mode] = (overflow, step.loss_scale, _flat(model))
    return record


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run(_fsdp, tmp_path_factory.mktemp("fsdp"))


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp2_trains_at_every_level_and_ranks_agree(fsdp: list[dict[str, Any]], case: str) -> None:
    rank0, rank1 = (r[case] for r in fsdp)
    expected = [i in POISON for i in range(STEPS)]
    assert rank0["overflow"] == rank1["overflow"] == expected
    assert rank0["scale"] == rank1["scale"]
    assert rank0["seen"] == rank1["seen"] == CASES[case][3]  # dtypes at the boundaries
    for record in (rank0, rank1):
        for i in POISON:  # a skipped step leaves the shard as it was
            assert torch.equal(record["params"][i], record["params"][i - 1])
    # the clean run's losses follow the float32 control (bf16: 8 bits of mantissa)
    control = torch.tensor(fsdp[0]["control"]["loss"])
    clean = torch.tensor(fsdp[0][case + "/clean"])
    assert torch.allclose(clean, control, rtol=3e-2), (clean, control)


def test_fsdp2_backoff_reaches_scale_1_and_keeps_training(fsdp: list[dict[str, Any]]) -> None:
    assert fsdp[0]["O0-own-policy-backoff-to-1"]["scale"] == [2.0, 1.0, 1.0, 1.0]


def test_fsdp2_sharded_by_torch_is_refused_above_O0_with_the_recipe(
    fsdp: list[dict[str, Any]],
) -> None:
    assert fsdp[0]["refused"] == (
        "level 'O2' on a model sharded by torch's fully_shard: FSDP2 gathers and swaps in the "
        "Parameters itself, so mixprec cannot cast them at use. Shard with "
        "mixprec.distributed.fully_shard(model, 'O2', 'bfloat16') (FSDP2 then casts per module "
        "as the level says), or keep your own MixedPrecisionPolicy and build the step at level "
        "'O0'"
    )


def test_a_step_on_a_subgroup_agrees_within_it(tmp_path_factory: pytest.TempPathFactory) -> None:
    rank0, rank1, rank2 = run(_subgroup, tmp_path_factory.mktemp("group"), world=3)
    assert rank2["error"].startswith(
        "this process (global rank 2) is not in the step's process group"
    )
    for mode in ("ddp", "plain"):
        (o0, s0, p0), (o1, s1, p1) = rank0[mode], rank1[mode]
        assert o0 == o1 == [False, True, False]
        assert s0 == s1 == 512.0
        # DDP keeps the replicas identical; without it each rank trains on its own data
        assert torch.equal(p0, p1) == (mode == "ddp")
