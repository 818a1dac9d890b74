"""Pipeline parallelism on two gloo processes, one stage each: the levels, the loss scaled on
the last stage, the overflow and the skip agreed by both stages (one spawned run holds every
scenario; each is checked by its own test)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mixprec as amp
from mixprec.distributed import pipeline_step
from spawn import run

pytestmark = pytest.mark.distributed

STEPS = 6
#: optimizer step -> the stage whose own gradients get an inf (the other stage's stay finite)
PLANTED = {2: 1, 4: 0}


def _model() -> nn.Sequential:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4)
    )


def _part(model: nn.Sequential, stage: int) -> nn.Sequential:
    return model[:2] if stage == 0 else model[2:]


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)  # every stage sees the same batches
    return [
        (torch.randn(16, 8, generator=generator), torch.randint(0, 4, (16,), generator=generator))
        for _ in range(steps)
    ]


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def _call(step: Any, stage: int, x: torch.Tensor, y: torch.Tensor) -> Any:
    return step(x) if stage == 0 else step(target=y)


def _float32(rank: int, world: int, clip: float | None = None) -> dict[str, Any]:
    """O0 under GPipe against one process training the whole model on the same batches
    (with ``clip``: clipped by the whole model's gradient norm)."""
    model = _model()
    part = _part(model, rank)
    step = pipeline_step(
        part,
        torch.optim.SGD(part.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        stage_index=rank,
        num_stages=world,
        n_microbatches=4,
        clip_grad_norm=clip,
    )
    losses = [_call(step, rank, x, y) for x, y in _batches(3)]
    reference = _model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = []
    for x, y in _batches(3):
        loss = nn.functional.cross_entropy(reference(x), y)  # equal micro-batches: one mean
        expected.append(loss.detach())
        optimizer.zero_grad()
        loss.backward()
        if clip is not None:
            norm = nn.utils.clip_grad_norm_(reference.parameters(), clip)
            assert norm > 2 * clip  # the clip bites
        optimizer.step()
    return {
        "params": _flat(part),
        "reference": _flat(_part(reference, rank)),
        "losses": losses,
        "expected": expected,
    }


def _float16(rank: int, world: int) -> dict[str, Any]:
    """O2 float16 under 1F1B with a dynamic scale; planted infs in one stage's gradients."""
    model = _model()
    part = _part(model, rank)
    step = pipeline_step(
        part,
        torch.optim.SGD(part.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        "O2",
        schedule=torch.distributed.pipelining.Schedule1F1B,
        dtype="fp16",
        stage_index=rank,
        num_stages=world,
        n_microbatches=4,
        loss_scale_manager=amp.DynamicLossScaleManager(1024, 2, 1000),
    )
    seen: list[torch.dtype] = []
    first = next(iter(step.train_step.network.children()))
    first.register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    record: dict[str, Any] = {"overflow": [], "scale": [], "params": [], "losses": []}
    for i, (x, y) in enumerate(_batches(STEPS)):
        handle = None
        if PLANTED.get(i) == rank:
            weight = next(part.parameters())
            handle = weight.register_hook(lambda g: g * float("inf"))
        record["losses"].append(_call(step, rank, x, y))
        if handle is not None:
            handle.remove()
        record["overflow"].append(step.overflow)
        record["scale"].append(step.loss_scale)
        record["params"].append(_flat(part))
    record["skipped"] = step.skipped_steps
    record["seen"] = seen[0]
    record["reference"] = _float32_losses()
    return record


def _float32_losses() -> list[float]:
    """The float32 whole-model losses of the steps _float16 applies (the skips left out)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for i, (x, y) in enumerate(_batches(STEPS)):
        loss = nn.functional.cross_entropy(model(x), y)
        out.append(float(loss))
        if i not in PLANTED:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return out


def _first_scale(rank: int, world: int) -> dict[str, Any]:
    """The level's default for float16: the first scale chosen from the first gradients,
    the smallest any stage chose."""
    part = _part(_model(), rank)
    step = pipeline_step(
        part,
        torch.optim.SGD(part.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        "O2",
        dtype="fp16",
        stage_index=rank,
        num_stages=world,
        n_microbatches=2,
    )
    x, y = _batches(1)[0]
    _call(step, rank, x, y)
    return {"scale": step.loss_scale, "overflow": step.overflow}


def _resume(rank: int, world: int) -> dict[str, Any]:
    """Each stage saves its own state_dict after 2 steps; 2 more after a resume on a fresh
    build train exactly as 4 straight."""

    def build() -> tuple[nn.Module, Any]:
        part = _part(_model(), rank)
        step = pipeline_step(
            part,
            torch.optim.SGD(part.parameters(), lr=0.1),
            nn.CrossEntropyLoss(),
            "O2",
            dtype="fp16",
            stage_index=rank,
            num_stages=world,
            n_microbatches=2,
            loss_scale_manager=amp.DynamicLossScaleManager(1024, 2, 1),
        )
        return part, step

    batches = _batches(4)
    straight, step = build()
    for x, y in batches:
        _call(step, rank, x, y)
    expected = (_flat(straight), step.loss_scale, step.optimizer_steps)
    _, first = build()
    for x, y in batches[:2]:
        _call(first, rank, x, y)
    saved = {
        k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in first.state_dict().items()
    }
    resumed, second = build()
    second.load_state_dict(saved)
    for x, y in batches[2:]:
        _call(second, rank, x, y)
    return {
        "expected": expected,
        "got": (_flat(resumed), second.loss_scale, second.optimizer_steps),
    }


def _disagree(rank: int, world: int) -> dict[str, Any]:
    """A stage that alone loaded another loss scale: both stages skip and raise."""
    part = _part(_model(), rank)
    step = pipeline_step(
        part,
        torch.optim.SGD(part.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        "O2",
        dtype="fp16",
        stage_index=rank,
        num_stages=world,
        n_microbatches=2,
        loss_scale_manager=amp.DynamicLossScaleManager(1024, 2, 1000),
    )
    if rank == 0:
        state = step.state_dict()
        state["_extra_state"]["loss_scale_manager"]["loss_scale"] = torch.tensor(65536.0)
        step.load_state_dict(state)
    before = _flat(part)
    x, y = _batches(1)[0]
    try:
        _call(step, rank, x, y)
        error = "no error"
    except RuntimeError as raised:
        error = str(raised)
    return {"error": error, "unchanged": torch.equal(before, _flat(part))}


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, fn in (
        ("float32", _float32),
        ("clipped", lambda r, w: _float32(r, w, clip=0.05)),
        ("float16", _float16),
        ("first_scale", _first_scale),
        ("resume", _resume),
        ("disagree", _disagree),
    ):
        out[name] = fn(rank, world)
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def stages(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run(_scenarios, tmp_path_factory.mktemp("pipeline"), bound=120.0)


def test_float32_pipeline_matches_one_process(stages: list[dict[str, Any]]) -> None:
    for r in stages:
        torch.testing.assert_close(r["float32"]["params"], r["float32"]["reference"])
    last = stages[1]["float32"]
    assert stages[0]["float32"]["losses"] == [None, None, None]  # only the last stage has it
    torch.testing.assert_close(torch.stack(last["losses"]), torch.stack(last["expected"]))


def test_clipping_uses_the_whole_models_norm(stages: list[dict[str, Any]]) -> None:
    for r in stages:
        torch.testing.assert_close(r["clipped"]["params"], r["clipped"]["reference"])
        assert not torch.equal(r["clipped"]["params"], r["float32"]["params"])


def test_both_stages_skip_a_planted_overflow_and_halve_the_scale(
    stages: list[dict[str, Any]],
) -> None:
    stage0, stage1 = (r["float16"] for r in stages)
    expected = [i in PLANTED for i in range(STEPS)]
    assert stage0["overflow"] == stage1["overflow"] == expected
    assert stage0["scale"] == stage1["scale"] == [1024, 1024, 512, 512, 256, 256]
    assert stage0["skipped"] == stage1["skipped"] == 2
    for r in (stage0, stage1):
        for i in PLANTED:  # a skipped step changes nothing, on either stage
            assert torch.equal(r["params"][i], r["params"][i - 1])
        assert not torch.equal(r["params"][1], r["params"][0])
        assert all(torch.isfinite(p).all() for p in r["params"])


def test_stages_compute_at_the_level(stages: list[dict[str, Any]]) -> None:
    """O2: the second stage receives float16 activations; the losses follow float32's."""
    assert stages[1]["float16"]["seen"] == torch.float16
    losses = [float(v) for v in stages[1]["float16"]["losses"]]
    reference = stages[1]["float16"]["reference"]
    for i, (got, want) in enumerate(zip(losses, reference, strict=True)):
        assert abs(got - want) <= 0.01 * abs(want), (i, got, want)


def test_first_float16_scale_is_agreed(stages: list[dict[str, Any]]) -> None:
    a, b = (r["first_scale"] for r in stages)
    assert a == b
    assert not a["overflow"]
    assert a["scale"] > 1.0


def test_each_stage_resumes_from_its_own_checkpoint(stages: list[dict[str, Any]]) -> None:
    for r in stages:
        (want, want_scale, want_steps), (got, scale, steps) = (
            r["resume"]["expected"],
            r["resume"]["got"],
        )
        assert torch.equal(got, want)
        assert scale == want_scale == 1024 * 2**4  # grown on every clean step (window 1)
        assert steps == want_steps == 4


def test_stages_that_disagree_skip_and_raise_together(stages: list[dict[str, Any]]) -> None:
    for r in stages:
        assert r["disagree"]["error"].startswith(
            "mixprec: the ranks disagree on the loss-scale state on loss_scale: "
            "rank 0: 65536.0, rank 1: 1024.0"
        ), r["disagree"]["error"]
        assert r["disagree"]["unchanged"]


def test_bad_arguments_name_the_value() -> None:
    part = _part(_model(), 0)
    optimizer = torch.optim.SGD(part.parameters(), lr=0.1)
    loss = nn.CrossEntropyLoss()
    with pytest.raises(ValueError, match=r"stage_index must be in \[0, 2\); got 2"):
        pipeline_step(part, optimizer, loss, stage_index=2, num_stages=2, n_microbatches=2)
    with pytest.raises(TypeError, match="schedule must be a torch.distributed.pipelining"):
        pipeline_step(
            part, optimizer, loss, stage_index=0, num_stages=2, n_microbatches=2, schedule="1f1b"
        )
    with pytest.raises(ValueError, match="pipeline_step needs torch.distributed"):
        pipeline_step(part, optimizer, loss, stage_index=0, num_stages=2, n_microbatches=2)


def test_a_backward_run_by_the_caller_steps_like_a_call() -> None:
    """TrainStep.scale_loss + step_gradients (what each stage does) equal one call."""
    x, y = _batches(1)[0]
    results = []
    for manual in (False, True):
        model = _model()
        step = amp.build_train_network(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            nn.CrossEntropyLoss(),
            loss_scale_manager=amp.DynamicLossScaleManager(1024, 2, 1),
        )
        if manual:
            scaled = step.scale_loss(nn.functional.cross_entropy(step.network(x), y))
            torch.testing.assert_close(scaled, 1024 * nn.functional.cross_entropy(model(x), y))
            scaled.backward()
            step.step_gradients()
        else:
            step(x, y)
        results.append((_flat(model), step.loss_scale, step.optimizer_steps))
    (a, scale_a, steps_a), (b, scale_b, steps_b) = results
    assert torch.equal(a, b)
    assert scale_a == scale_b == 2048.0
    assert steps_a == steps_b == 1


def test_step_gradients_refuses_the_middle_of_an_accumulation() -> None:
    model = _model()
    step = amp.build_train_network(
        model, torch.optim.SGD(model.parameters()), nn.CrossEntropyLoss(), accumulation_steps=2
    )
    step(*_batches(1)[0])
    with pytest.raises(RuntimeError, match=r"step_gradients\(\) in the middle of gradient acc"):
        step.step_gradients()
