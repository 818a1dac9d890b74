"""Two real processes on gloo with DDP (and without it): skips, accumulation, join,
the user's wrapper, checkpoints, agreement. One spawned run holds every scenario; each
scenario's results are checked by its own test."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mixprec as amp
from spawn import run

pytestmark = pytest.mark.distributed

STEPS = 8
POISON = {3: 1, 6: 0}  # step -> the rank whose batch gets an inf


def _model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))


def _batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(16, 8, generator=generator), torch.randint(0, 4, (16,), generator=generator)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _error(fn: Any) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as error:
        return str(error)
    return "no error"


def _poisoned(rank: int, mode: str) -> dict[str, Any]:
    model = _model()
    network = nn.parallel.DistributedDataParallel(model) if mode == "ddp" else model
    step = amp.build_train_network(
        network,
        torch.optim.SGD(model.parameters(), lr=0.05),
        nn.CrossEntropyLoss(),
        "O2",
        dtype="bf16",
        loss_scale_manager=amp.DynamicLossScaleManager(1024, 2, 2),
    )
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    record: dict[str, Any] = {"scale": [], "overflow": [], "params": []}
    for i in range(STEPS):
        x, y = _batch(generator)
        if POISON.get(i) == rank:
            x[0, 0] = float("inf")
        step(x, y)
        record["scale"].append(step.loss_scale)
        record["overflow"].append(step.overflow)
        record["params"].append(_flat(model))
    return record


def _accumulate(rank: int, world: int, static_graph: bool = False) -> dict[str, Any]:
    """4 micro-batches per optimizer step: one gradient all-reduce, counted by a hook."""
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model, static_graph=static_graph)
    calls: list[int] = []

    def counting(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads the annotations
        state.append(1)
        work = dist.all_reduce(bucket.buffer().div_(world), async_op=True)
        return work.get_future().then(lambda f: f.value()[0])

    ddp.register_comm_hook(calls, counting)
    step = amp.build_train_network(
        ddp, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), accumulation_steps=4
    )
    data = [torch.Generator().manual_seed(200 + r) for r in range(world)]
    batches = [[(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(8)]
               for g in data]  # fmt: skip
    for x, y in batches[rank]:
        step(x, y)
    # the reference: one process, every rank's micro-batches, the mean loss per step
    reference = _model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for s in range(2):
        chunk = [b for r in range(world) for b in batches[r][4 * s : 4 * s + 4]]
        loss = sum(nn.functional.mse_loss(reference(x), y) for x, y in chunk) / len(chunk)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        optimizer.step()
    return {
        "all_reduces": len(calls),
        "optimizer_steps": step.optimizer_steps,
        "params": _flat(model),
        "reference": _flat(reference),
    }


def _join(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 holds 6 micro-batches, rank 1 three; rank 0 overflows after rank 1 joined.
    Once in DDP's own ``ddp.join()``, once in ``step.join()``."""
    out: dict[str, Any] = {}
    for idiom in ("ddp", "step"):
        model = _model()
        ddp = nn.parallel.DistributedDataParallel(model)
        step = amp.build_train_network(
            ddp,
            torch.optim.SGD(model.parameters(), lr=0.05),
            nn.CrossEntropyLoss(),
            "O2",
            dtype="bf16",
            loss_scale_manager=amp.DynamicLossScaleManager(1024, 2, 2),
            accumulation_steps=2,
        )
        generator = torch.Generator().manual_seed(300 + rank)
        with ddp.join() if idiom == "ddp" else step.join():
            for i in range(6 if rank == 0 else 3):
                x, y = _batch(generator)
                if i == 4:
                    x[0, 0] = float("nan")
                step(x, y)
        out[idiom] = {
            "params": _flat(model),
            "scale": step.loss_scale,
            "skipped": step.skipped_steps,
            "optimizer_steps": step.optimizer_steps,
            "wrapper_untouched": ddp.module is model,
        }
    return out


