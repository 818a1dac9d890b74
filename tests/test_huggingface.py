"""mixprec.huggingface with the real transformers Trainer, and declared float32 modules."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import mixprec  # noqa: E402
from mixprec.convert.declared import declared_fp32_pin  # noqa: E402
from mixprec.huggingface import MixprecCallback, MixprecTrainer  # noqa: E402

LR = 0.01
STEPS = 4


def tiny_gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1,
        n_embd=8,
        n_head=2,
        vocab_size=16,
        n_positions=8,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int = 8) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 16, (n, 6), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def arguments(tmp_path: Path, **kwargs: Any) -> Any:
    base = {
        "output_dir": str(tmp_path),
        "max_steps": STEPS,
        "per_device_train_batch_size": 2,
        "learning_rate": LR,
        "lr_scheduler_type": "linear",
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "disable_tqdm": True,
    }
    return transformers.TrainingArguments(**(base | kwargs))


class Injecting(MixprecTrainer):
    """Makes the loss inf at the given optimizer steps (global_step at the step)."""

    overflow_at: tuple[int, ...] = ()

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        loss = super().compute_loss(*args, **kwargs)
        if self._scaling_loss and self.state.global_step in self.overflow_at:
            return loss * math.inf
        return loss


def fp16(**kwargs: Any) -> MixprecCallback:
    manager = mixprec.DynamicLossScaleManager(2.0**10, scale_window=100)
    return MixprecCallback("O2", "fp16", loss_scale_manager=manager, emulate=True, **kwargs)


def path_dtype(converted: torch.nn.Module, path: str) -> str:
    rows = mixprec.explain(converted).to_dict()["rows"]
    return next(row["dtype"] for row in rows if row["path"] == path)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("accumulation", [1, 2], ids=["ga1", "ga2"])
def test_fp16_skips_an_overflow_and_its_schedule_step(accumulation: int, tmp_path: Path) -> None:
    Injecting.overflow_at = (1,)
    args = arguments(tmp_path, gradient_accumulation_steps=accumulation, max_grad_norm=1.0)
    model = tiny_gpt2()
    trainer = Injecting(model, args, train_dataset=Rows(8 * accumulation), mixprec=fp16())
    trainer.train()
    assert path_dtype(model.transformer, "h.0.mlp.c_fc") == "float16"
    assert trainer.state.global_step == STEPS  # the Trainer counts a skipped step
    assert trainer.mixprec.skipped_steps == 1
    assert trainer.mixprec.overflow is False  # the last step was taken
    assert trainer.accelerator.optimizer_step_was_skipped is False
    assert trainer.mixprec.scaling.loss_scale == 512.0
    # the linear schedule moved on the STEPS - 1 steps the optimizer took
    assert trainer.lr_scheduler.last_epoch == STEPS - 1
    logs = [row for row in trainer.state.log_history if "loss" in row]
    assert [row["mixprec/skipped_steps"] for row in logs] == [0.0, 1.0, 1.0, 1.0]
    assert [row["mixprec/loss_scale"] for row in logs] == [1024.0, 512.0, 512.0, 512.0]
    norms = [row["grad_norm"] for i, row in enumerate(logs) if i != 1]
    assert all(0 < n < 100 for n in norms)  # unscaled (the scale is 1024)
    assert all(
        math.isfinite(row["loss"]) and row["loss"] < 10 for i, row in enumerate(logs) if i != 1
    )


class Steps(transformers.TrainerCallback):
    """What the Trainer did at each optimizer step: its count, the skip, the learning rate."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.rows: list[tuple[int, bool, float]] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        skipped = self.trainer.accelerator.optimizer_step_was_skipped
        lr = self.trainer.lr_scheduler.get_last_lr()[0]
        self.rows.append((state.global_step, skipped, lr))


class NativeFloat16(transformers.Trainer):
    """The Trainer's own float16 path: Accelerate's GradScaler (on a CPU, set by hand)."""

    overflow_at: tuple[int, ...] = ()

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        loss = super().compute_loss(*args, **kwargs)
        return loss * math.inf if self.state.global_step in self.overflow_at else loss


def applied_updates(trainer: Any) -> int:
    """The optimizer's own count of the updates it applied (AdamW's ``step``)."""
    return int(next(iter(trainer.optimizer.state.values()))["step"])


