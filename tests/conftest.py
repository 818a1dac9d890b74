"""Shared fixtures. ``cpu_kind`` runs a test once per kind of CPU the project meets."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from mixprec.policy import dtypes, hardware

#: A CPU with bfloat16 dot products (Sapphire Rapids: avx512_bf16 and AMX).
NATIVE_BF16 = hardware.CpuFeatures(
    arch="x86_64",
    capability="AVX512",
    avx2=True,
    avx512=True,
    avx512_bf16=True,
    amx_tile=True,
    amx_fp16=False,
    arm_bf16=False,
    onednn_bf16=True,
    onednn_fp16=True,
)
#: An AVX2-only CPU (no AVX-512, no AMX): bfloat16 is emulated, ~250x slower than float32.
AVX2_ONLY = replace(
    NATIVE_BF16,
    capability="AVX2",
    avx512=False,
    avx512_bf16=False,
    amx_tile=False,
    onednn_bf16=False,
    onednn_fp16=False,
)
#: Skylake / Cascade Lake servers: AVX-512 but no bfloat16 instructions.
AVX512_NO_BF16 = replace(NATIVE_BF16, avx512_bf16=False, amx_tile=False)

CPU_KINDS = {"native-bf16": NATIVE_BF16, "avx2-only": AVX2_ONLY}
#: The probe itself, for the one test that describes the machine it runs on.
REAL_CPU_FEATURES = hardware.cpu_features


def fake_cpu(monkeypatch: pytest.MonkeyPatch, features: hardware.CpuFeatures) -> None:
    """Make the hardware probe describe ``features`` (and forget earlier warnings), in
    :mod:`mixprec.policy.hardware` and in every mixprec module that imported the probe by
    name (:mod:`mixprec.policy.dtypes`, whose slow-dtype warning describes the CPU, ...)."""
    fake = lambda: features  # noqa: E731
    users = [m for n, m in sys.modules.items() if n.startswith("mixprec") and m is not None]
    for module in {hardware, dtypes, *users}:
        if hasattr(module, "cpu_features"):
            monkeypatch.setattr(module, "cpu_features", fake)
    dtypes._warn_slow_once.cache_clear()


@pytest.fixture(autouse=True)
def _same_cpu_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test sees a native-bf16 CPU unless it asks for another (``cpu_kind``,
    ``fake_cpu``): no test's outcome depends on the machine it runs on, not even through
    the once-per-process slow-dtype warning."""
    fake_cpu(monkeypatch, NATIVE_BF16)


@pytest.fixture(params=sorted(CPU_KINDS))
def cpu_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run the test once with a native-bf16 CPU and once with an AVX2-only one."""
    fake_cpu(monkeypatch, CPU_KINDS[request.param])
    yield request.param
    dtypes._warn_slow_once.cache_clear()
