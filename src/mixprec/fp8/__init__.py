"""fp8 training, checked on any machine.

The GEMMs of chosen linear layers run in fp8 (e4m3/e5m2) with dynamic scaling, following
one of torchao's recipes (:class:`~mixprec.fp8.recipes.Fp8Recipe`: ``tensorwise``,
``rowwise``, ``rowwise_with_gw_hp``), orthogonal to the mixed-precision level: everything
else runs as the level says. Natively through torchao on a GPU with fp8; emulated anywhere,
bit-identical to torchao's ``emulate=True``.

* :mod:`~mixprec.fp8.recipes`: the recipes, as the cast of every operand of the three GEMMs;
* :mod:`~mixprec.fp8.scaling`: amax, scale, cast, dequantize, and a cast's statistics;
* :mod:`~mixprec.fp8.linear`: :class:`Fp8Linear`, the emulated layer;
* :mod:`~mixprec.fp8.swap`: :func:`apply_fp8`, the module swap and its default filter;
* :mod:`~mixprec.fp8.stats`: :func:`fp8_stats`, per-layer statistics on request;
* :mod:`~mixprec.fp8.report`: :func:`fp8_report` and :func:`weight_report`, the layers fp8
  hurts (also in :func:`mixprec.lint` and :func:`mixprec.find_overflow` with ``fp8=``).

Example:
    >>> net = mixprec.auto_mixed_precision(model, "O2", "bf16", fp8="rowwise", emulate=True)
    >>> with mixprec.fp8.fp8_stats(net) as stats:
    ...     net(x).sum().backward()
    >>> print(stats.table(stats.worst(3)))
"""

from mixprec.fp8.linear import Fp8Linear
from mixprec.fp8.recipes import Fp8Config, Fp8Recipe, Gemm
from mixprec.fp8.report import Fp8Report, fp8_report, weight_report
from mixprec.fp8.stats import Fp8Stats, Fp8StatsRow, fp8_stats
from mixprec.fp8.swap import Fp8Filter, apply_fp8, default_fp8_filter, fp8_layers

__all__ = [
    "Fp8Config",
    "Fp8Filter",
    "Fp8Linear",
    "Fp8Recipe",
    "Fp8Report",
    "Fp8Stats",
    "Fp8StatsRow",
    "Gemm",
    "apply_fp8",
    "default_fp8_filter",
    "fp8_layers",
    "fp8_report",
    "fp8_stats",
    "weight_report",
]