def train_recording(trainer: Any, steps: Steps) -> tuple[Any, ...]:
    steps.trainer = trainer
    trainer.train()
    lrs = [row["learning_rate"] for row in trainer.state.log_history if "loss" in row]
    return steps.rows, lrs, trainer.state.global_step, applied_updates(trainer)


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_skips_are_counted_and_scheduled_as_the_trainers_own_float16(
    optim: str, tmp_path: Path
) -> None:
    # the reference: the Trainer's float16 path with Accelerate's GradScaler, where
    # Accelerate sees a skip (an optimizer whose step the scaler does not call)
    kwargs = {"gradient_accumulation_steps": 2, "max_grad_norm": 1.0, "warmup_steps": 1}
    NativeFloat16.overflow_at = Injecting.overflow_at = (1, 2)
    steps = Steps()
    native = NativeFloat16(
        tiny_gpt2(),
        arguments(tmp_path / "native", optim="adamw_torch", **kwargs),
        train_dataset=Rows(16),
        callbacks=[steps],
    )
    native.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    reference = train_recording(native, steps)
    assert [skipped for _, skipped, _ in reference[0]] == [False, True, True, False]
    assert reference[2] == STEPS  # global_step counts the skipped steps
    assert reference[3] == STEPS - 2  # the updates applied

    steps = Steps()
    ours = Injecting(
        tiny_gpt2(),
        arguments(tmp_path / "mixprec", optim=optim, **kwargs),
        train_dataset=Rows(16),
        mixprec=fp16(),
        callbacks=[steps],
    )
    assert train_recording(ours, steps) == reference
    assert ours.mixprec.skipped_steps == 2


def test_the_native_path_misses_a_skip_of_a_fused_optimizer(tmp_path: Path) -> None:
    # what mixprec does not copy: a fused AdamW (the Trainer's default) skips inside its
    # step, so Accelerate reports no skip and the Trainer moves the schedule on
    NativeFloat16.overflow_at = (1,)
    steps = Steps()
    native = NativeFloat16(
        tiny_gpt2(), arguments(tmp_path), train_dataset=Rows(), callbacks=[steps]
    )
    native.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    rows, _, _, updates = train_recording(native, steps)
    assert native.args.optim == "adamw_torch_fused"
    assert not any(skipped for _, skipped, _ in rows)
    assert updates == STEPS - 1  # the weights were not updated, yet
    assert native.lr_scheduler.last_epoch == STEPS  # the schedule moved on every step


def test_fp16_checkpoint_resumes_bit_identically_and_saves_pretrained(tmp_path: Path) -> None:
    Injecting.overflow_at = (1, 3)
    straight = tiny_gpt2()
    Injecting(straight, arguments(tmp_path / "a"), train_dataset=Rows(), mixprec=fp16()).train()

    args = arguments(tmp_path / "b", save_strategy="steps", save_steps=2)
    first = Injecting(tiny_gpt2(), args, train_dataset=Rows(), mixprec=fp16())
    first.train()
    resumed_model = tiny_gpt2()
    resumed = Injecting(resumed_model, args, train_dataset=Rows(), mixprec=fp16())
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))
    a, b = weights(straight), weights(resumed_model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.mixprec.scaling.skipped_steps == 2
    assert resumed.mixprec.scaling.loss_scale == 256.0
    assert resumed.lr_scheduler.last_epoch == STEPS - 2

    resumed.save_model(str(tmp_path / "saved"))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved"))
    c = weights(loaded)
    assert all(torch.equal(b[k], c[k]) for k in c)
    assert all(p.dtype == torch.float32 for p in loaded.parameters())


def test_bf16_callback_with_a_plain_trainer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_gpt2()
    callback = MixprecCallback("O2", "bf16", emulate=True)
    trainer = transformers.Trainer(
        model, arguments(tmp_path, max_steps=2), train_dataset=Rows(), callbacks=[callback]
    )
    with caplog.at_level(logging.INFO, logger="mixprec"):
        trainer.train()
    assert "mixprec plan of transformer" in caplog.text
    logs = [row for row in trainer.state.log_history if "loss" in row]
    assert [row["mixprec/loss_scale"] for row in logs] == [1.0, 1.0]
    assert [row["mixprec/skipped_steps"] for row in logs] == [0.0, 0.0]
    assert mixprec.explain(model.transformer).to_dict()["rows"][0]["dtype"] in (
        "bfloat16",
        "float32",
    )


def test_the_trainers_own_mixed_precision_is_refused(tmp_path: Path) -> None:
    callback = MixprecCallback("O2", "bf16", emulate=True)
    with pytest.raises(
        ValueError, match=r"bf16=True\) runs the model under an outer torch.autocast"
    ):
        transformers.Trainer(tiny_gpt2(), arguments(tmp_path, bf16=True), callbacks=[callback])


def test_declared_modules_of_the_root_reach_its_children() -> None:
    class Stack(torch.nn.Module):
        _keep_in_fp32_modules_strict = ("blocks.1",)

        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])

    stack = Stack()
    MixprecCallback("O2", "bf16", emulate=True).convert(stack)
    assert path_dtype(stack.blocks, "0") == "bfloat16"
    assert path_dtype(stack.blocks, "1") == "float32"


