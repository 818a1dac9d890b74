"""Capture measurements (O1, bf16, tiny transformers models): conversion time, casts per
forward, plan vs measured, run-time parts; ``--compile`` adds graph breaks and compiled time.

Run: ``PYTHONPATH=src python benchmarks/bench_capture.py --compile``
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import transformers as tf

import mixprec as amp

try:
    from mixprec.cli.measure import CastCounter
except ImportError:  # where the meters moved to mixprec.inspect
    from mixprec.inspect import CastCounter  # type: ignore[no-redef]

IDS = torch.randint(2, 100, (2, 16), generator=torch.Generator().manual_seed(0))


def bert() -> Any:
    config = tf.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return tf.BertModel(config).eval()


def gpt2() -> Any:
    config = tf.GPT2Config(
        vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False
    )
    return tf.GPT2LMHeadModel(config).eval()


def t5() -> Any:
    config = tf.T5Config(
        vocab_size=100,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        use_cache=False,
    )
    return tf.T5ForConditionalGeneration(config).eval()


CALLS: dict[str, Callable[[Any], Any]] = {
    "bert": lambda m: m(input_ids=IDS),
    "gpt2": lambda m: m(input_ids=IDS),
    "t5": lambda m: m(input_ids=IDS, decoder_input_ids=IDS[:, :4]),
}


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(name: str, model: Any) -> None:
    call = CALLS[name]
    convert_ms = median_ms(lambda: amp.auto_mixed_precision(model, "O1", "bf16"), 3)
    converted = amp.auto_mixed_precision(model, "O1", "bf16")
    with torch.no_grad():
        call(converted)  # the plan shows the specialisations last called
        with CastCounter() as ours:
            call(converted)
        plan = amp.explain(converted)
        ours_ms = median_ms(lambda: call(converted), 30)
        with torch.autocast("cpu", torch.bfloat16):
            with CastCounter() as theirs:
                call(model)
            theirs_ms = median_ms(lambda: call(model), 30)
    print(
        f"{name}: convert {convert_ms:.0f} ms | casts/forward measured {ours.total} planned "
        f"{plan.num_casts} (run-time parts {len(plan.runtime_parts)}) | torch.autocast casts "
        f"{theirs.total} | forward {ours_ms:.1f} ms vs torch.autocast {theirs_ms:.1f} ms"
    )


def compiled() -> None:
    model = bert()
    converted = amp.auto_mixed_precision(model, "O1", "bf16")
    with torch.no_grad():
        torch._dynamo.reset()
        report = torch._dynamo.explain(converted)(input_ids=IDS)
        print("bert O1 graph breaks:", report.graph_break_count)
        torch._dynamo.reset()
        ours = torch.compile(converted, backend="eager")
        theirs = torch.compile(model, backend="eager")

        def autocast() -> Any:
            with torch.autocast("cpu", torch.bfloat16):
                return theirs(input_ids=IDS)

        ours(input_ids=IDS)
        autocast()
        ours_ms = median_ms(lambda: ours(input_ids=IDS), 30)
        print(
            f"compiled (backend=eager): O1 {ours_ms:.1f} ms vs torch.autocast {median_ms(autocast, 30):.1f} ms"
        )


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    for name, make in (("bert", bert), ("gpt2", gpt2), ("t5", t5)):
        measure(name, make())
    if "--compile" in sys.argv:
        compiled()