def _join_mismatch(rank: int, world: int) -> dict[str, Any]:
    """A fused optimizer (skips decided on the device) in ddp.join(): rank 0's scale is
    changed after rank 1 ran out; both ranks raise, the joined one from its hook."""
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model)
    manager = amp.DynamicLossScaleManager(1024, 2, 100)
    step = amp.build_train_network(
        ddp,
        torch.optim.SGD(model.parameters(), lr=0.05, fused=True),
        nn.CrossEntropyLoss(),
        "O2",
        dtype="bf16",
        loss_scale_manager=manager,
    )
    step.LIMIT_CHECK_INTERVAL = 1  # the states compared on every step
    generator = torch.Generator().manual_seed(350 + rank)

    def loop() -> None:
        with ddp.join():
            for i in range(5 if rank == 0 else 2):
                if i == 3:  # rank 0 alone, as if it alone had loaded a checkpoint
                    manager.load_state_dict({**manager.state_dict(), "loss_scale": 8.0})
                step(*_batch(generator))

    return {"error": _error(loop)}


def _wrapper(rank: int, world: int) -> dict[str, Any]:
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model)
    loss = nn.CrossEntropyLoss()
    first = amp.build_train_network(
        ddp, torch.optim.SGD(model.parameters(), lr=0.05), loss, "O2", dtype="bf16"
    )
    second = amp.build_train_network(
        ddp, torch.optim.SGD(model.parameters(), lr=0.05), loss, "O3", dtype="fp16"
    )
    seen: list[torch.dtype] = []
    handles = [
        s.network[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
        for s in (first, second)
    ]
    generator = torch.Generator().manual_seed(400 + rank)
    first(*_batch(generator))
    second(*_batch(generator))
    for handle in handles:
        handle.remove()
    low_params = _error(
        lambda: amp.build_train_network(
            ddp, torch.optim.SGD(model.parameters()), loss, "O2", cast_model_type="bf16"
        )
    )
    return {
        "untouched": ddp.module is model,
        "seen": seen,
        "low_params": low_params,
        "params": _flat(model),
    }


def _checkpoint(rank: int, world: int) -> dict[str, Any]:
    """A DDP step's checkpoint loads into a plain step (and an old one with module. keys)."""
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model)
    manager = amp.DynamicLossScaleManager(1024, 2, 1)
    step = amp.build_train_network(
        ddp,
        torch.optim.SGD(model.parameters(), lr=0.05),
        nn.CrossEntropyLoss(),
        "O2",
        dtype="bf16",
        loss_scale_manager=manager,
    )
    generator = torch.Generator().manual_seed(500 + rank)
    for _ in range(2):
        step(*_batch(generator))
    state = step.state_dict()
    plain_model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
    plain = amp.build_train_network(
        plain_model,
        torch.optim.SGD(plain_model.parameters(), lr=0.05),
        nn.CrossEntropyLoss(),
        "O2",
        dtype="bf16",
        cast_model_type=torch.float32,  # float32 Parameters, as under DDP
        loss_scale_manager=amp.DynamicLossScaleManager(1024, 2, 1),
    )
    plain.load_state_dict(state)
    old_style = {
        (f"network.module.{k.removeprefix('network.')}" if k.startswith("network.") else k): v
        for k, v in state.items()
    }
    again = _model()
    ddp_again = nn.parallel.DistributedDataParallel(again)
    restored = amp.build_train_network(
        ddp_again,
        torch.optim.SGD(again.parameters(), lr=0.05),
        nn.CrossEntropyLoss(),
        "O2",
        dtype="bf16",
        loss_scale_manager=amp.DynamicLossScaleManager(1024, 2, 1),
    )
    restored.load_state_dict(old_style)
    return {
        "keys": sorted(k for k in state if k != "_extra_state"),
        "plain_params": _flat(plain_model),
        "restored_params": _flat(again),
        "params": _flat(model),
        "scales": (step.loss_scale, plain.loss_scale, restored.loss_scale),
    }


