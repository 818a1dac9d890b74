"""``mixprec bench``: mixprec against ``torch.autocast`` and pure low precision.

For each model (an MLP, a CNN with BatchNorm, a transformer encoder) every variant gets
a copy of the same initial weights and its own SGD optimizer:

- ``fp32``: the model as it is;
- ``torch.autocast``: ``torch.autocast`` around forward and loss, ``torch.amp.GradScaler``
  (enabled for float16 only, as usual: bfloat16 needs no loss scaling);
- ``pure``: ``model.to(dtype)``, inputs cast each step, the loss taken in float32;
- ``mixprec O1/O2/O3/autocast``: :func:`mixprec.build_train_network` for the training
  step, :func:`mixprec.auto_mixed_precision` under ``torch.no_grad()`` for inference.

With ``emulate`` the mixprec levels run emulated (``emulate=True``) and are timed against
``fp32`` alone (the native low-precision baselines are left out: on a CPU without native
support they are what emulation avoids). ``device="cuda"`` runs everything on the GPU,
with ``torch.autocast("cuda")`` and ``GradScaler("cuda")`` as the baseline.

Timings are medians over repeated calls after warm-up, with all variants of a model
interleaved round by round (in a rotating order) so machine noise hits them alike.
Ratios are speedups: ``t(reference) / t(variant)``, above 1 is faster. Casts are counted
in one training-mode forward (gradients on) and in one inference call after a first one
(steady state); bytes saved for backward in one training step (see
:mod:`mixprec.cli.measure`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import mixprec
from mixprec.cli import models
from mixprec.cli.measure import median_ms
from mixprec.inspect import CastCounter, SavedBytes
from mixprec.policy.dtypes import resolve_dtype

__all__ = ["BenchSettings", "Case", "Result", "cases", "run_bench", "settings_from_args"]

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]
MIXPREC_LEVELS: tuple[str, ...] = ("O1", "O2", "O3", "autocast")
AUTOCAST = "torch.autocast"
PURE = "pure"
VARIANTS: tuple[str, ...] = ("fp32", AUTOCAST, PURE, *(f"mixprec {lv}" for lv in MIXPREC_LEVELS))


@dataclass(frozen=True)
class Case:
    """A benchmark model: a factory, a batch maker and a description."""

    name: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], Batch]
    description: str


@dataclass(frozen=True)
class BenchSettings:
    """How much to measure."""

    dtype: torch.dtype = torch.bfloat16
    warmup: int = 3
    repeats: int = 15
    quick: bool = False
    cases: tuple[str, ...] = ("mlp", "cnn", "transformer")
    lr: float = 1e-3
    emulate: bool = False
    device: str = "cpu"

    @property
    def variants(self) -> tuple[str, ...]:
        """The variants measured: all, or float32 and the emulated mixprec levels."""
        return tuple(v for v in VARIANTS if not self.emulate or v not in (AUTOCAST, PURE))


@dataclass
class Result:
    """One variant of one model."""

    case: str
    variant: str
    train_ms: float
    infer_ms: float
    casts_train: int
    casts_infer: int
    saved_bytes: int
    ratios: dict[str, float] = field(default_factory=dict)


def cases(quick: bool) -> dict[str, Case]:
    """The benchmark models, full size or (``quick``) tiny."""
    if quick:
        b_mlp, mlp_out, b_cnn, side, b_tr, length, vocab = 8, 32, 4, 8, 2, 8, 50

        def mlp() -> nn.Module:
            return models.MLP((32, 64, 64, 32))

        def cnn() -> nn.Module:
            return models.ConvNet((4, 8))

        def tr() -> nn.Module:
            return models.TransformerEncoder(vocab=50, width=16, depth=1, heads=2, max_length=8)

    else:
        b_mlp, mlp_out, b_cnn, side, b_tr, length, vocab = 256, 1024, 32, 32, 8, 128, 1000
        mlp, cnn, tr = models.mlp, models.cnn, models.transformer

    def mlp_batch(g: torch.Generator) -> Batch:
        x = torch.randn(b_mlp, mlp_out, generator=g)
        return (x,), torch.randint(0, mlp_out, (b_mlp,), generator=g)

    def cnn_batch(g: torch.Generator) -> Batch:
        x = torch.randn(b_cnn, 3, side, side, generator=g)
        return (x,), torch.randint(0, 10, (b_cnn,), generator=g)

    def tr_batch(g: torch.Generator) -> Batch:
        tokens = torch.randint(0, vocab, (b_tr, length), generator=g)
        return (tokens,), torch.randint(0, 10, (b_tr,), generator=g)

    return {
        "mlp": Case("mlp", mlp, mlp_batch, f"MLP {mlp_out}-4x-4x-{mlp_out}, batch {b_mlp}"),
        "cnn": Case("cnn", cnn, cnn_batch, f"CNN+BatchNorm 3x{side}x{side}, batch {b_cnn}"),
        "transformer": Case(
            "transformer", tr, tr_batch, f"transformer encoder, {b_tr}x{length} tokens"
        ),
    }


def _low(values: Sequence[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return tuple(v.to(dtype) if v.is_floating_point() else v for v in values)


@dataclass
class _Variant:
    """The closures that run one variant, and what its memory excludes."""

    train: Callable[[], object]
    forward: Callable[[], object]  # one training-mode forward (for counting casts)
    infer: Callable[[], object]
    owned: list[torch.Tensor]  # Parameters and buffers: not counted as saved memory


def _build(name: str, model: nn.Module, batch: Batch, s: BenchSettings) -> _Variant:
    inputs, label = batch
    inputs = tuple(t.to(s.device) for t in inputs)
    label = label.to(s.device)
    loss_fn = nn.CrossEntropyLoss()
    trained = copy.deepcopy(model)
    served = copy.deepcopy(model).eval()
    optimizer = torch.optim.SGD(trained.parameters(), lr=s.lr, momentum=0.9)
    owned = [*trained.parameters(), *trained.buffers(), *served.parameters(), *served.buffers()]

    def plain_train() -> object:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(trained(*inputs), label)
        loss.backward()
        optimizer.step()
        return loss

    if name == "fp32":
        return _Variant(plain_train, lambda: trained(*inputs), lambda: served(*inputs), owned)
    if name == AUTOCAST:
        scaler = torch.amp.GradScaler(s.device, enabled=s.dtype == torch.float16)

        def autocast_train() -> object:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(s.device, dtype=s.dtype):
                loss = loss_fn(trained(*inputs), label)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            return loss

        def autocast_forward(net: nn.Module) -> object:
            with torch.autocast(s.device, dtype=s.dtype):
                return net(*inputs)

        return _Variant(
            autocast_train,
            lambda: autocast_forward(trained),
            lambda: autocast_forward(served),
            owned,
        )
    if name == PURE:
        trained.to(s.dtype)
        served.to(s.dtype)
        optimizer = torch.optim.SGD(trained.parameters(), lr=s.lr, momentum=0.9)

        def pure_train() -> object:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(trained(*_low(inputs, s.dtype)).float(), label)
            loss.backward()
            optimizer.step()
            return loss

        return _Variant(
            pure_train,
            lambda: trained(*_low(inputs, s.dtype)),
            lambda: served(*_low(inputs, s.dtype)),
            owned,
        )
    level = name.removeprefix("mixprec ")
    step = mixprec.build_train_network(
        trained, optimizer, loss_fn, level=level, dtype=s.dtype, emulate=s.emulate
    )
    converted = mixprec.auto_mixed_precision(served, level, s.dtype, emulate=s.emulate)
    owned += [*step.network.parameters(), *step.network.buffers()]
    return _Variant(
        lambda: step(*inputs, label),
        lambda: step.network(*inputs),
        lambda: converted(*inputs),
        owned,
    )


def _timed(fn: Callable[[], object], device: str = "cpu") -> float:
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _interleaved(fns: dict[str, Callable[[], object]], s: BenchSettings) -> dict[str, float]:
    """Median milliseconds per function, all timed round by round in a rotating order."""
    names = list(fns)
    for _ in range(s.warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(s.repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(_timed(fns[name], s.device))
    return {name: median_ms(values) for name, values in times.items()}


def _count(fn: Callable[[], object]) -> int:
    with CastCounter() as counter:
        fn()
    return counter.total


def bench_case(case: Case, s: BenchSettings) -> list[Result]:
    """Measure every variant of one model."""
    torch.manual_seed(0)
    model = case.make_model().to(s.device)
    batch = case.make_batch(torch.Generator().manual_seed(0))
    variants = {name: _build(name, model, batch, s) for name in s.variants}
    saved: dict[str, int] = {}
    for name, v in variants.items():
        v.train()  # a first step outside the timing: compiles nothing, allocates everything
        with SavedBytes(exclude=v.owned) as memory:
            v.train()
        saved[name] = memory.total
    casts_train = {name: _count(v.forward) for name, v in variants.items()}
    with torch.no_grad():
        for v in variants.values():
            v.infer()  # steady state: converted O2/O3 models reuse their weight casts
        casts_infer = {name: _count(v.infer) for name, v in variants.items()}
    train = _interleaved({name: v.train for name, v in variants.items()}, s)
    with torch.no_grad():
        infer = _interleaved({name: v.infer for name, v in variants.items()}, s)
    results = []
    nan = float("nan")
    for name in s.variants:
        ratios = {
            "train_vs_autocast": train[AUTOCAST] / train[name] if AUTOCAST in train else nan,
            "train_vs_pure": train[PURE] / train[name] if PURE in train else nan,
            "infer_vs_autocast": infer[AUTOCAST] / infer[name] if AUTOCAST in infer else nan,
            "infer_vs_pure": infer[PURE] / infer[name] if PURE in infer else nan,
            "train_vs_fp32": train["fp32"] / train[name],
            "saved_vs_fp32": saved[name] / saved["fp32"] if saved["fp32"] else nan,
        }
        results.append(
            Result(
                case.name,
                name,
                train[name],
                infer[name],
                casts_train[name],
                casts_infer[name],
                saved[name],
                ratios,
            )
        )
    return results


def _check(case: str, goal: str, value: float, at_least: bool, bound: float) -> dict[str, Any]:
    # a hair of tolerance: 5.5 MiB / 10 MiB is 0.55, whatever the float rounding says
    met = value >= bound - 1e-9 if at_least else value <= bound + 1e-9
    target = f"{'>=' if at_least else '<='} {bound:g}" + ("" if isinstance(value, int) else "x")
    return {"case": case, "goal": goal, "target": target, "value": value, "met": met}


def goals(results: Sequence[Result]) -> list[dict[str, Any]]:
    """mixprec's performance goals, checked per model: name, target, measured value, met."""
    checks: list[dict[str, Any]] = []
    by = {(r.case, r.variant): r for r in results}
    for case in dict.fromkeys(r.case for r in results):
        if (case, AUTOCAST) not in by:  # emulated: the time against float32 is the goal
            o2 = by[(case, "mixprec O2")]
            checks.append(
                _check(
                    case,
                    "O2 emulated train time vs fp32",
                    1 / o2.ratios["train_vs_fp32"],
                    False,
                    1.3,
                )
            )
            continue
        o1, o2, o3 = (by[(case, f"mixprec {lv}")] for lv in ("O1", "O2", "O3"))
        ac = by[(case, AUTOCAST)]
        checks += [
            _check(
                case, "O2 train speed vs torch.autocast", o2.ratios["train_vs_autocast"], True, 1.3
            ),
            _check(case, "O2 train time vs pure", 1 / o2.ratios["train_vs_pure"], False, 1.15),
            _check(
                case,
                "O2 inference speed vs torch.autocast",
                o2.ratios["infer_vs_autocast"],
                True,
                1.3,
            ),
            _check(
                case,
                "O3 inference speed vs torch.autocast",
                o3.ratios["infer_vs_autocast"],
                True,
                1.3,
            ),
            _check(case, "O2 saved for backward vs fp32", o2.ratios["saved_vs_fp32"], False, 0.55),
            _check(
                case,
                "O1 casts per forward vs torch.autocast's",
                o1.casts_train,
                False,
                ac.casts_train,
            ),
        ]
    return checks


