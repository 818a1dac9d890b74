"""The reports of find_overflow, lint and calibrate on the test suite's planted models, and
calibrate on tiny random BERT and GPT-2 models (hidden 32, 2 layers, batch 2x8).

Run from the repository root: ``python benchmarks/diagnose_report.py``.
"""

import time
import warnings

import torch
import transformers
from torch import nn

import mixprec
from mixprec.cli.models import TinyMLP
from mixprec.cli.planted import (
    DivZero,
    HandRMSNorm,
    LogNeg,
    MaskedAttention,
    sensitive_model,
    tiny_bert,
)

X = torch.linspace(-2, 2, 12).reshape(3, 4)


warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()
torch.manual_seed(0)
print("== find_overflow: inf from a zero buffer")
print(mixprec.find_overflow(DivZero(), X, level="O2", dtype="fp16"))
print("== find_overflow: NaN from log of a negative")
print(mixprec.find_overflow(LogNeg(), X, level="O2", dtype="bf16"))
print("== find_overflow: clean MLP")
print(mixprec.find_overflow(TinyMLP(), torch.randn(3, 16), level="O2", dtype="fp16"))
bert = tiny_bert()
with torch.no_grad():
    bert.encoder.layer[0].intermediate.dense.weight[5].mul_(1e6)
ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
t = time.perf_counter()
r = mixprec.find_overflow(bert, ids, level="O2", dtype="fp16")
dt = time.perf_counter() - t
print(f"== find_overflow: BERT with one large activation ({dt:.2f} s)")
print(r)
print("== find_overflow: loss scale 2**24 on a clean MLP")
print(
    mixprec.find_overflow(
        TinyMLP(), torch.randn(3, 16), level="O2", dtype="fp16", loss_scale=2.0**24
    )
)
m = nn.Sequential(MaskedAttention(), HandRMSNorm(8), nn.LayerNorm(8, eps=1e-12), nn.Linear(8, 2))
print("== lint: planted")
print(
    mixprec.lint(
        m,
        torch.optim.Adam(m.parameters()),
        dtype="fp16",
        master_weights=False,
        loss_scale_manager=mixprec.FixedLossScaleManager(2.0**17),
    )
)
print("== lint: same, master weights, bf16")
print(mixprec.lint(m, torch.optim.Adam(m.parameters()), dtype="bf16"))
print("== lint: clean BERT O2 fp16")
print(mixprec.lint(tiny_bert(), dtype="fp16"))
print("== calibrate: planted sensitive layer")
net, rep = mixprec.calibrate(sensitive_model(), torch.randn(4, 8), dtype="fp16", tolerance=1e-2)
print(rep)
torch.manual_seed(0)
bert = tiny_bert()
gpt2 = transformers.GPT2LMHeadModel(
    transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16)
).eval()


def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))


for name, model in (("BERT", bert), ("GPT-2", gpt2)):
    for dtype, tol in (("fp16", 5e-4), ("bf16", 3e-3)):
        t = time.perf_counter()
        net, rep = mixprec.calibrate(
            model, batch(1), dtype=dtype, tolerance=tol, holdout=[batch(2)]
        )
        print(
            f"== calibrate: {name} (hidden 32, 2 layers, batch 2x8), {time.perf_counter() - t:.2f} s"
        )
        print(rep)