def _agreement(rank: int, world: int) -> dict[str, Any]:
    model = _model()
    build = _error(
        lambda: amp.build_train_network(
            nn.parallel.DistributedDataParallel(model),
            torch.optim.SGD(model.parameters()),
            nn.CrossEntropyLoss(),
            "O2" if rank == 0 else "O1",
            dtype="bf16",
        )
    )
    # the usual habit: restore on rank 0 only, and count on DDP to broadcast
    ddp = nn.parallel.DistributedDataParallel(model)
    step = amp.build_train_network(
        ddp,
        torch.optim.SGD(model.parameters(), lr=0.05),
        nn.CrossEntropyLoss(),
        "O2",
        dtype="bf16",
        loss_scale_manager=amp.DynamicLossScaleManager(1024, 2, 100),
    )
    generator = torch.Generator().manual_seed(600 + rank)
    before = _flat(model)
    if rank == 0:
        state = step.state_dict()
        state["_extra_state"]["loss_scale_manager"]["loss_scale"] = torch.tensor(65536.0)
        step.load_state_dict(state)
    load = _error(lambda: step(*_batch(generator)))
    return {
        "build": build,
        "load": load,
        "unchanged": torch.equal(before, _flat(model)),
        **_local_decisions(rank),
    }


def _local_decisions(rank: int) -> dict[str, Any]:
    """Rank-local choices are agreed when the step is built."""
    import mixprec.boost.plan as plan

    def build(fused: bool | None = None, **options: Any) -> amp.TrainStep:
        model = _model()
        return amp.build_train_network(
            nn.parallel.DistributedDataParallel(model),
            torch.optim.SGD(model.parameters(), lr=0.05, fused=fused),
            nn.CrossEntropyLoss(),
            "O2",
            dtype="bf16",
            **options,
        )

    out: dict[str, Any] = {
        "emulate": _error(lambda: build(emulate=rank == 0)),
        "pins": _error(lambda: build(fp32_modules=["0"] if rank else None)),
        "host": _error(lambda: build(fused=True, after_skip=(lambda step: None) if rank else None)),
        "groups": _error(
            lambda: build(
                loss_scale_manager=amp.GroupLossScaleManager(
                    2.0 ** (10 + rank), [["0", "1"], ["3"]]
                )
            )
        ),
    }
    # boost times the optimizer's kernels on each rank: every rank runs the first rank's
    timed = plan.time_optimizer_impls
    fastest = "foreach" if rank else "default"
    plan.time_optimizer_impls = lambda optimizer, impls: {  # type: ignore[assignment]
        k: (0.5 if k == fastest else 1.0) for k in impls
    }
    try:
        step = build(boost_level="O1", boost_config={"compile": False})
    finally:
        plan.time_optimizer_impls = timed
    out["kernels"] = [(g["fused"], g["foreach"]) for g in step.optimizer.param_groups]
    out.update(_layouts(rank))
    return out


def _layouts(rank: int) -> dict[str, Any]:
    """Boost's channels_last: configured differently, refused at build; timed at the first
    call (faster on rank 0 only here), rank 0's choice on every rank."""
    import mixprec.boost.plan as plan

    def build(**config: Any) -> tuple[nn.Module, amp.TrainStep]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 4))
        step = amp.build_train_network(
            nn.parallel.DistributedDataParallel(model),
            torch.optim.SGD(model.parameters(), lr=0.05),
            nn.CrossEntropyLoss(),
            boost_level="O1",
            boost_config={"compile": False, "optimizer": "off", **config},
        )
        return model, step

    configured = _error(lambda: build(channels_last=rank == 0))
    timed = plan.time_layouts
    plan.time_layouts = lambda network, args: (2.0, 1.0) if rank == 0 else (1.0, 2.0)  # type: ignore[assignment]
    try:
        model, step = build()
        step(torch.randn(2, 3, 6, 6), torch.tensor([0, 1]))
    finally:
        plan.time_layouts = timed
    assert step.boost is not None
    layout = step.boost.decisions["channels_last"]
    weight = model[0].weight
    return {
        "layout_configured": configured,
        "layout": (layout.on, layout.why),
        "channels_last": weight.is_contiguous(memory_format=torch.channels_last),
        "layout_params": _flat(model),
    }


