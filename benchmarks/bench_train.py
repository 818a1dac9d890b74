"""mixprec against torch.autocast and pure low precision: training step and inference.

A thin caller of ``mixprec bench`` (:mod:`mixprec.cli.bench`), whose flags it takes;
``RESULTS.md`` holds the last results.

Usage::

    python benchmarks/bench_train.py                      # full size, about a minute on 2 cores
    python benchmarks/bench_train.py --quick              # tiny shapes, seconds
    python benchmarks/bench_train.py --out results.json   # also write JSON
"""

from __future__ import annotations

import sys

from mixprec.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
