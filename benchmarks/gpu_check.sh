#!/usr/bin/env bash
# The CUDA check: every test marked `cuda`, then a short `mixprec bench --device cuda`.
#
# Runs on a machine with its own CUDA build of torch (2.11 or later) and no network: it
# installs nothing and runs mixprec from this source tree (PYTHONPATH=src). It needs pytest
# (and rich for the bench); it first checks that torch sees a GPU. Under 5 minutes.
#
#   bash benchmarks/gpu_check.sh            # from the repository root
#   PYTHON=python3.11 bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-gpu-check}"
mkdir -p "$OUT"

"$PYTHON" - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device; nothing to check")
index = torch.cuda.current_device()
print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"{torch.cuda.get_device_name(index)} (capability {torch.cuda.get_device_capability(index)})")
PY

start=$SECONDS
# every CUDA test: autocast-level decisions vs torch.autocast("cuda"), fp16 O2 training,
# the step's host-sync budget, bench --device cuda
timeout 240 "$PYTHON" -m pytest -q -m cuda -p no:cacheprovider tests/ \
    -o addopts="-ra --strict-markers" --junitxml="$OUT/cuda-tests.xml" | tee "$OUT/cuda-tests.txt"
# a short benchmark: the MLP and the CNN at full size, bf16 and fp16
for dtype in bf16 fp16; do
    timeout 120 "$PYTHON" -m mixprec.cli bench --device cuda --dtype "$dtype" --models mlp,cnn \
        --repeats 10 --warmup 3 --out "$OUT/bench-$dtype.json" | tee "$OUT/bench-$dtype.txt"
done
echo "gpu_check: done in $((SECONDS - start)) s; results in $OUT/ (copy the tables into benchmarks/RESULTS.md)"
