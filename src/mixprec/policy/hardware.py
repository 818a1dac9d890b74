"""What a device runs fast: the one place that answers "is this dtype native here?".

``auto``, the slow-dtype warning, the demo and ``mixprec doctor`` all ask
:func:`is_native`. Its answers, and why:

- **CPU, bfloat16**: native when the processor has bfloat16 dot-product instructions
  (x86 ``avx512_bf16`` or AMX tiles; Arm's BF16 extension) *and* oneDNN is allowed to use
  them. AVX-512 without ``avx512_bf16`` (Skylake, Cascade Lake) is not native: oneDNN
  emulates bfloat16 there. ``ONEDNN_MAX_CPU_ISA=AVX2`` turns the instructions off, and the
  probe follows it. On an AVX2-only CPU a bfloat16 matmul runs about 250x slower than a
  float32 one.
- **CPU, float16**: native only with AMX-FP16 (Granite Rapids and later) and oneDNN on;
  ``avx512_fp16`` alone is not enough: PyTorch's CPU matmul does not use it.
- **CUDA**: float16 on every GPU; bfloat16 from compute capability 8.0 (Ampere) on.

Probes run on first use, never at import, and are cached for the process.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["CpuFeatures", "cpu_features", "cpu_name", "is_native", "native_dtypes"]


@dataclass(frozen=True)
class CpuFeatures:
    """The instruction-set facts that decide CPU low-precision speed."""

    arch: str
    capability: str  # the vector ISA PyTorch's own kernels use ("AVX2", "AVX512", ...)
    avx2: bool
    avx512: bool
    avx512_bf16: bool
    amx_tile: bool
    amx_fp16: bool
    arm_bf16: bool
    onednn_bf16: bool  # oneDNN may run bfloat16 (its ISA cap allows AVX-512 or better)
    onednn_fp16: bool

    @property
    def native_bf16(self) -> bool:
        """bfloat16 dot products in hardware, and oneDNN allowed to use them."""
        return (self.avx512_bf16 or self.amx_tile or self.arm_bf16) and self.onednn_bf16

    @property
    def native_fp16(self) -> bool:
        """float16 matmuls in hardware (AMX-FP16), and oneDNN allowed to use them."""
        return self.amx_fp16 and self.onednn_fp16


def _probe(name: str, owner: object = torch.cpu) -> bool:
    """Call a boolean probe of torch if this build has it (False if not)."""
    probe: Callable[[], object] | None = getattr(owner, name, None)
    if probe is None:
        return False
    try:
        return bool(probe())
    except (RuntimeError, AttributeError):  # a build without that backend
        return False


def _arm_bf16() -> bool:
    if platform.machine().lower() not in ("aarch64", "arm64"):
        return False
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return any(
                line.startswith("Features") and " bf16" in f" {line.split(':', 1)[-1]}"
                for line in info
            )
    except OSError:
        return False


@functools.cache
def cpu_features() -> CpuFeatures:
    """This process's CPU, as PyTorch and oneDNN see it (cached)."""
    mkldnn = torch.ops.mkldnn
    return CpuFeatures(
        arch=platform.machine(),
        capability=str(torch.backends.cpu.get_cpu_capability()),
        avx2=_probe("_is_avx2_supported"),
        avx512=_probe("_is_avx512_supported"),
        avx512_bf16=_probe("_is_avx512_bf16_supported"),
        amx_tile=_probe("_is_amx_tile_supported"),
        amx_fp16=_probe("_is_amx_fp16_supported"),
        arm_bf16=_arm_bf16(),
        onednn_bf16=_probe("_is_mkldnn_bf16_supported", mkldnn),
        onednn_fp16=_probe("_is_mkldnn_fp16_supported", mkldnn),
    )


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


def is_native(dtype: torch.dtype, device: torch.device | str | None = None) -> bool:
    """Whether ``device`` runs ``dtype`` matmuls natively (at least as fast as float32).

    float32 and float64 are native everywhere; see the module docstring for the rules.

    Example:
        >>> is_native(torch.float32, "cpu")
        True
    """
    dev = torch.device("cpu" if device is None else device)
    if dtype in (torch.float32, torch.float64):
        return True
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return False
        if dtype == torch.float16:
            return True
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return dtype == torch.bfloat16 and _cuda_capability(index) >= (8, 0)
    if dev.type == "cpu":
        features = cpu_features()
        if dtype == torch.bfloat16:
            return features.native_bf16
        if dtype == torch.float16:
            return features.native_fp16
    return False


def native_dtypes(device: torch.device | str | None = None) -> tuple[torch.dtype, ...]:
    """The low-precision dtypes ``device`` runs natively, bfloat16 first."""
    return tuple(d for d in (torch.bfloat16, torch.float16) if is_native(d, device))


def cpu_name() -> str:
    """The processor's model name (``/proc/cpuinfo``), or what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
