"""build_train_network: loss scaling in the loop, skipping, master weights, accumulation,
clipping, checkpoints, the auto level and the errors."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as amp
from helpers import MLP, SmallCNN, TinyTransformer

LEVELS = ["O0", "O1", "O2", "O3", "autocast"]


def _data(n: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g), torch.randint(0, 8, (n,), generator=g)


def _model(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP()


def _poisoned(x: torch.Tensor) -> torch.Tensor:
    bad = x.clone()
    bad[0, 0] = float("inf")
    return bad


# ------------------------------------------------------------------- loss scaling


def test_dynamic_scale_trace_through_the_step() -> None:
    """MindSpore's published trace: init 1024, factor 2, window 3, overflows F F F F T F F F T T."""
    model = _model()
    step = amp.build_train_network(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        nn.CrossEntropyLoss(),
        level="O2",
        dtype="bf16",
        loss_scale_manager=amp.DynamicLossScaleManager(1024, 2, 3),
    )
    x, y = _data()
    scales, flags = [], []
    for overflow in [False, False, False, False, True, False, False, False, True, True]:
        step(_poisoned(x) if overflow else x, y)
        scales.append(step.loss_scale)
        flags.append(step.overflow)
    assert scales == [1024, 1024, 2048, 2048, 1024, 1024, 1024, 2048, 1024, 512]
    assert flags == [False] * 4 + [True] + [False] * 3 + [True, True]
    assert step.skipped_steps == 3


def test_skipped_step_leaves_parameters_and_optimizer_state_untouched() -> None:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    step = amp.build_train_network(
        model, optimizer, nn.CrossEntropyLoss(), level="O2", dtype="fp16"
    )
    x, y = _data(8)
    for _ in range(3):
        step(x, y)
    params = copy.deepcopy(list(model.parameters()))
    low = copy.deepcopy(list(step.network.parameters()))
    state = copy.deepcopy(optimizer.state_dict())
    skipped = step.skipped_steps
    scale = step.loss_scale
    step(_poisoned(x), y)
    assert step.overflow
    assert step.skipped_steps == skipped + 1
    assert step.loss_scale == scale / 2
    for before, after in zip(params, model.parameters(), strict=True):
        assert torch.equal(before, after)
    for before, after in zip(low, step.network.parameters(), strict=True):
        assert torch.equal(before, after)
    after_state = optimizer.state_dict()
    for key, value in state["state"].items():
        assert torch.equal(value["step"], after_state["state"][key]["step"])
        assert torch.equal(value["exp_avg"], after_state["state"][key]["exp_avg"])
    assert all(p.grad is None for p in model.parameters())


def test_scaled_run_matches_unscaled_control() -> None:
    """Power-of-two scaling is exact: a fixed scale of 1024 gives the control's weights."""
    x, y = _data()
    control = _model()
    opt_c = torch.optim.SGD(control.parameters(), lr=0.1, momentum=0.9)
    scaled = _model()
    opt_s = torch.optim.SGD(scaled.parameters(), lr=0.1, momentum=0.9)
    step = amp.build_train_network(
        scaled, opt_s, nn.CrossEntropyLoss(), loss_scale_manager=amp.FixedLossScaleManager(1024.0)
    )
    for _ in range(5):
        opt_c.zero_grad()
        F.cross_entropy(control(x), y).backward()
        opt_c.step()
        step(x, y)
    assert step.loss_scale == 1024.0
    for a, b in zip(control.parameters(), scaled.parameters(), strict=True):
        assert torch.equal(a, b)


def test_fixed_manager_without_drop_never_checks_or_skips() -> None:
    model = _model()
    step = amp.build_train_network(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        nn.CrossEntropyLoss(),
        loss_scale_manager=amp.FixedLossScaleManager(8.0, drop_overflow_update=False),
    )
    x, y = _data()
    step(_poisoned(x), y)
    assert not step.overflow
    assert step.skipped_steps == 0
    assert not torch.isfinite(model.net[0].weight).all()  # the update went through
    assert step.loss_scale == 8.0


