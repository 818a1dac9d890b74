"""The hardware probe, the slow-dtype warning and the ``auto`` recommendation, with the
probe answering for each kind of CPU (never for the CPU the tests happen to run on)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

import mixprec as amp
from conftest import AVX2_ONLY, AVX512_NO_BF16, NATIVE_BF16, REAL_CPU_FEATURES, fake_cpu
from helpers import MLP
from mixprec.policy import dtypes, hardware
from mixprec.policy.levels import Level, recommend


@pytest.mark.parametrize(
    ("features", "bf16", "fp16"),
    [
        (NATIVE_BF16, True, False),
        (AVX2_ONLY, False, False),
        (AVX512_NO_BF16, False, False),  # Skylake/Cascade Lake: oneDNN emulates bf16
        (replace(NATIVE_BF16, onednn_bf16=False), False, False),  # ONEDNN_MAX_CPU_ISA=AVX2
        (replace(NATIVE_BF16, amx_fp16=True), True, True),  # Granite Rapids
        (replace(AVX2_ONLY, arch="aarch64", arm_bf16=True, onednn_bf16=True), True, False),
    ],
    ids=["sapphire-rapids", "avx2", "skylake", "isa-capped", "amx-fp16", "arm-bf16"],
)
def test_cpu_rules(
    monkeypatch: pytest.MonkeyPatch, features: hardware.CpuFeatures, bf16: bool, fp16: bool
) -> None:
    fake_cpu(monkeypatch, features)
    assert hardware.is_native(torch.bfloat16, "cpu") is bf16
    assert hardware.is_native(torch.float16, "cpu") is fp16
    assert hardware.is_native(torch.float32, "cpu")
    assert dtypes.has_native_low_precision("cpu") is bf16
    expected = tuple(d for d, ok in ((torch.bfloat16, bf16), (torch.float16, fp16)) if ok)
    assert hardware.native_dtypes("cpu") == expected


def test_the_real_probe_describes_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardware, "cpu_features", REAL_CPU_FEATURES)
    features = hardware.cpu_features()
    assert features.arch
    assert features.capability == str(torch.backends.cpu.get_cpu_capability())
    assert hardware.is_native(torch.bfloat16) is features.native_bf16


@pytest.mark.parametrize(("capability", "bf16"), [((7, 0), False), ((8, 0), True), ((9, 0), True)])
def test_cuda_rules(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], bf16: bool
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(hardware, "_cuda_capability", lambda index: capability)
    assert hardware.is_native(torch.float16, "cuda")
    assert hardware.is_native(torch.bfloat16, "cuda:0") is bf16
    low = torch.bfloat16 if bf16 else torch.float16
    assert dtypes.default_low_dtype("cuda") == low
    level, dtype, reason = recommend(torch.device("cuda"), None)
    assert (level, dtype) == (Level.O2, low)
    assert reason == f"O2 {dtypes.dtype_name(low)} on a CUDA GPU"


def test_recommend_per_cpu_kind(cpu_kind: str) -> None:
    level, dtype, reason = recommend(torch.device("cpu"), None, quiet=True)
    if cpu_kind == "native-bf16":
        assert (level, dtype) == (Level.O2, torch.bfloat16)
    else:
        assert (level, dtype) == (Level.O0, None)
        assert "no native low-precision matmul" in reason
    # an explicit dtype is respected on every CPU
    assert recommend(torch.device("cpu"), torch.float16, quiet=True)[:2] == (
        Level.O2,
        torch.float16,
    )


def test_slow_dtype_warns_once_at_the_users_line(cpu_kind: str) -> None:
    model = MLP()
    if cpu_kind == "native-bf16":
        with warnings_as_errors():
            amp.auto_mixed_precision(model, "O2", "bf16")
        return
    with pytest.warns(UserWarning, match=r"computing in bfloat16 on cpu.*about 250x") as record:
        amp.auto_mixed_precision(model, "O2", "bf16")
    assert [w.filename for w in record] == [__file__]
    with warnings_as_errors():  # once per process and device
        amp.auto_mixed_precision(model, "O1", "bf16")
        amp.build_train_network(model, torch.optim.SGD(model.parameters(), lr=0.1), level="O2")


def test_slow_dtype_warning_from_build_train_network(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpu(monkeypatch, AVX2_ONLY)
    model = MLP()
    with pytest.warns(UserWarning, match="computing in bfloat16") as record:
        amp.build_train_network(
            model, torch.optim.SGD(model.parameters(), lr=0.1), level="O1", dtype="bf16"
        )
    assert [w.filename for w in record] == [__file__]


def test_o0_never_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpu(monkeypatch, AVX2_ONLY)
    with warnings_as_errors():
        amp.auto_mixed_precision(MLP(), "O0", "bf16")


@contextlib.contextmanager
def warnings_as_errors() -> Iterator[None]:
    """A block in which any warning fails the test."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert not caught, [str(w.message) for w in caught]
