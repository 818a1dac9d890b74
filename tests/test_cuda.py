"""CUDA: the autocast level against ``torch.autocast("cuda")`` for every op of the CUDA
lists, float16 O2 training with dynamic loss scaling, and ``mixprec bench --device cuda``.

Skipped without a GPU; ``benchmarks/gpu_check.sh`` runs them (with every other test marked
``cuda``) on a machine that has one.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

import mixprec as amp
from mixprec.cli import main
from mixprec.cli.models import TinyMLP
from mixprec.policy import lists
from test_autocast_conformance import SAMPLES, Sample

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
R = torch.randn
LOW = torch.float16
_ONE = lambda: (R(4, 5),)  # noqa: E731
_TWO = lambda: (R(4, 5), R(4, 5))  # noqa: E731


def _cell(cls: type[nn.Module]) -> Callable[[torch.Tensor], Any]:
    def run(x: torch.Tensor) -> Any:
        torch.manual_seed(2)
        cell = cls(5, 3).to(x.device)
        out = cell(x)
        return out[0] if isinstance(out, tuple) else out

    return run


#: Samples of the ops only the CUDA lists name (the rest come from the CPU conformance).
CUDA_SAMPLES: dict[str, Sample] = {
    "addmv": (torch.addmv, lambda: (R(3), R(3, 5), R(5))),
    "addr": (torch.addr, lambda: (R(3, 4), R(3), R(4))),
    "mv": (torch.mv, lambda: (R(3, 5), R(5))),
    "lstm_cell": (_cell(nn.LSTMCell), _ONE),
    "gru_cell": (_cell(nn.GRUCell), _ONE),
    "rnn_tanh_cell": (_cell(nn.RNNCell), _ONE),
    "rnn_relu_cell": (
        lambda x: (torch.manual_seed(2), nn.RNNCell(5, 3, nonlinearity="relu").to(x.device)(x))[1],
        _ONE,
    ),
    **{
        name: (getattr(torch, name), lambda: (R(4, 5).clamp(-0.9, 0.9),))
        for name in ("acos", "asin", "erfinv")
    },
    **{
        name: (getattr(torch, name), lambda: (R(4, 5).abs() + 0.5,))
        for name in ("log", "log10", "log2", "log1p", "reciprocal", "rsqrt")
    },
    **{name: (getattr(torch, name), _ONE) for name in ("cosh", "exp", "expm1", "sinh", "tan")},
    "pow": (lambda x: torch.pow(x, 2), _ONE),
    "softplus": (F.softplus, _ONE),
    "layer_norm": (lambda x: F.layer_norm(x, (5,)), _ONE),
    "group_norm": (lambda x: F.group_norm(x, 2), lambda: (R(2, 4, 3),)),
    "norm": (torch.norm, _ONE),
    "frobenius_norm": (lambda x: torch.norm(x, p="fro"), _ONE),
    "nuclear_norm": (lambda x: torch.norm(x, p="nuc"), _ONE),
    "normalize": (F.normalize, _ONE),
    "cosine_similarity": (F.cosine_similarity, _TWO),
    "dist": (torch.dist, _TWO),
    "pdist": (F.pdist, _ONE),
    "renorm": (lambda x: torch.renorm(x, 2, 0, 1.0), _ONE),
    "logsumexp": (lambda x: torch.logsumexp(x, 1), _ONE),
    "interpolate": (lambda x: F.interpolate(x, scale_factor=2), lambda: (R(1, 2, 4),)),
    "upsample": (lambda x: F.upsample(x, scale_factor=2), lambda: (R(1, 2, 4),)),
    "upsample_nearest": (lambda x: F.upsample_nearest(x, scale_factor=2), lambda: (R(1, 2, 4, 4),)),
    "upsample_bilinear": (
        lambda x: F.upsample_bilinear(x, scale_factor=2),
        lambda: (R(1, 2, 4, 4),),
    ),
    "softmax": (lambda x: torch.softmax(x, 1), _ONE),
    "log_softmax": (lambda x: torch.log_softmax(x, 1), _ONE),
    "softmin": (lambda x: F.softmin(x, 1), _ONE),
    "cumprod": (lambda x: torch.cumprod(x, 1), _ONE),
    "cumsum": (lambda x: torch.cumsum(x, 1), _ONE),
    "sum": (torch.sum, _ONE),
    "linalg_vector_norm": (torch.linalg.vector_norm, _ONE),
    "linalg_matrix_norm": (torch.linalg.matrix_norm, _ONE),
    "linalg_norm": (torch.linalg.norm, _ONE),
    "addcdiv": (torch.addcdiv, lambda: (R(4, 5), R(4, 5), R(4, 5).abs() + 1)),
    "addcmul": (torch.addcmul, lambda: (R(4, 5), R(4, 5), R(4, 5))),
    "atan2": (torch.atan2, _TWO),
    "bilinear": (F.bilinear, lambda: (R(3, 4), R(3, 5), R(2, 4, 5))),
    "cross": (lambda a, b: torch.cross(a, b, dim=1), lambda: (R(4, 3), R(4, 3))),
    "linalg_cross": (torch.linalg.cross, lambda: (R(4, 3), R(4, 3))),
    "dot": (torch.dot, lambda: (R(5), R(5))),
    "vdot": (torch.vdot, lambda: (R(5), R(5))),
    "index_put": (
        lambda a, b: a.index_put((torch.tensor([0], device=a.device),), b),
        lambda: (R(3, 4), R(1, 4)),
    ),
    "scatter_add": (
        lambda a, b: a.scatter_add(0, torch.zeros(1, 4, dtype=torch.long, device=a.device), b),
        lambda: (R(3, 4), R(1, 4)),
    ),
}
NOT_CALLABLE = {"multi_dot": "an aten name only; torch.linalg.multi_dot is sampled"}
#: Ops mixprec's CUDA lists (torch 2.13's) hold that an older torch's CUDA autocast lacks:
#: there ``torch.autocast("cuda")`` itself decides otherwise (seen with torch 2.11 on an
#: H200), and the autocast level, which runs under it, with it.
NEWER_THAN_THIS_TORCH = (
    {"_addmm_activation", "nuclear_norm", "linalg_cross"}
    if torch.torch_version.TorchVersion(torch.__version__) < "2.13"
    else set()
)
LISTS = {
    "low": lists.CUDA_LOWER_OPS,
    "fp32": lists.CUDA_FP32_OPS,
    "promote": lists.CUDA_PROMOTE_OPS,
}
CASES = [(kind, name) for kind, names in LISTS.items() for name in sorted(names)]


def test_every_op_of_the_cuda_lists_has_a_sample() -> None:
    listed = set().union(*LISTS.values())
    missing = listed - set(SAMPLES) - set(CUDA_SAMPLES) - set(NOT_CALLABLE)
    assert not missing, sorted(missing)


class _Op(nn.Module):
    def __init__(self, fn: Callable[..., Any], low: tuple[int, ...]) -> None:
        super().__init__()
        self.fn, self.low = fn, low

    def forward(self, *args: torch.Tensor) -> Any:
        args = tuple(a.to(LOW) if i in self.low else a for i, a in enumerate(args))
        return self.fn(*args)


@pytest.mark.parametrize(("kind", "name"), CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_autocast_level_matches_torch_autocast_cuda(kind: str, name: str) -> None:
    if name in NOT_CALLABLE:
        pytest.skip(NOT_CALLABLE[name])
    if name in NEWER_THAN_THIS_TORCH:
        pytest.skip(f"torch {torch.__version__}'s CUDA autocast lists lack {name}")
    fn, make = CUDA_SAMPLES.get(name) or SAMPLES[name]
    torch.manual_seed(0)
    inputs = tuple(t.cuda() for t in make())
    floating = [i for i, t in enumerate(inputs) if t.is_floating_point()]
    low = {"low": (), "fp32": tuple(floating), "promote": tuple(floating[:1])}[kind]
    model = _Op(fn, low)
    with torch.autocast("cuda", dtype=LOW):
        theirs = model(*inputs)
    ours = amp.auto_mixed_precision(model, "autocast", LOW)(*inputs)
    ours_leaves = [t for t in pytree.tree_leaves(ours) if isinstance(t, torch.Tensor)]
    theirs_leaves = [t for t in pytree.tree_leaves(theirs) if isinstance(t, torch.Tensor)]
    assert [t.dtype for t in ours_leaves] == [t.dtype for t in theirs_leaves]
    if kind == "low":
        assert theirs_leaves[0].dtype == LOW
    for a, b in zip(ours_leaves, theirs_leaves, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3, equal_nan=True)


def test_fp16_o2_training_with_dynamic_scaling() -> None:
    """Loss scale starts at 2**16 (its first value from the first gradients) and moves by
    MindSpore's rules; the loss falls; masters stay float32 on the device."""
    torch.manual_seed(0)
    model = TinyMLP().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = amp.build_train_network(
        model, optimizer, nn.CrossEntropyLoss(), level="O2", dtype="fp16"
    )
    assert isinstance(step.loss_scale_manager, amp.DynamicLossScaleManager)
    x, y = torch.randn(64, 16, device="cuda"), torch.randint(0, 8, (64,), device="cuda")
    losses = [float(step(x, y)) for _ in range(60)]
    assert losses[-1] < 0.7 * losses[0]
    assert step.loss_scale >= 1
    assert all(p.dtype == torch.float32 and p.is_cuda for p in model.parameters())
    assert all(p.dtype == torch.float16 for p in step.network.parameters())