def test_without_a_manager_non_finite_steps_are_still_skipped() -> None:
    model = _model()
    step = amp.build_train_network(
        model, torch.optim.SGD(model.parameters(), lr=0.01), nn.CrossEntropyLoss(), level="O2"
    )
    assert step.loss_scale_manager is None  # bfloat16: no loss scaling by default
    x, y = _data()
    before = copy.deepcopy(model.net[0].weight)
    step(_poisoned(x), y)
    assert step.overflow
    assert torch.equal(model.net[0].weight, before)


def _build(level: str, dtype: str, **options: object) -> amp.TrainStep:
    model = _model()
    return amp.build_train_network(
        model, torch.optim.SGD(model.parameters(), lr=0.1), level=level, dtype=dtype, **options
    )


def test_fresh_manager_per_call_and_defaults() -> None:
    a = _build("O2", "fp16")
    b = _build("O2", "fp16")
    assert isinstance(a.loss_scale_manager, amp.DynamicLossScaleManager)
    assert a.loss_scale_manager is not b.loss_scale_manager
    assert a.config.auto_loss_scale  # the first step picks the scale from its gradients
    assert a.loss_scale == 1.0
    user = _build("O2", "fp16", loss_scale_manager=amp.DynamicLossScaleManager())
    assert user.loss_scale == 2.0**24  # a manager the user builds keeps MindSpore's default
    assert not user.config.auto_loss_scale
    assert _build("O2", "fp16", loss_scale_manager=None).loss_scale_manager is None
    c = _build("O3", "bf16")
    assert c.loss_scale_manager is None
    assert c.config.cast_model_type == torch.bfloat16
    assert c.config.keep_batchnorm_fp32 is False
    d = _build("O2", "bf16")
    assert d.config.keep_batchnorm_fp32 is True
    assert d.config.master_weights is True


# --------------------------------------------------------------------- every level


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("level", LEVELS)
def test_training_improves_the_loss(level: str, dtype: str) -> None:
    torch.manual_seed(0)
    model = SmallCNN(channels=4, classes=3)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = amp.build_train_network(
        model, optimizer, nn.CrossEntropyLoss(), level=level, dtype=dtype
    )
    x, y = torch.randn(16, 3, 4, 4), torch.randint(0, 3, (16,))
    losses = [float(step(x, y)) for _ in range(25)]
    finite = [loss for loss in losses if loss == loss and abs(loss) != float("inf")]
    assert losses[-1] < 0.7 * finite[0], losses
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert step.skipped_steps < 25


def test_loss_is_computed_in_fp32() -> None:
    seen = {}

    def loss_fn(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        seen.update(output=output.dtype, label=label.dtype)
        return F.mse_loss(output, label)

    model = MLP((16, 8))
    step = amp.build_train_network(
        model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, level="autocast"
    )
    loss = step(torch.randn(4, 16), torch.randn(4, 8).bfloat16())
    assert seen == {"output": torch.float32, "label": torch.float32}
    assert loss.dtype == torch.float32


def test_network_that_returns_its_own_loss_with_keyword_inputs() -> None:
    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = TinyTransformer(classes=5)

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            logits = self.body(input_ids)
            return {"loss": F.cross_entropy(logits, labels), "logits": logits}

    torch.manual_seed(0)
    model = LM()
    step = amp.build_train_network(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3), level="O2"
    )
    ids, labels = torch.randint(0, 50, (16, 6)), torch.randint(0, 5, (16,))
    losses = [float(step(input_ids=ids, labels=labels)) for _ in range(20)]
    assert losses[-1] < 0.6 * losses[0]


# ------------------------------------------------------------------- master weights


