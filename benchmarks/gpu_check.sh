#!/usr/bin/env bash
# The CUDA check: every test marked `cuda`, then host time per call on the GPU (eager and
# compiled) against torch.autocast("cuda"), and a short `mixprec bench --device cuda`.
#
# Runs on a machine with its own CUDA build of torch (2.11 or later) and no network: it
# installs nothing and runs mixprec from this source tree (PYTHONPATH=src). It needs pytest
# (pytest-xdist if there, transformers for the real architectures, torchao for native fp8,
# rich for the bench); it first checks that torch sees a GPU. About 6 minutes on an H200.
#
#   bash benchmarks/gpu_check.sh            # from the repository root
#   PYTHON=python3.11 OUT=gpu-check bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
OUT="${OUT:-gpu-check}"
mkdir -p "$OUT"

"$PYTHON" - <<'PY' | tee "$OUT/machine.txt" || exit 1
import importlib.util, os, platform, sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device; nothing to check")
index = torch.cuda.current_device()
print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"{torch.cuda.get_device_name(index)} (capability {torch.cuda.get_device_capability(index)}), "
      f"Python {platform.python_version()}, {os.cpu_count()} CPUs: {platform.processor() or '?'}")
for name in ("transformers", "torchao", "lightning", "accelerate", "xdist"):
    spec = importlib.util.find_spec(name)
    print(f"  {name}: {'missing' if spec is None else __import__(name).__dict__.get('__version__', 'present')}")
PY

start=$SECONDS
workers=()
"$PYTHON" -c "import xdist" 2>/dev/null && workers=(-n 8)
# every CUDA test: the autocast level's decisions vs torch.autocast("cuda") op by op, every
# level on real architectures against float32 and autocast, the exact plan on the CUDA
# lists, training, compile, fp16 O2 with dynamic scaling, the step's host-sync budget, fp8
timeout 200 "$PYTHON" -m pytest -q -m cuda -p no:cacheprovider "${workers[@]}" tests/ \
    -o addopts="-ra --strict-markers" --junitxml="$OUT/cuda-tests.xml" 2>&1 \
    | tee "$OUT/cuda-tests.txt" | tail -40
echo "gpu_check: tests done at $((SECONDS - start)) s"
# host time per call on the GPU (tiny models: launch-bound), eager, then compiled (torch
# 2.13 or later: docs/compile.md), then a training step
{
    (cd benchmarks && timeout 90 "$PYTHON" bench_overhead.py --device cuda --rounds 30 --casts)
    (cd benchmarks && timeout 45 "$PYTHON" bench_overhead.py --device cuda --dtype fp16 \
        --rounds 20 --models gpt2,resnet)
    if "$PYTHON" -c "import sys, torch; sys.exit(torch.__version__ < '2.13')"; then
        (cd benchmarks && timeout 120 "$PYTHON" bench_compile.py --device cuda --models gpt2 \
            --rounds 20)
    fi
    if [ -f benchmarks/bench_step.py ]; then
        (cd benchmarks && timeout 60 "$PYTHON" bench_step.py --device cuda)
    fi
} 2>&1 | grep -v -i -E "warn|transformers\]" | tee "$OUT/host-time.txt"
# a short benchmark at full size: the MLP and the CNN, bf16 and fp16
for dtype in bf16 fp16; do
    timeout 35 "$PYTHON" -m mixprec.cli bench --device cuda --dtype "$dtype" --models mlp,cnn \
        --repeats 10 --warmup 3 2>&1 | tee "$OUT/bench-$dtype.txt"
done
echo "gpu_check: done in $((SECONDS - start)) s; results in $OUT/"
