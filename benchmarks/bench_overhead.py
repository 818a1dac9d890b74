"""Host time per forward (and forward+backward) of tiny models, every level vs torch.autocast.

The models are so small (4 layers, width 16, batch 1, 8 tokens) that compute is
negligible: what is timed is the host (Python and dispatcher) time per call, the regime a
GPU's launch-bound workloads see (small models, ``generate()`` decoding). Every column is
timed in interleaved rounds (one call of each per round, in an order shuffled each round)
and reported as the median, as a ratio to ``torch.autocast("cpu", torch.bfloat16)`` on the
original model;
"bf16 model" is the model with its parameters in bf16 and no autocast.

``--breakdown`` adds two diagnostic columns (forward only): "O3 precast", O3 with its
weights cast once up front (what O3 would cost if a weight's cast were free), and "O2 out
low", O2 with its root's output cast turned off (the output then stays low: what the
float32 output's cast costs, the rebuild of a transformers ``ModelOutput`` included).

``--casts`` adds a row per model: the cast kernels one forward of each column launches.

``--device cuda`` runs every column on the GPU (``torch.autocast("cuda", dtype)`` as the
base): each timed call starts on an idle GPU (a synchronize before it, outside the time)
and is timed until it returns, without waiting for the GPU, so what is timed is the host
time that a launch-bound GPU workload waits on. ``--dtype fp16`` times float16 columns.

Run: python benchmarks/bench_overhead.py [--quick] [--models gpt2,bert,t5,resnet] [--breakdown]
[--casts] [--device cuda] [--dtype bf16|fp16]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import mixprec as amp
from mixprec.convert.structure import forward_of

LEVELS = ("O1", "autocast", "O2", "O3")


class _Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + x)


class TinyResNet(nn.Module):
    """A ResNet-like CNN: stem, four residual blocks, pooling, a linear head."""

    def __init__(self, channels: int = 4, blocks: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.layers = nn.Sequential(*[_Block(channels) for _ in range(blocks)])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


def _transformers_model(name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    import transformers as tf

    ids = torch.randint(0, 64, (1, 8))
    if name == "gpt2":
        gpt2 = tf.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=4, n_head=2)
        return tf.GPT2LMHeadModel(gpt2), {"input_ids": ids}
    if name == "bert":
        bert = tf.BertConfig(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=4,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=32,
        )
        return tf.BertModel(bert), {"input_ids": ids}
    t5 = tf.T5Config(
        vocab_size=64,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=4,
        num_heads=2,
    )
    return tf.T5Model(t5), {"input_ids": ids, "decoder_input_ids": ids}


def build(name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A tiny model (random weights, dropout off) and its inputs."""
    torch.manual_seed(0)
    if name == "resnet":
        return TinyResNet(), {"x": torch.randn(1, 3, 8, 8)}
    model, inputs = _transformers_model(name)
    for module in model.modules():  # dropout off, but training mode (backward is timed)
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model, inputs


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        for item in out:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None  # type: ignore[return-value]


