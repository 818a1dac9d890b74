"""FSDP2 at every level, and a step on a subgroup: real gloo processes."""

from __future__ import annotations

import math
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
    out["scale"] = _at_scale(rank)
    dist.barrier()
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


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.down = nn.Linear(32, 16)
        self.gate = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate(x) * self.down(torch.relu(self.norm(self.up(x))))


class _Small(nn.Module):
    """Two blocks, a (1, 16) bias-like Parameter and a (1, 16) head: on 2 ranks, rank 1's
    shards of both are empty."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.shift = nn.Parameter(torch.randn(1, 16) * 0.1)
        self.blocks = nn.Sequential(_Block(), _Block())
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x) + self.shift))


def _units(model: nn.Module) -> int:
    from torch.distributed.fsdp import FSDPModule

    return sum(isinstance(m, FSDPModule) for m in model.modules())


def _grad_bytes(model: nn.Module) -> int:
    """Gradient bytes this rank holds: sharded .grad plus FSDP2's unsharded accumulation."""
    from torch.distributed.fsdp import FSDPModule

    total = sum(p.grad.to_local().nbytes for p in model.parameters() if p.grad is not None)  # type: ignore[attr-defined]
    for module in model.modules():
        group = (
            module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        )
        for param in [] if group is None else group.fsdp_params:
            held = param.unsharded_accumulated_grad
            unsharded = getattr(param, "_unsharded_param", None)
            if held is None and unsharded is not None:
                held = unsharded.grad
            total += 0 if held is None else held.nbytes
    return total


def _small_run(
    rank: int, level: str, dtype: str | None, *, accumulation: int = 1, steps: int = 3, **shard: Any
) -> dict[str, Any]:
    model = _Small()
    fully_shard(model, level, dtype, **shard)
    seen: list[torch.dtype] = []
    block = model.blocks[0]
    hooks = [
        block.up.register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype)),
        block.up.register_forward_hook(lambda m, a, out: seen.append(out.dtype)),
        block.norm.register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype)),
    ]
    step = amp.build_train_network(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        nn.MSELoss(),
        level,
        dtype=dtype,
        clip_grad_norm=1.0,
        accumulation_steps=accumulation,
    )
    generator = torch.Generator().manual_seed(700 + rank)
    record: dict[str, Any] = {"loss": [], "scale": [], "overflow": [], "grad_bytes": []}
    for i in range(steps * accumulation):
        x = torch.randn(8, 8, generator=generator)
        if level != "O1" and i == accumulation and rank == 1:
            x[0, 0] = float("inf")  # the second optimizer step overflows on rank 1 only
        record["loss"].append(float(step(x, x.sum(1, keepdim=True))))
        record["grad_bytes"].append(_grad_bytes(model))
        record["scale"].append(step.loss_scale)
        record["overflow"].append(step.overflow)
        for hook in hooks if i == 0 else []:
            hook.remove()
    record["seen"] = tuple(seen[:3])
    record["units"] = _units(model)
    record["params"] = torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()])  # type: ignore[operator]
    record["sharded_bytes"] = sum(p.to_local().numel() * 4 for p in model.parameters())  # type: ignore[operator]
    return record


def _refusals() -> dict[str, str]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out = {}
    model = _Small()
    torch_fully_shard(model)
    out["convert"] = _error(lambda: amp.auto_mixed_precision(model, "O2", "bf16"))
    model = fully_shard(_Small(), "O2", "bf16")
    for name, options in (
        ("emulate", {"emulate": True}),
        ("pins", {"fp32_modules": ["head"]}),
        ("keep_bn", {"keep_batchnorm_fp32": False}),
    ):
        out[name] = _error(
            lambda options=options: amp.build_train_network(
                model, torch.optim.SGD(model.parameters()), None, "O2", dtype="bf16", **options
            )
        )
    pinned = fully_shard(_Small(), "O2", "bf16", fp32_modules=["head"], keep_batchnorm_fp32=False)
    out["same_options"] = _error(
        lambda: amp.build_train_network(
            pinned,
            torch.optim.SGD(pinned.parameters()),
            None,
            "O2",
            dtype="bf16",
            fp32_modules=["head"],
            keep_batchnorm_fp32=False,
        )
    )
    return out


def _error(fn: Any) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as error:
        return str(error)
    return "no error"


def _at_scale(rank: int) -> dict[str, Any]:
    """Empty local shards, accumulation memory, O1 blocks, the conversion options."""
    return {name: _at_scale_one(rank, name) for name in _SCALE}


def _at_scale_one(rank: int, name: str) -> Any:
    return _SCALE[name](rank)