def run_bench(
    s: BenchSettings, progress: Callable[[str], None] = lambda _: None
) -> tuple[list[Result], dict[str, str]]:
    """Benchmark the selected cases; returns the results and each case's description."""
    table = cases(s.quick)
    results: list[Result] = []
    described: dict[str, str] = {}
    for name in s.cases:
        case = table[name]
        progress(f"{case.name}: {case.description}")
        described[case.name] = case.description
        results += bench_case(case, s)
    return results, described


def settings_from_args(args: Any) -> BenchSettings:
    """:class:`BenchSettings` from the parsed command line (validating each flag)."""
    known = list(cases(quick=True))
    chosen = (
        tuple(known) if args.models is None else tuple(m.strip() for m in args.models.split(","))
    )
    if not chosen or any(m not in known for m in chosen):
        raise ValueError(f"--models must name some of {', '.join(known)}; got {args.models!r}")
    defaults = {"repeats": 2, "warmup": 1} if args.quick else {"repeats": 15, "warmup": 3}
    counts: dict[str, int] = {}
    for name, minimum in (("repeats", 1), ("warmup", 0)):
        value = getattr(args, name)
        if value is not None and value < minimum:
            raise ValueError(f"--{name} must be >= {minimum}; got {value!r}")
        counts[name] = defaults[name] if value is None else value
    try:
        dtype = resolve_dtype(args.dtype)
    except ValueError as error:
        raise ValueError(f"--dtype: {error}") from error
    device = getattr(args, "device", "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda; got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here")
    emulate = bool(getattr(args, "emulate", False))
    return BenchSettings(
        dtype=dtype, quick=args.quick, cases=chosen, emulate=emulate, device=device, **counts
    )
