"""Emulated low precision, op by op: every GEMM the mode intercepts, in bfloat16 and float16.

For each op: the native low-precision result, the emulated one (float32 kernel on the same
low-precision inputs, result rounded) and the float32 result on the unrounded inputs. The
emulated result must be closer to the native one than the native one is to float32, for
the output and for the input gradients, and have the native dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import rel_error
from mixprec.convert import emulate
from mixprec.inspect import CastCounter

T = torch.Tensor
_VF = torch._C._VariableFunctions
Sample = tuple[Callable[..., object], Callable[..., object], tuple[tuple[int, ...], ...]]


def _mha(q: T, k: T, v: T) -> T:
    torch.manual_seed(1)
    layer = nn.MultiheadAttention(8, 2, batch_first=True).to(q.dtype)
    return layer(q, k, v)[0]


def _recurrent(cls: type[nn.Module], cell: bool) -> Callable[[T], object]:
    def run(x: T) -> object:
        torch.manual_seed(1)
        layer = cls(8, 6).to(x.dtype)
        out = layer(x if not cell else x[0])
        return out[0] if isinstance(out, tuple) else out

    return run


#: (the function the mode intercepts, a call of it, the input shapes). Tiny tensors.
SAMPLES: dict[str, Sample] = {
    "linear": (F.linear, lambda x, w, b: F.linear(x, w, b), ((3, 8), (5, 8), (5,))),
    "bilinear": (F.bilinear, F.bilinear, ((3, 4), (3, 5), (2, 4, 5))),
    "matmul": (torch.matmul, torch.matmul, ((2, 3, 8), (8, 4))),
    "mm": (torch.mm, torch.mm, ((3, 8), (8, 4))),
    "bmm": (torch.bmm, torch.bmm, ((2, 3, 8), (2, 8, 4))),
    "addmm": (torch.addmm, torch.addmm, ((3, 4), (3, 8), (8, 4))),
    "baddbmm": (torch.baddbmm, torch.baddbmm, ((2, 3, 4), (2, 3, 8), (2, 8, 4))),
    "addbmm": (torch.addbmm, torch.addbmm, ((3, 4), (2, 3, 8), (2, 8, 4))),
    "mv": (torch.mv, torch.mv, ((3, 8), (8,))),
    "addmv": (torch.addmv, torch.addmv, ((3,), (3, 8), (8,))),
    "dot": (torch.dot, torch.dot, ((16,), (16,))),
    "vdot": (torch.vdot, torch.vdot, ((16,), (16,))),
    "inner": (torch.inner, torch.inner, ((3, 8), (4, 8))),
    "einsum": (torch.einsum, lambda a, b: torch.einsum("bij,jk->bik", a, b), ((2, 3, 8), (8, 4))),
    "tensordot": (torch.tensordot, lambda a, b: torch.tensordot(a, b, dims=1), ((3, 8), (8, 4))),
    "chain_matmul": (
        torch.chain_matmul,
        torch.chain_matmul,
        ((3, 8), (8, 6), (6, 4)),
    ),
    "linalg.matmul": (torch.linalg.matmul, torch.linalg.matmul, ((3, 8), (8, 4))),
    "multi_dot": (
        torch.linalg.multi_dot,
        lambda a, b, c: torch.linalg.multi_dot([a, b, c]),
        ((3, 8), (8, 6), (6, 4)),
    ),
    "vecdot": (torch.linalg.vecdot, torch.linalg.vecdot, ((3, 16), (3, 16))),
    "conv1d": (F.conv1d, F.conv1d, ((2, 3, 9), (4, 3, 3), (4,))),
    "conv2d": (F.conv2d, F.conv2d, ((2, 3, 7, 7), (4, 3, 3, 3), (4,))),
    "conv3d": (F.conv3d, F.conv3d, ((1, 2, 5, 5, 5), (3, 2, 3, 3, 3))),
    "conv_transpose1d": (F.conv_transpose1d, F.conv_transpose1d, ((2, 3, 6), (3, 4, 3))),
    "conv_transpose2d": (F.conv_transpose2d, F.conv_transpose2d, ((2, 3, 5, 5), (3, 4, 3, 3))),
    "conv_transpose3d": (
        F.conv_transpose3d,
        F.conv_transpose3d,
        ((1, 2, 4, 4, 4), (2, 3, 3, 3, 3)),
    ),
    "conv_tbc": (torch.conv_tbc, torch.conv_tbc, ((7, 2, 3), (3, 3, 4), (4,))),
    "sdpa": (
        F.scaled_dot_product_attention,
        F.scaled_dot_product_attention,
        ((2, 2, 5, 8), (2, 2, 5, 8), (2, 2, 5, 8)),
    ),
    "multi_head_attention": (F.multi_head_attention_forward, _mha, ((2, 5, 8),) * 3),
    "lstm": (_VF.lstm, _recurrent(nn.LSTM, False), ((5, 2, 8),)),
    "gru": (_VF.gru, _recurrent(nn.GRU, False), ((5, 2, 8),)),
    "rnn_tanh": (_VF.rnn_tanh, _recurrent(nn.RNN, False), ((5, 2, 8),)),
    "rnn_relu": (
        _VF.rnn_relu,
        lambda x: (torch.manual_seed(1), nn.RNN(8, 6, nonlinearity="relu").to(x.dtype)(x)[0])[1],
        ((5, 2, 8),),
    ),
    "lstm_cell": (_VF.lstm_cell, _recurrent(nn.LSTMCell, True), ((5, 2, 8),)),
    "gru_cell": (_VF.gru_cell, _recurrent(nn.GRUCell, True), ((5, 2, 8),)),
    "rnn_tanh_cell": (_VF.rnn_tanh_cell, _recurrent(nn.RNNCell, True), ((5, 2, 8),)),
    "rnn_relu_cell": (
        _VF.rnn_relu_cell,
        lambda x: (torch.manual_seed(1), nn.RNNCell(8, 6, nonlinearity="relu").to(x.dtype)(x[0]))[
            1
        ],
        ((5, 2, 8),),
    ),
    "max_pool1d": (F.max_pool1d, lambda x: F.max_pool1d(x, 2), ((2, 3, 8),)),
    "max_pool2d": (F.max_pool2d, lambda x: F.max_pool2d(x, 2), ((2, 3, 6, 6),)),
    "max_pool3d": (F.max_pool3d, lambda x: F.max_pool3d(x, 2), ((1, 2, 4, 4, 4),)),
    "Tensor.matmul": (T.matmul, T.matmul, ((3, 8), (8, 4))),
    "Tensor.__matmul__": (T.__matmul__, lambda a, b: a @ b, ((3, 8), (8, 4))),
    "Tensor.__rmatmul__": (T.__rmatmul__, lambda a, b: b.__rmatmul__(a), ((3, 8), (8, 4))),
    "Tensor.mm": (T.mm, T.mm, ((3, 8), (8, 4))),
    "Tensor.bmm": (T.bmm, T.bmm, ((2, 3, 8), (2, 8, 4))),
    "Tensor.addmm": (T.addmm, T.addmm, ((3, 4), (3, 8), (8, 4))),
    "Tensor.baddbmm": (T.baddbmm, T.baddbmm, ((2, 3, 4), (2, 3, 8), (2, 8, 4))),
    "Tensor.addbmm": (T.addbmm, T.addbmm, ((3, 4), (2, 3, 8), (2, 8, 4))),
    "Tensor.mv": (T.mv, T.mv, ((3, 8), (8,))),
    "Tensor.addmv": (T.addmv, T.addmv, ((3,), (3, 8), (8,))),
    "Tensor.dot": (T.dot, T.dot, ((16,), (16,))),
    "Tensor.vdot": (T.vdot, T.vdot, ((16,), (16,))),
    "Tensor.inner": (T.inner, T.inner, ((3, 8), (4, 8))),
    "Tensor.addmm_": (T.addmm_, lambda c, a, b: c.clone().addmm_(a, b), ((3, 4), (3, 8), (8, 4))),
    "Tensor.baddbmm_": (
        T.baddbmm_,
        lambda c, a, b: c.clone().baddbmm_(a, b),
        ((2, 3, 4), (2, 3, 8), (2, 8, 4)),
    ),
    "Tensor.addbmm_": (
        T.addbmm_,
        lambda c, a, b: c.clone().addbmm_(a, b),
        ((3, 4), (2, 3, 8), (2, 8, 4)),
    ),
    "Tensor.addmv_": (T.addmv_, lambda c, a, b: c.clone().addmv_(a, b), ((3,), (3, 8), (8,))),
}
#: Intercepted, but only reachable through torch's inference fast paths: their emulation
#: is the same generic upcast-compute-round as every other entry.
NOT_SAMPLED = {
    getattr(torch, "_native_multi_head_attention", None),
    getattr(torch, "_transformer_encoder_layer_fwd", None),
}


def test_every_intercepted_function_has_a_sample() -> None:
    sampled = {sample[0] for sample in SAMPLES.values()}
    intercepted = set(emulate.EMULATED_FUNCTIONS) | set(emulate._IN_PLACE)
    missing = intercepted - sampled - NOT_SAMPLED
    assert not missing, f"intercepted without a sample: {missing}"


def _first(out: object) -> T:
    while isinstance(out, (tuple, list)):
        out = out[0]
    assert isinstance(out, torch.Tensor)
    return out


def _run(name: str, inputs: list[T], emulated: bool) -> tuple[T, list[T | None]]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    call = SAMPLES[name][1]
    if emulated:
        with emulate.emulating():
            out = _first(call(*leaves))
    else:
        out = _first(call(*leaves))
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out.float() * weights).sum().backward()
    return out.detach(), [t.grad for t in leaves]


#: Ops whose native low-precision kernel rounds intermediate values (each recurrent step's
#: state, attention's probabilities, bilinear's and addbmm's partial products, vecdot's
#: products) where the emulation rounds only the result: there the emulated value sits
#: between the native one and float32, and may be up to 2.5 times as far from the native
#: one as the native one is from float32.
COMPOSITE = {
    "addbmm",
    "Tensor.addbmm",
    "Tensor.addbmm_",
    "bilinear",
    "conv_tbc",
    "sdpa",
    "vecdot",
    "lstm",
    "gru",
    "rnn_tanh",
    "rnn_relu",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    # where oneDNN may not run bf16/fp16 (an AVX2-only CPU, or ONEDNN_MAX_CPU_ISA=AVX2),
    # PyTorch's own low-precision convolution rounds partial sums (seen at 1.05x there)
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
}


def _compare(name: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    full = [torch.randn(shape) for shape in SAMPLES[name][2]]
    low = [t.to(dtype) for t in full]
    reference, ref_grads = _run(name, full, emulated=False)
    native, native_grads = _run(name, low, emulated=False)
    with CastCounter() as counter:
        emulated, emulated_grads = _run(name, low, emulated=True)
    assert counter.casts[(dtype, torch.float32)] >= len(low), "the mode did not intercept"
    assert emulated.dtype == native.dtype == dtype
    # one rounding of the result, against the rounding of every input and the result
    factor = 2.5 if name in COMPOSITE else 1.0
    assert rel_error(emulated, native) <= factor * rel_error(native, reference) + 1e-6, name
    for i, (e, n, r) in enumerate(zip(emulated_grads, native_grads, ref_grads, strict=True)):
        assert e is not None
        assert n is not None
        assert r is not None
        assert e.dtype == n.dtype == dtype, f"{name}: gradient {i}"
        assert rel_error(e, n) <= factor * rel_error(n, r) + 1e-6, f"{name}: gradient {i}"


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_op_emulated_bf16_is_closer_to_native_than_native_to_fp32(name: str) -> None:
    _compare(name, torch.bfloat16)


#: ops without a float16 CPU kernel in this torch (native float16 raises)
_NO_FP16_KERNEL: set[str] = set()


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_op_emulated_fp16_is_closer_to_native_than_native_to_fp32(name: str) -> None:
    if name in _NO_FP16_KERNEL:
        pytest.skip(f"{name} has no float16 CPU kernel")
    _compare(name, torch.float16)


def test_float16_overflow_still_overflows() -> None:
    a = torch.full((2, 4), 200.0, dtype=torch.float16)
    native = a @ a.T  # 4 * 40000 = 160000 > 65504
    with emulate.emulating():
        emulated = a @ a.T
    assert torch.isinf(native).all()
    assert torch.isinf(emulated).all()
    assert emulated.dtype == torch.float16


def test_mixed_or_float32_inputs_run_natively() -> None:
    """Only calls whose floating inputs share one low dtype are emulated; anything else
    keeps its native result, or its native error."""
    a32, b16 = torch.randn(3, 4), torch.randn(4, 2).bfloat16()
    with emulate.emulating(), CastCounter() as counter:
        out = a32 @ a32.T
        with pytest.raises(RuntimeError):
            torch.mm(a32, b16)
        ints = torch.ones(2, 2, dtype=torch.long) @ torch.ones(2, 2, dtype=torch.long)
    assert out.dtype == torch.float32
    assert ints.dtype == torch.long
    assert counter.total == 0


def test_out_argument_runs_natively() -> None:
    a = torch.randn(3, 3).bfloat16()
    out = torch.empty(3, 3, dtype=torch.bfloat16)
    with emulate.emulating(), CastCounter() as counter:
        torch.mm(a, a, out=out)
    assert counter.total == 0
    torch.testing.assert_close(out, a @ a)


def test_the_pool_never_reuses_a_buffer_a_graph_still_holds() -> None:
    """Two forwards before one backward: the second upcast may not overwrite the first."""
    torch.manual_seed(0)
    w = torch.randn(512, 512, requires_grad=True)  # large enough for a pooled upcast
    xs = [torch.randn(4, 512).bfloat16().requires_grad_() for _ in range(2)]
    pool = emulate._BufferPool()
    with emulate.EmulationMode(pool):
        outs = [F.linear(x, w.bfloat16()) for x in xs]
    sum(o.float().sum() for o in outs).backward()
    expected = sum(x.detach().float().sum(0) for x in xs)
    torch.testing.assert_close(w.grad, expected.expand(512, -1), rtol=1e-2, atol=1e-1)
    assert len(pool._buffers[((512, 512), w.device)]) == 2
    with emulate.EmulationMode(pool):
        F.linear(xs[0].detach(), w.bfloat16())
    assert len(pool._buffers[((512, 512), w.device)]) == 2  # a free one was reused
