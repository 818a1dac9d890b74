"""``mixprec demo``: LeNet-5 on scikit-learn's digits, trained once per level.

Every run starts from the same initial weights and sees the same batches in the same
order; only the level changes. On a CPU without native support for a run's dtype (no
bfloat16 dot-product instructions; float16 on nearly every CPU) that run is emulated
(``emulate=True``: float32 kernels on rounded inputs, rounded results), so the demo is
fast everywhere; its bytes saved for backward are measured on one native step, as a
native run would keep them. Each run is a :func:`mixprec.build_train_network` step
with Adam. The table says what each level costs and buys; the PNG shows the loss curves
and, for the float16 run, the dynamic loss scale over the steps.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich import box
from rich.console import Console
from rich.table import Table
from torch import nn

import mixprec
from mixprec.cli.data import Digits, batch_order, load_digits
from mixprec.cli.demo_config import LEVEL_CHOICES, DemoConfig, config_from_args, parse_levels
from mixprec.cli.measure import format_bytes, median_ms
from mixprec.cli.models import lenet5
from mixprec.cli.terminal import ProgressLine, dumps, warning_line
from mixprec.inspect import CastCounter, SavedBytes
from mixprec.policy.hardware import is_native

__all__ = [
    "COLUMNS",
    "LEVEL_CHOICES",
    "DemoConfig",
    "RunResult",
    "RunSpec",
    "config_from_args",
    "parse_levels",
    "run_demo",
]

#: The table's column headers.
COLUMNS: tuple[str, ...] = (
    "level",
    "dtype",
    "accuracy",
    "loss",
    "ms/step",
    "time vs O0",
    "saved/step",
    "casts",
    "skipped",
    "scale",
)
PNG_NAME = "mixprec-demo.png"
JSON_NAME = "mixprec-demo.json"
#: Points of test accuracy every level should be within of O0's.
TOLERANCE = 0.5
_WARMUP_STEPS = 5


@dataclass(frozen=True)
class RunSpec:
    """One training run: a table row."""

    name: str
    level: str
    dtype: torch.dtype | None
    fp16_scaling: bool = False
    emulate: bool = False


@dataclass
class RunResult:
    """What one run measured."""

    name: str
    level: str
    dtype: str
    accuracy: float
    final_loss: float
    step_ms: float
    saved_bytes: int
    casts: int
    skipped_steps: int
    loss_scale: float | None
    steps: int
    emulated: bool = False
    losses: list[float] = field(default_factory=list, repr=False)
    scales: list[float] = field(default_factory=list, repr=False)


def _spec(name: str, dtype: torch.dtype, emulate: bool | None = None) -> RunSpec:
    """One run; ``emulate=None`` emulates where the CPU runs the dtype slowly."""
    if name == "O0":
        return RunSpec("O0", "O0", None)
    if name == "auto":  # the recommendation chooses its own dtype (O0 where none is native)
        return RunSpec("auto", "auto", None, emulate=bool(emulate))
    low = torch.float16 if name == "O2-fp16" else dtype
    emulated = not is_native(low, "cpu") if emulate is None else emulate
    if name == "O2-fp16":
        return RunSpec("O2-fp16", "O2", torch.float16, fp16_scaling=True, emulate=emulated)
    return RunSpec(name, name, dtype, emulate=emulated)


def _native_counts(
    spec: RunSpec, config: DemoConfig, x: torch.Tensor, y: torch.Tensor
) -> tuple[int, int]:
    """What one native step of ``spec`` keeps for backward and the casts of its forward
    (an emulated step keeps float32 copies of its GEMM inputs, and casts them)."""
    torch.manual_seed(config.seed)
    model = lenet5()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the slow-dtype warning: one step is run natively
        probe = mixprec.build_train_network(
            model,
            torch.optim.Adam(model.parameters(), lr=config.lr),
            nn.CrossEntropyLoss(),
            level=spec.level,
            dtype=spec.dtype,
        )
    exclude = [*model.parameters(), *model.buffers()]
    exclude += [*probe.network.parameters(), *probe.network.buffers()]
    with SavedBytes(exclude=exclude) as saved:
        probe(x, y)
    return saved.total, _casts_per_forward(probe.network, x)


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "float32" if dtype is None else str(dtype).removeprefix("torch.")


def _accuracy(network: nn.Module, data: Digits) -> float:
    network.eval()
    try:
        with torch.no_grad():
            logits = network(data.x_test)
    finally:
        network.train()
    return float((logits.argmax(dim=1) == data.y_test).double().mean()) * 100


def _casts_per_forward(network: nn.Module, inputs: torch.Tensor) -> int:
    """Casts in one training-mode forward (gradients on, as in a training step)."""
    with CastCounter() as counter:
        network(inputs)
    return counter.total


def train_one(
    spec: RunSpec,
    config: DemoConfig,
    data: Digits,
    batches: Sequence[torch.Tensor],
    progress: ProgressLine | None = None,
    label: str = "",
) -> RunResult:
    """Train LeNet-5 at one level on ``batches`` and measure it; ``progress`` shows
    ``label`` and the step."""
    torch.manual_seed(config.seed)
    model = lenet5()
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    options: dict[str, Any] = {"dtype": spec.dtype, "emulate": spec.emulate}
    if spec.fp16_scaling:
        # A short window so that the demo's few hundred steps show the scale move both ways.
        options["loss_scale_manager"] = mixprec.DynamicLossScaleManager(
            init_loss_scale=2.0**16, scale_factor=2, scale_window=100
        )
    step = mixprec.build_train_network(
        model, optimizer, nn.CrossEntropyLoss(), level=spec.level, **options
    )
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=len(batches))
    exclude = [*model.parameters(), *model.buffers()]
    exclude += [*step.network.parameters(), *step.network.buffers()]
    losses: list[float] = []
    scales: list[float] = []
    times: list[float] = []
    saved_bytes = 0
    casts: int | None = None
    for index, batch in enumerate(batches):
        x, y = data.x_train[batch], data.y_train[batch]
        if index == 0 and spec.emulate:
            saved_bytes, casts = _native_counts(spec, config, x, y)
            loss = step(x, y)
        elif index == 0:  # a warm-up step anyway: measure what it keeps for backward
            with SavedBytes(exclude=exclude) as saved:
                loss = step(x, y)
            saved_bytes = saved.total
        else:
            start = time.perf_counter()
            loss = step(x, y)
            elapsed = time.perf_counter() - start
            if index >= _WARMUP_STEPS:
                times.append(elapsed)
        with warnings.catch_warnings():  # a skipped first step is no mistake here
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            schedule.step()
        losses.append(float(loss))
        scales.append(float(step.loss_scale))
        if progress is not None:
            progress.update(f"{label}{spec.name}: step {index + 1}/{len(batches)}")
    tail = losses[-max(1, min(len(losses), len(data.y_train) // config.batch_size)) :]
    low = step.dtype
    return RunResult(
        name=spec.name,
        level=str(step.level),
        dtype=_dtype_name(low),
        accuracy=_accuracy(step.network, data),
        final_loss=sum(tail) / len(tail),
        step_ms=median_ms(times),
        saved_bytes=saved_bytes,
        casts=_casts_per_forward(step.network, data.x_train[batches[0]])
        if casts is None
        else casts,
        skipped_steps=int(step.skipped_steps),
        loss_scale=float(step.loss_scale) if spec.fp16_scaling or low == torch.float16 else None,
        steps=len(batches),
        emulated=spec.emulate and str(step.level) != "O0",
        losses=losses,
        scales=scales,
    )


def _table(results: Sequence[RunResult]) -> Table:
    table = Table(
        title="mixprec demo: LeNet-5 on scikit-learn digits",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    for index, column in enumerate(COLUMNS):
        table.add_column(column, justify="left" if index < 2 else "right", no_wrap=True)
    base = next((r.step_ms for r in results if r.name == "O0"), None)
    for r in results:
        name = r.name if r.name in (r.level, "O2-fp16") else f"{r.name} -> {r.level}"
        ratio = f"{r.step_ms / base:.2f}x" if base else "-"
        table.add_row(
            name,
            f"{r.dtype}*" if r.emulated else r.dtype,
            f"{r.accuracy:.2f}%",
            f"{r.final_loss:.4f}",
            f"{r.step_ms:.2f}",
            ratio,
            format_bytes(r.saved_bytes),
            str(r.casts),
            str(r.skipped_steps),
            "-" if r.loss_scale is None else f"{r.loss_scale:g}",
        )
    return table


def _moving_average(values: Sequence[float], window: int) -> list[float]:
    out: list[float] = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        out.append(total / min(index + 1, window))
    return out


def write_png(results: Sequence[RunResult], path: Path) -> Path:
    """Loss curves per level (left) and the fp16 run's loss scale over steps (right)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4.5), dpi=100)
    FigureCanvasAgg(figure)
    losses, scales = figure.subplots(1, 2)
    styles = ("-", "--", ":", "-.")  # levels that compute alike overlap: keep each visible
    for index, r in enumerate(results):
        window = max(1, min(20, len(r.losses) // 10))
        losses.plot(
            _moving_average(r.losses, window),
            linestyle=styles[index % len(styles)],
            label=f"{r.name} ({r.accuracy:.2f}%)",
        )
    losses.set(title="training loss (moving average)", xlabel="step", ylabel="loss", yscale="log")
    losses.legend(fontsize=8)
    scaled = [r for r in results if r.loss_scale is not None]
    for r in scaled:
        scales.step(range(len(r.scales)), r.scales, where="post", label=r.name)
        skipped = [i for i in range(1, len(r.scales)) if r.scales[i] < r.scales[i - 1]]
        scales.plot(skipped, [r.scales[i] for i in skipped], "rx", label="overflow: step skipped")
    if scaled:
        scales.set(title="loss scale (float16 run)", xlabel="step", ylabel="loss scale")
        scales.set_yscale("log", base=2)
        scales.legend(fontsize=8)
    else:
        scales.set_axis_off()
        scales.text(0.5, 0.5, "no float16 run", ha="center", va="center")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return path


def run_demo(config: DemoConfig, console: Console) -> list[RunResult]:
    """Train every requested level, print the table, write the PNG and a JSON summary."""
    start = time.perf_counter()
    data = load_digits(config.seed)
    batches = batch_order(len(data.y_train), config.batch_size, config.epochs, config.seed)
    if config.steps_limit is not None:
        batches = batches[: config.steps_limit]
    specs = [_spec(name, config.dtype, config.emulate) for name in config.levels]
    earlier = [name for name in (PNG_NAME, JSON_NAME) if (config.out / name).exists()]
    if earlier:
        warning_line(
            f"demo: {config.out} holds an earlier run's {' and '.join(earlier)}; this run "
            "replaces them (--out DIR writes elsewhere)"
        )
    console.print(
        f"LeNet-5 on {len(data.y_train)} train / {len(data.y_test)} test digits: "
        f"{len(batches)} steps of {config.batch_size} per run, Adam lr {config.lr:g}, "
        f"seed {config.seed}, {torch.get_num_threads()} threads"
    )
    results: list[RunResult] = []
    with ProgressLine() as progress:
        for index, spec in enumerate(specs):
            label = f"mixprec demo: run {index + 1}/{len(specs)}, "
            results.append(train_one(spec, config, data, batches, progress, label))
    console.print(_table(results))
    console.print(_summary(results))
    png = write_png(results, config.out / PNG_NAME)
    summary = [
        {k: v for k, v in asdict(r).items() if k not in ("losses", "scales")} for r in results
    ]
    (config.out / JSON_NAME).write_text(dumps(summary) + "\n", encoding="utf-8")
    console.print(
        f"wrote {png} and {config.out / JSON_NAME} in {time.perf_counter() - start:.1f} s"
    )
    return results


def _summary(results: Sequence[RunResult]) -> str:
    base = next((r for r in results if r.name == "O0"), None)
    notes = [
        "ms/step: median over the steps after warm-up; time vs O0: ms/step / O0's (above 1x is "
        "slower)\ncasts counted in one training forward"
    ]
    if any(r.emulated for r in results):
        notes.append(
            "*: emulated (float32 kernels on rounded inputs, results rounded): this CPU has no "
            "native\nsupport for the dtype; saved/step and casts are what a native step has"
        )
    if base is None or len(results) == 1:
        return "\n".join(notes)
    off = [r for r in results if abs(r.accuracy - base.accuracy) > TOLERANCE]
    if off:
        detail = ", ".join(f"{r.name} {r.accuracy - base.accuracy:+.2f}" for r in off)
        notes.insert(0, f"outside {TOLERANCE} points of O0's {base.accuracy:.2f}%: {detail}")
    else:
        notes.insert(0, f"every level within {TOLERANCE} points of O0's {base.accuracy:.2f}%")
    return "\n".join(notes)