def test_bench_on_cuda(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main(["bench", "--quick", "--device", "cuda", "--dtype", "fp16", "--out", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["settings"]["device"] == "cuda"
    variants = {r["variant"] for r in data["results"]}
    assert {"fp32", "torch.autocast", "mixprec O2"} <= variants


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize(
    "make",
    [lambda: nn.BatchNorm2d(6), lambda: nn.LayerNorm(6), lambda: nn.GroupNorm(2, 6)],
    ids=["batch_norm", "layer_norm", "group_norm"],
)
def test_o2_norm_islands_on_cuda_compute_in_float32(
    make: Callable[[], nn.Module], train: bool
) -> None:
    """O2's norms on CUDA: BatchNorm takes its fp16 input in one kernel (float32 math, no
    cast), LayerNorm and GroupNorm cast (CUDA's kernels take one dtype); each agrees with
    casting the input up, computing in float32 and casting the output back."""
    from mixprec.inspect import CastCounter

    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), make()).cuda().train(train)
    reference = make().cuda().train(train)
    reference.load_state_dict(model[1].state_dict())
    converted = amp.auto_mixed_precision(model, "O2", LOW)
    x = torch.randn(2, 6, 3, 3, device="cuda") * 3 + 1
    if isinstance(model[1], nn.LayerNorm):
        x = x.permute(0, 2, 3, 1)  # the normalized dimension last
    with CastCounter() as counter:
        out = converted(x)
    expected = reference(x.to(LOW).float()).to(LOW).float()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-3)
    island_casts = 0 if isinstance(model[1], nn.BatchNorm2d) else 2
    assert counter.total == 2 + island_casts  # the root's input and output, the island's
