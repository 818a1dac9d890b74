"""mixprec.huggingface.prepare: mixprec's step in an Accelerate loop."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate")

import mixprec  # noqa: E402
from mixprec.huggingface import prepare  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_accelerator_state() -> Iterator[None]:
    """Accelerate keeps one process-wide state; each test builds its own Accelerator."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def parts() -> tuple[nn.Module, torch.optim.Optimizer, torch.utils.data.DataLoader]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2
    )
    return model, optimizer, loader


def test_step_skips_an_overflow_and_checkpoints_the_scale(tmp_path: Path) -> None:
    accelerator = accelerate.Accelerator(cpu=True)
    model, optimizer, loader = parts()
    manager = mixprec.DynamicLossScaleManager(2.0**10, scale_window=100)
    step, loader = prepare(
        accelerator,
        model,
        optimizer,
        loader,
        loss_fn=nn.MSELoss(),
        dtype="fp16",
        loss_scale_manager=manager,
        emulate=True,
    )
    for i, (x, y) in enumerate(loader):
        step(x * math.inf if i == 1 else x, y)
    assert step.skipped_steps == 1
    assert step.loss_scale == 512.0
    accelerator.save_state(str(tmp_path / "state"))

    other = accelerate.Accelerator(cpu=True)
    model2, optimizer2, loader2 = parts()
    step2, _ = prepare(
        other, model2, optimizer2, loader2, loss_fn=nn.MSELoss(), dtype="fp16", emulate=True
    )
    other.load_state(str(tmp_path / "state"))
    assert step2.loss_scale == 512.0
    assert step2.skipped_steps == 1
    a, b = model.state_dict(), model2.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_warns_where_accelerate_mixed_precision_stacks_or_does_nothing() -> None:
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="fp16")
    model, optimizer, _ = parts()
    with pytest.warns(UserWarning, match="does nothing at all"):
        prepare(accelerator, model, optimizer, loss_fn=nn.MSELoss(), dtype="bf16", emulate=True)


def test_a_skip_is_reported_as_accelerate_reports_its_own() -> None:
    # Accelerate's loops ask optimizer_step_was_skipped (its GradScaler sets it); a scheduler
    # prepared with the optimizer does not move after a skipped step
    accelerator = accelerate.Accelerator(cpu=True)
    model, optimizer, loader = parts()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    manager = mixprec.DynamicLossScaleManager(2.0**10, scale_window=100)
    step, loader, scheduler = prepare(
        accelerator,
        model,
        optimizer,
        loader,
        scheduler,
        loss_fn=nn.MSELoss(),
        dtype="fp16",
        loss_scale_manager=manager,
        emulate=True,
    )
    assert isinstance(scheduler, accelerate.scheduler.AcceleratedScheduler)
    seen = []
    for i, (x, y) in enumerate(loader):
        step(x * math.inf if i == 1 else x, y)
        seen.append((step.overflow, accelerator.optimizer_step_was_skipped))
        scheduler.step()
    assert seen == [(False, False), (True, True), (False, False), (False, False)]
    assert scheduler.get_last_lr() == [0.1 * 0.5**3]  # three steps taken, three moves
    assert step.skipped_steps == 1


@pytest.mark.parametrize("overflow_at", [None, 3], ids=["clean", "skip"])
def test_accumulation_steps_the_prepared_scheduler_once_per_optimizer_step(
    overflow_at: int | None,
) -> None:
    # 6 micro-batches, 2 per optimizer step: the steps end at micro-batches 1, 3 and 5
    accelerator = accelerate.Accelerator(cpu=True)
    model, optimizer, _ = parts()
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
    manager = mixprec.DynamicLossScaleManager(2.0**10, scale_window=100)
    step, scheduler = prepare(
        accelerator,
        model,
        optimizer,
        scheduler,
        loss_fn=nn.MSELoss(),
        dtype="fp16",
        loss_scale_manager=manager,
        emulate=True,
        accumulation_steps=2,
    )
    g = torch.Generator().manual_seed(1)
    lrs, synced = [], []
    for i in range(6):
        x = torch.randn(2, 4, generator=g)
        step(x * math.inf if i == overflow_at else x, x.sum(1, keepdim=True))
        synced.append(accelerator.sync_gradients)
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    assert synced == [False, True] * 3
    moves = [0, 1, 1, 2, 2, 3] if overflow_at is None else [0, 1, 1, 1, 1, 2]
    assert lrs == pytest.approx([0.1 * 0.9**m for m in moves], rel=1e-12)
    assert step.skipped_steps == (overflow_at is not None)