_SCALE: dict[str, Any] = {
    "fp16": lambda rank: _small_run(rank, "O2", "fp16"),
    "fp32": lambda rank: _small_run(rank, "O0", None),
    "o1_blocks": lambda rank: _small_run(rank, "O1", "bf16", blocks=(_Block,)),
    "o1_linears": lambda rank: _small_run(rank, "O1", "bf16"),
    "o2_no_keep_bn": lambda rank: _small_run(
        rank, "O2", "bf16", keep_batchnorm_fp32=False, steps=1
    ),
    "sync": lambda rank: _small_run(rank, "O2", "bf16", accumulation=4, steps=2),
    "no_sync": lambda rank: _small_run(
        rank, "O2", "bf16", accumulation=4, steps=2, sync_every_micro_batch=False
    ),
    "refusals": lambda rank: _refusals(),
}


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
    return run(_fsdp, tmp_path_factory.mktemp("fsdp"), bound=400.0)  # ~40 trainings


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
    rank0, rank1, rank2 = run(_subgroup, tmp_path_factory.mktemp("group"), world=3, bound=180.0)
    assert rank2["error"].startswith(
        "this process (global rank 2) is not in the step's process group"
    )
    for mode in ("ddp", "plain"):
        (o0, s0, p0), (o1, s1, p1) = rank0[mode], rank1[mode]
        assert o0 == o1 == [False, True, False]
        assert s0 == s1 == 512.0
        # DDP keeps the replicas identical; without it each rank trains on its own data
        assert torch.equal(p0, p1) == (mode == "ddp")


def test_fsdp2_empty_local_shards_fp16_default_manager_and_clipping(
    fsdp: list[dict[str, Any]],
) -> None:
    """A (1, 16) Parameter and head leave rank 1 empty shards: the first scale, the
    finiteness check and clipping still run, and the ranks agree."""
    rank0, rank1 = (r["scale"]["fp16"] for r in fsdp)
    assert rank0["overflow"] == rank1["overflow"] == [False, True, False]
    assert rank0["scale"] == rank1["scale"]
    first = rank0["scale"][0]  # chosen from the gradients: rank 0 holds the head's
    assert first == 2.0 ** round(math.log2(first))
    assert first < 2.0**16
    assert rank0["scale"][1] == first / 2  # the overflow halves it on both ranks
    assert torch.equal(rank0["params"], rank1["params"])
    assert all(torch.isfinite(torch.tensor(r["loss"][i])) for r in (rank0, rank1) for i in (0, 2))
    control = fsdp[0]["scale"]["fp32"]["loss"]
    torch.testing.assert_close(rank0["loss"][0], control[0], rtol=1e-2, atol=0.0)


def test_fsdp2_o1_blocks_are_units_gathered_low_with_o1_casts(
    fsdp: list[dict[str, Any]],
) -> None:
    blocks, linears = fsdp[0]["scale"]["o1_blocks"], fsdp[0]["scale"]["o1_linears"]
    # the root, inp, head, 2 blocks and their 2 norms; per Linear: the root and 8 Linears
    assert (blocks["units"], linears["units"]) == (7, 9)
    assert blocks["seen"] == linears["seen"] == (BF16, FP32, FP32)
    torch.testing.assert_close(
        torch.tensor(blocks["loss"]), torch.tensor(linears["loss"]), rtol=2e-2, atol=0.0
    )


def test_fsdp2_keep_batchnorm_fp32_false_is_honoured(fsdp: list[dict[str, Any]]) -> None:
    assert fsdp[0]["scale"]["o2_no_keep_bn"]["seen"] == (BF16, BF16, BF16)
    assert fsdp[0]["scale"]["fp16"]["seen"] == (FP16, FP16, FP32)


def test_fsdp2_accumulation_reduce_scatters_every_micro_batch_by_default(
    fsdp: list[dict[str, Any]],
) -> None:
    """Between micro-batches a rank holds its gradient shard only (by default), or the
    whole model's unsharded float32 gradients (``sync_every_micro_batch=False``)."""
    for r in fsdp:
        sync, no_sync = r["scale"]["sync"], r["scale"]["no_sync"]
        held = sync["grad_bytes"][:3]
        assert max(held) <= sync["sharded_bytes"]
        full = no_sync["grad_bytes"][:3]
        assert min(full) == max(full) == sum(4 * p.numel() for p in _Small().parameters())
        assert all(b == 0 for b in sync["grad_bytes"][3::4] + no_sync["grad_bytes"][3::4])
        torch.testing.assert_close(sync["params"], no_sync["params"], rtol=1e-5, atol=1e-6)
    sync0, sync1 = (r["scale"]["sync"] for r in fsdp)
    assert sync0["overflow"] == sync1["overflow"]
    print("grad bytes between micro-batches:", [r["scale"]["sync"]["grad_bytes"][:3] for r in fsdp],
          "vs", [r["scale"]["no_sync"]["grad_bytes"][:3] for r in fsdp])  # fmt: skip


def test_fsdp2_conversion_options_are_honoured_or_refused(fsdp: list[dict[str, Any]]) -> None:
    for r in fsdp:
        refusals = r["scale"]["refusals"]
        assert refusals["convert"].startswith(
            "network is sharded by FSDP2's fully_shard: FSDP2 gathers and swaps in the "
            "Parameters at each forward, so mixprec cannot convert it."
        )
        assert refusals["emulate"].startswith("emulate=True under FSDP2:")
        assert refusals["pins"].startswith(
            "fp32_modules=['head'] under FSDP2: the model's precision was fixed when it was "
            "sharded (fp32_modules=None); pass fp32_modules to mixprec.distributed.fully_shard"
        )
        assert refusals["keep_bn"].startswith("keep_batchnorm_fp32=False under FSDP2:")
        assert refusals["same_options"] == "no error"
