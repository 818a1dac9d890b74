"""``mixprec doctor``: what this machine runs natively, measured, and the level to use.

It reports the torch version, the CPU (architecture, the vector ISA PyTorch's kernels
use, the bfloat16/float16 instructions and whether oneDNN may use them), each CUDA
device with its compute capability, a short timed matrix multiply per dtype (GFLOP/s),
and the ``auto`` recommendation with its reason. It needs only torch and takes a few
seconds: each GEMM grows from 64x64 until one call takes a few milliseconds, so a dtype
that runs at 0.2 GFLOP/s (bfloat16 on an AVX2-only CPU) costs no more than a fast one.
"""

from __future__ import annotations

import dataclasses
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

from mixprec.cli.terminal import dumps
from mixprec.policy.dtypes import dtype_name
from mixprec.policy.hardware import cpu_features, cpu_name, is_native
from mixprec.policy.levels import recommend

__all__ = ["diagnose", "gemm_gflops", "render"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def gemm_gflops(
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    budget_s: float = 0.25,
    max_size: int = 1024,
) -> dict[str, float]:
    """Throughput of an ``n x n @ n x n`` matmul in ``dtype``, in GFLOP/s (on a CPU, of
    one core: on a shared machine a multi-threaded GEMM mostly measures waiting).

    ``n`` doubles from 64 until the fastest of three calls takes at least 1/20 of
    ``budget_s`` (or reaches ``max_size``); then calls repeat for about ``budget_s`` and the
    fastest is reported: other jobs on a shared machine only ever make a call slower.

    Returns:
        ``{"gflops": ..., "size": n}``.
    """
    dev = torch.device(device)

    def timed(a: torch.Tensor, b: torch.Tensor) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        start = time.perf_counter()
        torch.mm(a, b)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - start

    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)  # one core: no waiting on a descheduled worker thread
    try:
        return _measure(dev, dtype, timed, budget_s, max_size)
    finally:
        torch.set_num_threads(threads)


def _measure(
    dev: torch.device,
    dtype: torch.dtype,
    timed: Callable[[torch.Tensor, torch.Tensor], float],
    budget_s: float,
    max_size: int,
) -> dict[str, float]:
    size = 64
    generator = torch.Generator(device="cpu").manual_seed(0)
    while True:
        a = torch.randn(size, size, generator=generator).to(dev, dtype)
        b = torch.randn(size, size, generator=generator).to(dev, dtype)
        timed(a, b)  # warm-up: kernel selection, allocation
        once = min(timed(a, b) for _ in range(3))
        if once >= budget_s / 20 or size >= max_size:
            break
        size *= 2
    times = [once]
    deadline = time.perf_counter() + budget_s
    while time.perf_counter() < deadline and len(times) < 200:
        times.append(timed(a, b))
    # the fastest call: what the hardware does when nothing else runs (a shared machine's
    # other jobs only ever make a call slower)
    seconds = min(times)
    return {"gflops": 2 * size**3 / seconds / 1e9, "size": float(size)}


def diagnose(*, measure: bool = True, budget_s: float = 0.25) -> dict[str, Any]:
    """Everything ``mixprec doctor`` reports, as a JSON-ready dict."""
    features = cpu_features()
    devices: list[dict[str, Any]] = []
    cpu: dict[str, Any] = {
        "name": cpu_name(),
        "cores": torch.get_num_threads(),
        "features": dataclasses.asdict(features),
    }
    targets: list[tuple[str, torch.device, dict[str, Any]]] = [("cpu", torch.device("cpu"), cpu)]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(index)
            info = {
                "name": torch.cuda.get_device_name(index),
                "capability": f"{major}.{minor}",
            }
            targets.append((f"cuda:{index}", torch.device("cuda", index), info))
    for name, device, info in targets:
        native = {dtype_name(d): is_native(d, device) for d in _DTYPES[1:]}
        gemm = (
            {dtype_name(d): gemm_gflops(d, device, budget_s=budget_s) for d in _DTYPES}
            if measure
            else {}
        )
        level, low, reason = recommend(device, None, quiet=True)
        devices.append(
            {
                "device": name,
                **info,
                "native": native,
                "gemm": gemm,
                "recommended": {"level": level.value, "dtype": dtype_name(low), "reason": reason},
            }
        )
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "devices": devices,
    }


def render(report: dict[str, Any]) -> str:
    """The report as plain text (under 100 columns)."""
    lines = [f"torch {report['torch']}, Python {report['python']}, {report['platform']}"]
    for device in report["devices"]:
        lines.append("")
        if device["device"] == "cpu":
            f = device["features"]
            lines.append(f"cpu: {device['name']} ({device['cores']} threads, {f['arch']})")
            flags = [
                name
                for name in ("avx2", "avx512", "avx512_bf16", "amx_tile", "amx_fp16", "arm_bf16")
                if f[name]
            ]
            lines.append(f"  PyTorch kernels: {f['capability']}; ISA: {', '.join(flags) or '-'}")
            lines.append(
                f"  oneDNN may use bfloat16: {_yes(f['onednn_bf16'])}, "
                f"float16: {_yes(f['onednn_fp16'])}"
            )
        else:
            lines.append(f"{device['device']}: {device['name']} (compute {device['capability']})")
        native = ", ".join(f"{name} {_yes(ok)}" for name, ok in device["native"].items())
        lines.append(f"  native: {native}")
        gemm = device["gemm"]
        per_core = " per core" if device["device"] == "cpu" else ""
        if gemm:
            base = gemm["float32"]["gflops"]
            for name, result in gemm.items():
                lines.append(
                    f"  matmul {name:<9} {result['gflops']:9.1f} GFLOP/s{per_core} "
                    f"({result['gflops'] / base:6.2f}x float32, n={int(result['size'])})"
                )
        rec = device["recommended"]
        lines.append(f"  recommended: level {rec['level']!r}, dtype {rec['dtype']}")
        lines.append(f"    why: {rec['reason']}")
    return "\n".join(lines)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def run_doctor(as_json: bool, measure: bool = True) -> str:
    """The text ``mixprec doctor`` prints."""
    report = diagnose(measure=measure)
    return dumps(report) if as_json else render(report)