def _group_states(rank: int, world: int) -> dict[str, Any]:
    """GroupLossScaleManager under DDP: every group's state is compared (the second of
    three differs); under step.join() a joined rank answers the per-group flags."""

    def build(accumulation_steps: int = 1) -> tuple[nn.Module, amp.TrainStep]:
        model = _model()
        step = amp.build_train_network(
            nn.parallel.DistributedDataParallel(model),
            torch.optim.SGD(model.parameters(), lr=0.05),
            nn.CrossEntropyLoss(),
            "O2",
            dtype="bf16",
            loss_scale_manager=amp.GroupLossScaleManager(1024, [["0"], ["1"], ["3"]], 2, 100),
            accumulation_steps=accumulation_steps,
        )
        return model, step

    model, step = build()
    if rank == 1:
        state = step.state_dict()
        state["_extra_state"]["loss_scale_manager"]["loss_scales"] = torch.tensor(
            [1024.0, 512.0, 1024.0]
        )
        step.load_state_dict(state)
    before = _flat(model)
    generator = torch.Generator().manual_seed(700 + rank)
    differ = _error(lambda: step(*_batch(generator)))
    unchanged = torch.equal(before, _flat(model))
    model, step = build(accumulation_steps=2)
    with step.join():
        for i in range(6 if rank == 0 else 3):
            x, y = _batch(generator)
            if i == 4:
                x[0, 0] = float("nan")  # rank 0 alone, after rank 1 ran out
            step(x, y)
    manager = step.loss_scale_manager
    assert isinstance(manager, amp.GroupLossScaleManager)
    return {
        "differ": differ,
        "unchanged": unchanged,
        "scales": manager.get_loss_scales(),
        "skipped": step.skipped_steps,
        "params": _flat(model),
    }


def _budget(rank: int, world: int) -> dict[str, Any]:
    """Per optimizer step under DDP: DDP's gradient all-reduces (a counting comm hook), the
    collectives called from mixprec's code, and its host reads (Tensor -> Python)."""
    import os
    import sys

    counts = {"collectives": 0, "syncs": 0}

    def mine() -> bool:
        return f"{os.sep}mixprec{os.sep}" in sys._getframe(2).f_code.co_filename

    def counting(kind: str, original: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[kind] += mine()
            return original(*args, **kwargs)

        return counted

    patched = [(dist, n) for n in ("all_reduce", "all_gather_object", "broadcast_object_list")]
    patched += [(torch.Tensor, n) for n in ("item", "__bool__", "__float__", "__int__", "tolist")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in patched]
    out: dict[str, Any] = {}
    for optimizer in ("sgd", "sgd-fused"):
        model = _model()
        ddp = nn.parallel.DistributedDataParallel(model)
        calls: list[int] = []

        def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads the annotations
            state.append(1)
            work = dist.all_reduce(bucket.buffer().div_(world), async_op=True)
            return work.get_future().then(lambda f: f.value()[0])

        ddp.register_comm_hook(calls, hook)
        step = amp.build_train_network(
            ddp,
            torch.optim.SGD(model.parameters(), lr=0.05, fused=optimizer == "sgd-fused"),
            nn.CrossEntropyLoss(),
            "O2",
            dtype="bf16",
            loss_scale_manager=amp.DynamicLossScaleManager(1024, 2, 100),
        )
        step.LIMIT_CHECK_INTERVAL = 4
        generator = torch.Generator().manual_seed(800 + rank)
        rows = []
        for i in range(6):
            x, y = _batch(generator)
            if i == 2 and rank == 1:
                x[0, 0] = float("inf")  # rank 1 only: DDP's all-reduce carries it to rank 0
            for owner, name, original in saved:
                setattr(
                    owner,
                    name,
                    counting("syncs" if owner is torch.Tensor else "collectives", original),
                )
            try:
                step(x, y)
            finally:
                for owner, name, original in saved:
                    setattr(owner, name, original)
            rows.append((len(calls), counts["collectives"], counts["syncs"], step.overflow))
            calls.clear()
            counts.update(collectives=0, syncs=0)
        out[optimizer] = {"rows": rows, "params": _flat(model), "scale": step.loss_scale}
    return out


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, fn in (
        ("ddp", lambda r, w: _poisoned(r, "ddp")),
        ("plain", lambda r, w: _poisoned(r, "plain")),
        ("accumulate", _accumulate),
        ("static_graph", lambda r, w: _accumulate(r, w, static_graph=True)),
        ("join", _join),
        ("join_mismatch", _join_mismatch),
        ("wrapper", _wrapper),
        ("checkpoint", _checkpoint),
        ("agreement", _agreement),
        ("groups", _group_states),
        ("budget", _budget),
    ):
        out[name] = fn(rank, world)
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run(_scenarios, tmp_path_factory.mktemp("ddp"), bound=300.0)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b)