def test_master_weights() -> None:
    model = _model()
    optimizer = torch.optim.SGD(
        [
            {"params": model.net[0].parameters(), "lr": 0.1},
            {"params": model.net[2:].parameters(), "lr": 0.01},
        ]
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    step = amp.build_train_network(
        model, optimizer, nn.CrossEntropyLoss(), level="O2", dtype="bf16"
    )
    net = step.network
    assert all(p.dtype == torch.bfloat16 for p in net.parameters())  # the model holds low weights
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the masters
    assert all(p.dtype == torch.float32 for g in optimizer.param_groups for p in g["params"])
    x, y = _data()
    before = model.net[0].weight.detach().clone()
    for _ in range(3):
        step(x, y)
        scheduler.step()
    assert not torch.equal(before, model.net[0].weight)
    for master, low in zip(model.parameters(), net.parameters(), strict=True):
        assert torch.equal(low, master.detach().to(torch.bfloat16))  # refreshed after each step
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    # no weight is cast in the forward pass any more
    from helpers import count_casts

    _, counter = count_casts(net, x)
    assert counter.total == 2  # the input down, the output up


def test_pure_low_precision_training_without_masters() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = amp.build_train_network(
        model, optimizer, nn.CrossEntropyLoss(), level="O3", master_weights=False
    )
    assert all(p.dtype == torch.bfloat16 for g in optimizer.param_groups for p in g["params"])
    x, y = _data()
    first = float(step(x, y))
    for _ in range(10):
        last = float(step(x, y))
    assert last < first


# ------------------------------------------------------------ accumulation, clipping


def test_accumulation_matches_one_big_batch() -> None:
    x, y = _data(32)
    big, small = _model(), _model()
    step_big = amp.build_train_network(
        big, torch.optim.SGD(big.parameters(), lr=0.1), nn.CrossEntropyLoss()
    )
    step_small = amp.build_train_network(
        small,
        torch.optim.SGD(small.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        accumulation_steps=4,
    )
    for _ in range(3):
        step_big(x, y)
        for i in range(4):
            step_small(x[8 * i : 8 * (i + 1)], y[8 * i : 8 * (i + 1)])
    assert step_small.optimizer_steps == step_big.optimizer_steps == 3
    for a, b in zip(big.parameters(), small.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_accumulation_one_overflow_decision_per_step() -> None:
    model = _model()
    step = amp.build_train_network(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        level="O2",
        dtype="bf16",
        loss_scale_manager=amp.DynamicLossScaleManager(256, 2, 100),
        accumulation_steps=3,
    )
    x, y = _data(8)
    before = copy.deepcopy(model.net[0].weight)
    step(x, y)
    step(_poisoned(x), y)
    assert step.loss_scale == 256  # unchanged between micro-batches
    assert step.optimizer_steps == 0
    step(x, y)
    assert step.optimizer_steps == 1
    assert step.overflow
    assert step.skipped_steps == 1
    assert step.loss_scale == 128
    assert torch.equal(model.net[0].weight, before)


def test_clip_grad_norm_applies_to_unscaled_gradients() -> None:
    x, y = _data()
    control, clipped = _model(), _model()
    opt_c = torch.optim.SGD(control.parameters(), lr=0.5)
    step = amp.build_train_network(
        clipped,
        torch.optim.SGD(clipped.parameters(), lr=0.5),
        nn.CrossEntropyLoss(),
        loss_scale_manager=amp.FixedLossScaleManager(4096.0),
        clip_grad_norm=0.05,
    )
    for _ in range(3):
        opt_c.zero_grad()
        F.cross_entropy(control(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(control.parameters(), 0.05)
        assert norm > 0.05  # clipping is active
        opt_c.step()
        step(x, y)
    for a, b in zip(control.parameters(), clipped.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize(("level", "dtype"), [("O2", "fp16"), ("O2", "bf16"), ("O1", "bf16")])
def test_checkpoint_resume_is_bit_identical(level: str, dtype: str) -> None:
    x, y = _data(16)

    def make(seed: int = 0) -> tuple[MLP, torch.optim.Optimizer, amp.TrainStep]:
        model = _model(seed)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        manager = amp.DynamicLossScaleManager(2.0**20, 2, 3)
        step = amp.build_train_network(
            model,
            optimizer,
            nn.CrossEntropyLoss(),
            level=level,
            dtype=dtype,
            loss_scale_manager=manager,
        )
        return model, optimizer, step

    batches = [(_poisoned(x) if i in (2, 6) else x, y) for i in range(10)]
    model_a, _, step_a = make()
    for batch in batches:
        step_a(*batch)

    _, opt_b, step_b = make()
    for batch in batches[:5]:
        step_b(*batch)
    buffer = io.BytesIO()
    torch.save({"step": step_b.state_dict(), "optimizer": opt_b.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)
    model_c, opt_c, step_c = make(
        seed=1
    )  # different initial weights: everything comes from the checkpoint
    step_c.load_state_dict(checkpoint["step"])
    opt_c.load_state_dict(checkpoint["optimizer"])
    for batch in batches[5:]:
        step_c(*batch)

    assert step_c.loss_scale == step_a.loss_scale
    assert step_c.skipped_steps == step_a.skipped_steps >= 2
    for a, c in zip(model_a.parameters(), model_c.parameters(), strict=True):
        assert torch.equal(a, c)
    for a, c in zip(step_a.network.parameters(), step_c.network.parameters(), strict=True):
        assert torch.equal(a, c)


def test_checkpoint_mid_accumulation_is_refused() -> None:
    model = _model()
    step = amp.build_train_network(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        accumulation_steps=2,
    )
    step(*_data(4))
    with pytest.raises(RuntimeError, match="middle of gradient accumulation"):
        step.state_dict()


# ---------------------------------------------------------------------- auto level


def test_auto_level_follows_the_probe(cpu_kind: str) -> None:
    model = _model()
    if cpu_kind == "native-bf16":
        step = amp.build_train_network(
            model, torch.optim.SGD(model.parameters(), lr=0.1), level="auto"
        )
        assert step.level is amp.Level.O2
        assert step.dtype == torch.bfloat16
        assert "level=O2 (O2 bfloat16 on a CPU with native bfloat16)" in repr(step)
        return
    with pytest.warns(UserWarning, match="chose O0") as record:
        step = amp.build_train_network(
            model, torch.optim.SGD(model.parameters(), lr=0.1), level="auto"
        )
    assert record[0].filename == __file__  # the user's line, not mixprec's
    assert step.level is amp.Level.O0
    assert "level=O0 (O0: cpu has no native low-precision matmul" in repr(step)


# --------------------------------------------------------------------------- errors


def test_errors() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="Unsupported arg 'loss_scale'"):
        amp.build_train_network(model, opt, loss_scale=2)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer; got list"):
        amp.build_train_network(model, [1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="network must be a torch.nn.Module"):
        amp.build_train_network("net", opt)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match="The amp level 'O4' is not supported: level must be one of"
    ):
        amp.build_train_network(model, opt, level="O4")
    with pytest.raises(ValueError, match="dtype must be one of"):
        amp.build_train_network(model, opt, level="O2", dtype="int8")
    with pytest.raises(ValueError, match="boost_config has an unknown key 'freez'"):
        amp.build_train_network(model, opt, boost_level="O1", boost_config={"freez": True})
    with pytest.raises(ValueError, match="accumulation_steps must be a positive int; got 0"):
        amp.build_train_network(model, opt, accumulation_steps=0)
    with pytest.raises(
        ValueError, match="clip_grad_norm must be a positive finite number or None; got -1"
    ):
        amp.build_train_network(model, opt, clip_grad_norm=-1)
    with pytest.raises(ValueError, match="cast_model_type=torch.bfloat16 does not fit level 'O1'"):
        amp.build_train_network(model, opt, level="O1", cast_model_type=torch.bfloat16)
    with pytest.raises(ValueError, match="master_weights=True needs low-precision parameters"):
        amp.build_train_network(
            model, opt, level="O2", cast_model_type=torch.float32, master_weights=True
        )
    with pytest.raises(TypeError, match="loss_scale_manager must be a mixprec.LossScaleManager"):
        amp.build_train_network(model, opt, loss_scale_manager=1024)
    with pytest.raises(TypeError, match="keep_batchnorm_fp32 must be a bool; got 'yes'"):
        amp.build_train_network(model, opt, keep_batchnorm_fp32="yes")
    step = amp.build_train_network(model, opt, nn.CrossEntropyLoss())
    with pytest.raises(TypeError, match="the label is the last positional argument"):
        step()


def test_cast_at_use_o2_keeps_fp32_parameters() -> None:
    model = _model()
    step = amp.build_train_network(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        level="O2",
        cast_model_type="fp32",
    )
    assert step.masters is None
    assert all(p.dtype == torch.float32 for p in step.network.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(*_data())
