"""Every level on a CUDA GPU, on real architectures: numerics against a float32 control and
``torch.autocast("cuda")``, dtypes at the boundaries, the exact plan, training, compile.

The models are those of ``test_explain_exact`` (tiny BERT, GPT-2, T5, ALBERT with random
weights, a ResNet, LeNet-5, an MLP, a CNN, a transformer). Tolerances are relative to
``torch.autocast`` on the same model: a level's error against float32 may be at most a few
times autocast's own (O3 computes its norms and softmax low too), or under a floor of the
dtype's rounding.

Skipped without a GPU; ``benchmarks/gpu_check.sh`` runs them. ``MIXPREC_TEST_DEVICE=cpu``
runs them on the CPU instead (a dry run of the file on a machine without one).
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import mixprec as amp
from helpers import needs_compile
from mixprec.inspect import CastCounter
from test_explain_exact import MODELS

DEVICE = os.environ.get("MIXPREC_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"
    ),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
LEVELS = ["O1", "autocast", "O2", "O3"]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: The error against float32 any level may have, whatever autocast's (the dtype's rounding
#: compounded over a few layers).
FLOOR = {"fp16": 3e-3, "bf16": 4e-2}
#: How many times autocast's error a level may have (O3 computes everything low).
FACTOR = {"O1": 2.0, "autocast": 1.5, "O2": 3.0, "O3": 6.0}


def _on_device(value: Any) -> Any:
    return pytree.tree_map(lambda t: t.to(DEVICE) if isinstance(t, torch.Tensor) else t, value)


def _first(out: Any) -> torch.Tensor:
    """The forward's first floating tensor (logits, last hidden state)."""
    leaves = pytree.tree_leaves(out.to_tuple() if hasattr(out, "to_tuple") else out)
    return next(t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point())


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-12))


def _model(name: str) -> tuple[nn.Module, tuple[Any, ...]]:
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    return model.to(DEVICE).eval(), _on_device(inputs)


def _run(
    call: Callable[[], Any], model: nn.Module, weight: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, the gradients of every Parameter flattened, a fixed projection of the
    output that backward starts from)."""
    model.zero_grad(set_to_none=True)
    out = _first(call())
    if weight is None:
        weight = torch.randn(out.shape, device=out.device, generator=None)
    (out.float() * weight).sum().backward()
    grads = [
        p.grad.float().flatten() if p.grad is not None else torch.zeros(p.numel(), device=DEVICE)
        for p in model.parameters()
    ]
    return out, torch.cat(grads), weight


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", list(MODELS))
def test_every_level_on_the_device_is_close_to_float32(name: str, level: str, dtype: str) -> None:
    model, inputs = _model(name)
    low = DTYPES[dtype]
    out32, grads32, weight = _run(lambda: model(*inputs), model, None)

    def autocast() -> Any:
        with torch.autocast(DEVICE, low):
            return model(*inputs)

    out_ac, grads_ac, _ = _run(autocast, model, weight)
    converted = amp.auto_mixed_precision(model, level, low)
    out, grads, _ = _run(lambda: converted(*inputs), model, weight)

    expected = out_ac.dtype if level == "autocast" else torch.float32
    assert (out.dtype, out.device.type) == (expected, DEVICE)
    assert all(p.dtype == torch.float32 and p.device.type == DEVICE for p in model.parameters())
    bound = FACTOR[level]
    assert _rel(out, out32) <= max(bound * _rel(out_ac, out32), FLOOR[dtype])
    assert _rel(grads, grads32) <= max(bound * _rel(grads_ac, grads32), 2 * FLOOR[dtype])
    if level == "autocast":  # the same decisions as torch.autocast, op by op
        assert _rel(out, out_ac) <= FLOOR[dtype] / 5


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", list(MODELS))
def test_explain_is_exact_on_the_device(name: str, level: str, grad: bool) -> None:
    """The plan on the device's lists (on CUDA, softmax and layer_norm run in float32 at
    the autocast level) equals the casts a real forward there makes."""
    model, inputs = _model(name)
    converted = amp.auto_mixed_precision(model, level, torch.float16)
    with torch.set_grad_enabled(grad):
        with CastCounter() as counter:
            converted(*inputs)
        plan = amp.explain(converted, *inputs)
    assert plan.num_casts == counter.total, plan


def _gpt2_batch() -> tuple[nn.Module, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    ids = torch.randint(0, 64, (8, 16), device=DEVICE)
    return GPT2LMHeadModel(config).to(DEVICE), ids


def _train(level: str, dtype: str, steps: int) -> tuple[list[float], Any]:
    model, ids = _gpt2_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step = amp.build_train_network(model, optimizer, level=level, dtype=dtype)
    losses = [float(step(input_ids=ids, labels=ids)) for _ in range(steps)]
    return losses, step


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("level", LEVELS)
def test_gpt2_trains_at_every_level_on_the_device(level: str, dtype: str) -> None:
    """40 steps on one batch (the network computes its own loss): the loss falls as in
    float32 training, no step is skipped past the fp16 scale's first settling, the masters
    stay float32 on the device."""
    steps = 40
    reference, _ = _train("O0", dtype, steps)
    losses, step = _train(level, dtype, steps)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0]
    assert abs(losses[-1] - reference[-1]) <= 0.15 * reference[-1] + 0.05
    assert step.skipped_steps <= (20 if dtype == "fp16" else 0)
    masters = [p for group in step.optimizer.param_groups for p in group["params"]]
    assert all(p.dtype == torch.float32 and p.device.type == DEVICE for p in masters)


@needs_compile
@pytest.mark.parametrize("level", LEVELS)
def test_compiled_on_the_device_matches_eager_with_no_more_graph_breaks(level: str) -> None:
    """``torch.compile`` (inductor) of a converted GPT-2: as many graph breaks as the
    original, the eager output within bf16 rounding, backward through it."""
    model, ids = _gpt2_batch()
    model.eval()
    converted = amp.auto_mixed_precision(model, level, torch.bfloat16)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        breaks = torch._dynamo.explain(copy.deepcopy(model))(ids).graph_break_count
        ours = torch._dynamo.explain(converted)(ids).graph_break_count
        compiled = torch.compile(converted)
        eager = _first(converted(ids))
        out = _first(compiled(ids))
    assert ours <= breaks
    assert out.dtype == eager.dtype
    assert _rel(out, eager) <= 2e-2
    out.float().square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_autocast_level_follows_a_model_moved_after_conversion(dtype: str) -> None:
    """Converted on the CPU, then moved: the region is the autocast of the device the
    call runs on (on CUDA, softmax and layer_norm in float32), as ``torch.autocast``
    there gives."""
    from mixprec.cli.models import TinyTransformer

    torch.manual_seed(0)
    model = TinyTransformer(dim=16, heads=2).eval()
    converted = amp.auto_mixed_precision(model, "autocast", DTYPES[dtype]).to(DEVICE)
    ids = torch.randint(0, 50, (2, 6), device=DEVICE)
    with torch.autocast(DEVICE, DTYPES[dtype]):
        expected = model(ids)
    out = converted(ids)
    assert (out.dtype, out.device.type) == (expected.dtype, DEVICE)
    assert _rel(out, expected) <= FLOOR[dtype] / 5