def test_ddp_ranks_skip_the_same_steps_and_stay_identical(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = (r["ddp"] for r in ranks)
    expected = [i in POISON for i in range(STEPS)]
    assert rank0["overflow"] == rank1["overflow"] == expected
    assert rank0["scale"] == rank1["scale"] == [1024, 2048, 2048, 1024, 1024, 2048, 1024, 1024]
    for a, b in zip(rank0["params"], rank1["params"], strict=True):
        assert _same(a, b)
    for i in POISON:  # a skipped step changes nothing
        assert _same(rank0["params"][i], rank0["params"][i - 1])


def test_overflow_flag_is_agreed_without_gradient_sync(ranks: list[dict[str, Any]]) -> None:
    """Without DDP the ranks' gradients differ: the flag alone is agreed, so the rank
    whose batch was clean skips too."""
    rank0, rank1 = (r["plain"] for r in ranks)
    assert rank0["overflow"] == rank1["overflow"] == [i in POISON for i in range(STEPS)]
    assert rank0["scale"] == rank1["scale"]


def test_accumulation_all_reduces_once_per_optimizer_step(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = (r["accumulate"] for r in ranks)
    # 8 micro-batches, 4 per optimizer step: 2 gradient all-reduces (one bucket), not 8
    assert rank0["optimizer_steps"] == rank1["optimizer_steps"] == 2
    assert rank0["all_reduces"] == rank1["all_reduces"] == 2
    assert _same(rank0["params"], rank1["params"])
    # the same weights as one process on every rank's micro-batches (float32, summation order)
    torch.testing.assert_close(rank0["params"], rank0["reference"], rtol=1e-5, atol=1e-6)


def test_static_graph_ddp_accumulates(ranks: list[dict[str, Any]]) -> None:
    """static_graph=True: DDP records the graph on its first synced backward, so the very
    first micro-batch is reduced too (one extra all-reduce, the same weights)."""
    rank0, rank1 = (r["static_graph"] for r in ranks)
    assert rank0["all_reduces"] == rank1["all_reduces"] == 3
    assert _same(rank0["params"], rank1["params"])
    torch.testing.assert_close(rank0["params"], rank0["reference"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("idiom", ["ddp", "step"])
def test_ddp_join_and_step_join_handle_uneven_inputs(
    ranks: list[dict[str, Any]], idiom: str
) -> None:
    rank0, rank1 = (r["join"][idiom] for r in ranks)
    for r in (rank0, rank1):
        assert r["wrapper_untouched"]
    assert _same(rank0["params"], rank1["params"])
    # optimizer steps 1 and 2 clean (the scale grows after 2), step 3 overflows on rank 0
    # alone, after rank 1 ran out: both back off and count the skip
    assert rank0["scale"] == rank1["scale"] == 1024.0
    assert rank0["skipped"] == rank1["skipped"] == 1
    assert rank0["optimizer_steps"] == rank1["optimizer_steps"] == 3
    # both idioms train alike
    assert _same(rank0["params"], ranks[0]["join"]["step"]["params"])


def test_a_joined_rank_raises_with_the_others_on_a_state_mismatch(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        assert r["join_mismatch"]["error"].startswith(
            "mixprec: the ranks disagree on the loss-scale state on loss_scale: "
            "rank 0: 8.0, rank 1: 1024.0"
        ), r["join_mismatch"]["error"]


def test_users_wrapper_is_left_alone_and_each_build_runs_its_level(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        result = r["wrapper"]
        assert result["untouched"]
        assert result["seen"] == [torch.bfloat16, torch.float16]
        assert result["low_params"].startswith(
            "cast_model_type=torch.bfloat16 under DistributedDataParallel: DDP reduces the "
            "gradients of the Parameters it was built on (float32), but low-precision "
            "Parameters are separate copies whose gradients DDP never sees"
        )
    assert _same(ranks[0]["wrapper"]["params"], ranks[1]["wrapper"]["params"])


def test_checkpoints_are_portable_between_ddp_and_plain_steps(
    ranks: list[dict[str, Any]],
) -> None:
    result = ranks[0]["checkpoint"]
    assert result["keys"] == [
        "network.0.bias",
        "network.0.weight",
        "network.1.bias",
        "network.1.weight",
        "network.3.bias",
        "network.3.weight",
    ]
    assert _same(result["plain_params"], result["params"])
    assert _same(result["restored_params"], result["params"])
    assert result["scales"] == (4096.0, 4096.0, 4096.0)


def test_ranks_that_disagree_fail_together_naming_ranks_and_values(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        result = r["agreement"]
        assert result["build"].startswith(
            "mixprec: the ranks disagree when the training step is built on level: "
            "rank 0: 'O2', rank 1: 'O1'"
        )
        assert result["load"].startswith(
            "mixprec: the ranks disagree on the loss-scale state on loss_scale: "
            "rank 0: 65536.0, rank 1: 1024.0. Did only some ranks load a checkpoint?"
        )
        assert result["unchanged"]  # the disagreeing step was skipped on every rank
        when = "mixprec: the ranks disagree when the training step is built on "
        assert result["emulate"].startswith(when + "emulate: rank 0: True, rank 1: False")
        pins = when + "fp32_modules: rank 0: [], rank 1: ['0']"
        assert result["pins"].startswith(pins), result["pins"]
        host = when + "decides skips on: rank 0: 'the device', rank 1: 'the host'"
        assert result["host"].startswith(host), result["host"]
        # every group's scale, not only the last one's
        groups = "loss-scale state: rank 0: {'loss_scales': [1024.0, 1024.0]"
        assert groups in result["groups"], result["groups"]
        assert "rank 1: {'loss_scales': [2048.0, 2048.0]" in result["groups"]
        assert result["kernels"] == [(None, None)]  # rank 0's choice: the default
        layout = when + "boost channels_last: rank 0: True, rank 1: False"
        assert result["layout_configured"].startswith(layout), result["layout_configured"]
        assert result["layout"] == (
            True,
            "the first rank's choice: measured 2.00x on the first batch",
        )
        assert result["channels_last"]
    a, b = (r["agreement"]["layout_params"] for r in ranks)
    assert _same(a, b)


def test_every_group_scale_is_compared_and_joined_ranks_answer_the_groups(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        result = r["groups"]
        assert result["differ"].startswith(
            "mixprec: the ranks disagree on the loss-scale state on loss_scales: "
            "rank 0: [1024.0, 1024.0, 1024.0], rank 1: [1024.0, 512.0, 1024.0]. "
        ), result["differ"]
        assert result["unchanged"]
    # the NaN reaches every group; the culprit is the one nearest the loss: it backs off
    a, b = (r["groups"] for r in ranks)
    assert a["scales"] == b["scales"] == [1024.0, 1024.0, 512.0]
    assert a["skipped"] == b["skipped"] == 1
    assert _same(a["params"], b["params"])


def test_ddp_steps_send_nothing_of_their_own_and_read_the_host_once(
    ranks: list[dict[str, Any]],
) -> None:
    """(gradient all-reduces, mixprec's collectives, mixprec's host reads, overflow) per
    step: the overflow comes from DDP's all-reduced gradients; the loss-scale states are
    compared on the first and every 4th step here (every 50th by default)."""
    for r in ranks:
        sgd, fused = r["budget"]["sgd"], r["budget"]["sgd-fused"]
        assert sgd["rows"] == [
            (1, 1, 1, False),  # the first step compares the states: one small all-reduce
            (1, 0, 1, False),
            (1, 0, 2, True),  # rank 1's inf skips both; a skip also reads the agreement flag
            (1, 0, 1, False),
            (1, 1, 1, False),
            (1, 0, 1, False),
        ], sgd["rows"]
        assert fused["rows"] == [
            (1, 1, 1, False),  # decided on the device: the agreement flag read when compared
            (1, 0, 0, False),
            (1, 0, 0, True),
            (1, 0, 1, False),  # the overflow-limit check reads the ledger: every 4th step
            (1, 1, 1, False),
            (1, 0, 0, False),
        ], fused["rows"]
    for optimizer in ("sgd", "sgd-fused"):
        a, b = (r["budget"][optimizer] for r in ranks)
        assert _same(a["params"], b["params"])
        assert a["scale"] == b["scale"] == 512.0


def test_no_collective_in_one_process() -> None:
    model = _model()
    step = amp.build_train_network(model, torch.optim.SGD(model.parameters()), nn.MSELoss())
    assert not dist.is_initialized()
    assert not step.replicas.active