def test_loss_scaling_needs_the_trainer_subclass(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="MixprecTrainer"):
        transformers.Trainer(tiny_gpt2(), arguments(tmp_path), callbacks=[fp16()])
    with pytest.raises(TypeError, match="MixprecCallback"):
        MixprecTrainer(tiny_gpt2(), arguments(tmp_path), mixprec="O2")


def tiny_t5() -> Any:
    config = transformers.T5Config(
        vocab_size=32,
        d_model=8,
        d_kv=4,
        d_ff=16,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        decoder_start_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config)


def plan_dtypes(model: torch.nn.Module) -> dict[str, str]:
    rows = mixprec.explain(model).to_dict()["rows"]
    return {
        row["path"]: row["dtype"] for row in rows if row["op"] == "Linear" or row["op"] == "linear"
    }


WO = "encoder.block.0.layer.1.DenseReluDense.wo"
WI = "encoder.block.0.layer.1.DenseReluDense.wi"


@pytest.mark.parametrize("level", ["O1", "O2", "O3", "autocast"])
def test_t5_wo_stays_float32_in_float16(level: str) -> None:
    converted = mixprec.auto_mixed_precision(tiny_t5(), level, "fp16", emulate=True)
    dtypes = plan_dtypes(converted)
    assert dtypes[WO] == "float32"
    assert dtypes[WI] == "float16"


def test_declared_fp32_follows_transformers_meaning() -> None:
    # _keep_in_fp32_modules is for float16 only; the strict list for both low dtypes
    model = tiny_t5()
    assert (
        plan_dtypes(mixprec.auto_mixed_precision(model, "O2", "bf16", emulate=True))[WO]
        == "bfloat16"
    )
    assert declared_fp32_pin(model, torch.bfloat16) is None
    model._keep_in_fp32_modules_strict = {"wi"}
    dtypes = plan_dtypes(mixprec.auto_mixed_precision(model, "O2", "bf16", emulate=True))
    assert dtypes[WI] == "float32"
    assert dtypes[WO] == "bfloat16"


def test_declared_fp32_can_be_turned_off() -> None:
    off = mixprec.auto_mixed_precision(tiny_t5(), "O2", "fp16", emulate=True, declared_fp32=False)
    assert plan_dtypes(off)[WO] == "float16"
    with pytest.raises(TypeError, match="declared_fp32"):
        mixprec.auto_mixed_precision(tiny_t5(), "O2", "fp16", declared_fp32="no")


def test_declared_names_match_whole_parts() -> None:
    pin = declared_fp32_pin(
        type("M", (torch.nn.Module,), {"_keep_in_fp32_modules": ["wo"]})(), torch.float16
    )
    assert pin is not None
    assert pin(torch.nn.Linear(1, 1), "a.wo")
    assert pin(torch.nn.Linear(1, 1), "a.wo.inner")
    assert not pin(torch.nn.Linear(1, 1), "word_embeddings")
    assert not pin(torch.nn.Linear(1, 1), "a.wo2")


def test_lightning_plugin_honours_declared_modules_of_a_child(tmp_path: Path) -> None:
    lightning = pytest.importorskip("lightning")
    from mixprec.lightning import MixedPrecision

    class Wrapper(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_t5()

    wrapper = Wrapper()
    MixedPrecision("O2", "fp16", emulate=True).convert_module(wrapper)
    assert plan_dtypes(wrapper.model)[WO] == "float32"