def _call(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return _first_tensor(model(**inputs))


def on_device(
    model: nn.Module, inputs: dict[str, torch.Tensor], device: str
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``model`` and ``inputs`` moved to ``device``."""
    return model.to(device), {k: v.to(device) for k, v in inputs.items()}


def callers(
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Callable[[], torch.Tensor]]:
    """One zero-argument call per column (the forward's first tensor output), on the
    device ``model`` is on."""
    device = next(model.parameters()).device.type

    def autocast_call() -> torch.Tensor:
        with torch.autocast(device, dtype):
            return _first_tensor(model(**inputs))

    low = copy.deepcopy(model).to(dtype)
    low_inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    found: dict[str, Callable[[], torch.Tensor]] = {
        "torch.autocast": autocast_call,
        "low model": lambda: _first_tensor(low(**low_inputs)),
    }
    for level in LEVELS:
        converted = amp.auto_mixed_precision(model, level, dtype)
        found[level] = functools.partial(_call, converted, inputs)
    return found


def time_rounds(
    calls: dict[str, Callable[[], torch.Tensor]],
    rounds: int,
    backward: bool,
    timed: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    idle: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """Median seconds per call of each, measured in interleaved rounds (one call of each
    per round, in an order shuffled each round; after three warm-up calls each; the rounds
    run inside ``timed()``; ``idle()`` runs before each
    call, outside its time: a GPU synchronize, so that each call starts on an idle GPU)."""
    grad = torch.enable_grad if backward else torch.no_grad

    def once(call: Callable[[], torch.Tensor]) -> float:
        idle()
        start = time.perf_counter()
        with grad():
            out = call()
            if backward:
                out.float().sum().backward()
        return time.perf_counter() - start

    for call in calls.values():  # warm up (first-call work, allocator)
        for _ in range(3):
            once(call)
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    shuffle = random.Random(0).shuffle
    with timed():
        for _ in range(rounds):
            shuffle(order)  # (a fixed order favours or penalises a column by its neighbour)
            for name in order:
                times[name].append(once(calls[name]))
    return {name: statistics.median(ts) for name, ts in times.items()}


def precast(converted: nn.Module, inputs: dict[str, torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A diagnostic column: ``converted`` (O2/O3) with its weights cast once up front and
    read through the same bookkeeping per call (what O2/O3 would cost if a weight's cast
    were free), by standing in for the weight-cast functions during the call."""
    from mixprec.convert import cast_at_use

    made: dict[int, torch.Tensor] = {}
    for module in converted.modules():
        table = module.__dict__.get("_parameters")
        if isinstance(table, cast_at_use.LowParameters):
            for _, stored in table.stored():
                made[id(stored)] = stored.detach().to(table.state.dtype)
    real, real_kernel = cast_at_use._cast_for, cast_at_use._kernel_cast

    def ready(frame: Any, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        low = made.get(id(tensor), tensor)
        frame.casts[id(tensor)] = (tensor, low, low._version, low.data_ptr())
        return low

    def ready_for_kernel(casts: dict[int, Any], weight: Any, dtype: torch.dtype) -> Any:
        low = made.get(id(weight), weight)
        casts[id(weight)] = (weight, low, cast_at_use._UNSEEN, cast_at_use._UNSEEN)
        return low

    def call() -> torch.Tensor:
        cast_at_use._cast_for = ready  # type: ignore[assignment]
        cast_at_use._kernel_cast = ready_for_kernel
        try:
            return _call(converted, inputs)
        finally:
            cast_at_use._cast_for, cast_at_use._kernel_cast = real, real_kernel

    return call


def output_kept(
    converted: nn.Module, inputs: dict[str, torch.Tensor]
) -> Callable[[], torch.Tensor]:
    """A diagnostic column: ``converted`` (O2/O3) with its root's output cast turned off."""
    forward_of(converted).output_dtype = None  # (the root's ModuleCall)
    return functools.partial(_call, converted, inputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds (a smoke run)")
    parser.add_argument("--models", default="gpt2,bert,t5,resnet")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="add 'O3 precast' (O3, weights cast once up front) and 'O2 out low' (O2, no "
        "output cast): diagnostics, forward only",
    )
    parser.add_argument(
        "--casts", action="store_true", help="add a row: cast kernels per forward of each column"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    args = parser.parse_args()
    rounds = args.rounds or (5 if args.quick else 40)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    torch.set_num_threads(1)
    idle = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    diagnostics = ("O3 precast", "O2 out low") if args.breakdown else ()
    names = ("torch.autocast", f"{args.dtype} model", *LEVELS, *diagnostics)
    print(
        f"host time per call on {args.device}, {args.dtype}, ratio to torch.autocast "
        f"(median of {rounds} interleaved rounds)"
    )
    print(
        f"{'model':8s} {'pass':8s} {'torch.autocast':>14s}"
        + "".join(f"{n:>11s}" for n in names[1:])
    )
    for model_name in args.models.split(","):
        model, inputs = on_device(*build(model_name), args.device)
        calls = callers(model, inputs, dtype)
        calls[f"{args.dtype} model"] = calls.pop("low model")
        if args.breakdown:
            calls["O3 precast"] = precast(amp.auto_mixed_precision(model, "O3", dtype), inputs)
            calls["O2 out low"] = output_kept(amp.auto_mixed_precision(model, "O2", dtype), inputs)
        for backward in (False, True):
            if backward and args.breakdown:
                continue  # (the up-front casts carry no graph back to the weights)
            med = time_rounds(calls, rounds, backward, idle=idle)
            base = med["torch.autocast"]
            row = f"{model_name:8s} {'fwd+bwd' if backward else 'fwd':8s} {base * 1e3:11.2f} ms"
            row += "".join(f"{med[n] / base:10.2f}x" for n in names[1:])
            print(row, flush=True)
        if args.casts:
            counted = count_casts(calls)
            row = f"{model_name:8s} {'casts':8s} {counted['torch.autocast']:14d}"
            print(row + "".join(f"{counted[n]:11d}" for n in names[1:]), flush=True)


def count_casts(calls: dict[str, Callable[[], torch.Tensor]]) -> dict[str, int]:
    """Cast kernels per forward of each column (a count that does not vary from run to
    run, unlike the times)."""
    from mixprec.inspect import CastCounter

    counted: dict[str, int] = {}
    for name, call in calls.items():
        with torch.no_grad(), CastCounter() as counter:
            call()
        counted[name] = counter.total
    return counted


if __name__ == "__main__":
    main()
