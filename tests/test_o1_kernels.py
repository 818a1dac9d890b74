"""O1's white list applied by kernels at PyTorch's dispatcher: only the listed operators pay
a Python call, the kernels act only inside a converted call in its own thread, and they
compute what the torch-function mode (the path under ``torch.compile``) computes."""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec as amp
from helpers import SmallCNN, TinyTransformer, count_casts
from mixprec.convert import dispatch
from mixprec.convert.autocast import ListedForward, Region, WhiteForward
from mixprec.convert.structure import forward_of

BF16 = torch.bfloat16


def _region(converted: nn.Module) -> Region:
    for module in converted.modules():
        forward = forward_of(module)
        if isinstance(forward, (ListedForward, WhiteForward)):
            return forward.region
    raise AssertionError("not an O1 conversion")


class Computes(TorchDispatchMode):
    """The dtype each ATen operator (by name) computes its result in."""

    def __init__(self, *names: str) -> None:
        super().__init__()
        self.names = names
        self.seen: dict[str, list[torch.dtype]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in self.names:
            first = out[0] if isinstance(out, (tuple, list)) else out
            self.seen.setdefault(name, []).append(first.dtype)
        return out


class Ops(nn.Module):
    """Every kind of white-list call O1 meets: functional, method, operator, TensorList,
    a tied weight, a shared layer called twice, an in-place op and a follow op."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.conv = nn.Conv1d(2, 2, 3, padding=1)
        self.up = nn.ConvTranspose1d(2, 2, 3, padding=1)
        self.prelu = nn.PReLU()
        self.scale = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(self.fc(x)).relu()
        y = y @ self.scale + torch.matmul(x, self.scale.t())
        y = torch.einsum("bi,ij->bj", y, self.scale) + torch.addmm(y, x, self.scale)
        z = self.up(self.conv(y.view(-1, 2, 4))).flatten(1)
        att = F.scaled_dot_product_attention(z[None], y[None], x[None])[0]
        b = torch.baddbmm(att[None], z[None], self.scale[None])
        out = self.prelu(b[0]).softmax(-1) + F.relu(z, inplace=True)
        return out.exp().sum(-1)


def _conv_relu() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 3), nn.ReLU()
    )


MODELS = {
    "ops": (Ops, lambda: (torch.randn(4, 8),)),
    "conv-relu": (_conv_relu, lambda: (torch.randn(2, 3, 8, 8),)),
    "cnn": (SmallCNN, lambda: (torch.randn(2, 3, 8, 8),)),
    "transformer": (TinyTransformer, lambda: (torch.randint(0, 50, (2, 6)),)),
}


def test_o1_applies_its_list_by_kernels_and_leaves_other_ops_to_pytorch() -> None:
    seen: list[int] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch._C._len_torch_function_stack())  # no mode sees this module's ops
            return x.sin()

    model = nn.Sequential(nn.Linear(4, 4), Probe(), nn.Linear(4, 4))
    converted = amp.auto_mixed_precision(model, "O1", "bf16")
    assert _region(converted).kernels
    with Computes("addmm", "sin") as computes:
        out = converted(torch.randn(2, 4))
    assert seen == [0]
    assert computes.seen == {"addmm": [BF16, BF16], "sin": [torch.float32]}
    assert out.dtype == torch.float32


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_kernels_compute_what_the_mode_computes(name: str) -> None:
    """Outputs, gradients and casts of the kernels (eager) and of the mode (the path a
    compiled call and a list with no kernels take) agree exactly."""
    cls, inputs = MODELS[name]
    torch.manual_seed(0)
    model = cls()
    args = inputs()
    results = []
    for kernels in (True, False):
        converted = amp.auto_mixed_precision(model, "O1", "bf16")
        _region(converted).kernels = kernels
        model.zero_grad()
        out, counter = count_casts(converted, *args)
        out.float().sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((out, counter.casts, grads))
    (out_k, casts_k, grads_k), (out_m, casts_m, grads_m) = results
    assert out_k.dtype == out_m.dtype == torch.float32
    assert torch.equal(out_k, out_m)
    assert casts_k == casts_m
    assert len(grads_k) == len(grads_m) > 0
    assert all(torch.equal(a, b) for a, b in zip(grads_k, grads_m, strict=True))


def test_the_kernels_act_only_inside_a_call_and_in_its_thread() -> None:
    other: list[torch.dtype] = []
    x = torch.randn(2, 4)
    weight = torch.randn(4, 4)

    class Spawns(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            thread = threading.Thread(target=lambda: other.append(F.linear(x, weight).dtype))
            thread.start()
            thread.join()
            return self.fc(x)

    converted = amp.auto_mixed_precision(Spawns(), "O1", "bf16")
    with Computes("addmm", "mm") as computes:
        converted(x)
        outside = F.linear(x, weight)
    assert other == [torch.float32]  # another thread, during the call: PyTorch's own
    assert outside.dtype == torch.float32
    assert computes.seen == {"addmm": [BF16], "mm": [torch.float32]}  # (this thread only)


def test_an_error_mid_forward_leaves_the_dispatcher_as_it_was() -> None:
    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.fc(x)
            raise ValueError("boom")

    converted = amp.auto_mixed_precision(Fails(), "O1", "bf16")
    included = torch._C._dispatch_tls_local_include_set()
    excluded = torch._C._dispatch_tls_local_exclude_set()
    with pytest.raises(ValueError, match="boom"):
        converted(torch.randn(2, 4))
    assert torch._C._dispatch_tls_local_include_set() == included
    assert torch._C._dispatch_tls_local_exclude_set() == excluded
    assert dispatch._LOCAL.state is None
    assert F.linear(torch.randn(2, 4), torch.randn(4, 4)).dtype == torch.float32


def test_a_list_op_no_aten_operator_stands_for_runs_under_the_mode() -> None:
    """``F.normalize`` is Python calling several operators: the list then runs as the
    torch-function mode, which sees the function itself."""
    model = nn.Sequential(nn.Linear(4, 4))
    white: list[Any] = [nn.Linear, F.normalize]
    converted = amp.custom_mixed_precision(model, white_list=white, dtype="bf16")
    assert not _region(converted).kernels

    class Normalizes(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.normalize(x, dim=-1)

    converted = amp.custom_mixed_precision(Normalizes(), white_list=white, dtype="bf16")
    with Computes("linalg_vector_norm") as computes:
        out = converted(torch.randn(2, 4))
    assert computes.seen == {"linalg_vector_norm": [BF16]}
    assert out.dtype == torch.float32


def test_an_operator_pytorch_builds_from_a_listed_one_computes_that_part_low() -> None:
    """Decided at ATen's operator level, as ``torch.autocast`` decides: ``tensordot`` calls
    ``mm``, which computes low; its result comes back float32."""

    class Dot(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.tensordot(a, b, dims=1)

    converted = amp.auto_mixed_precision(Dot(), "O1", "bf16")
    with Computes("mm") as computes:
        out = converted(torch.randn(3, 4), torch.randn(4, 5))
    assert computes.seen == {"mm": [BF16]}
    assert out.dtype == torch.float32


class _Tagged(torch.Tensor):
    """A wrapper tensor subclass with dispatch rules of its own (as torchao's float8
    tensors and DTensor have): it records the dtypes its ``mm`` calls are given (its
    results are plain tensors)."""

    seen: ClassVar[list[tuple[torch.dtype, ...]]] = []

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> _Tagged:
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype)  # type: ignore[attr-defined,no-any-return]

    def __init__(self, elem: torch.Tensor) -> None:
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        def unwrap(value: Any) -> Any:
            return value.elem if isinstance(value, _Tagged) else value

        args = torch.utils._pytree.tree_map(unwrap, args)
        kwargs = torch.utils._pytree.tree_map(unwrap, kwargs or {})
        if func.overloadpacket.__name__ == "mm":
            cls.seen.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
        return func(*args, **kwargs)


def test_a_listed_op_on_a_tensor_subclass_of_its_own_keeps_its_rules() -> None:
    """A listed op with an operand that has dispatch rules of its own (also one inside a
    TensorList) is handed on as it came: no operand cast, no result cast back."""

    class Products(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = _Tagged(torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.mm(x, self.w) + torch.einsum("ij,jk->ik", x, self.w)

    model = Products()
    converted = amp.auto_mixed_precision(model, "O1", "bf16")
    assert _region(converted).kernels
    x = torch.randn(2, 4)
    _Tagged.seen.clear()
    out, casts = count_casts(converted, x)
    assert _Tagged.seen == [(torch.float32, torch.float32)]
    assert casts.total == 0
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)  # einsum's part float32 too


def test_each_conversion_applies_its_own_list() -> None:
    """The kernels are the process's, the lists each conversion's: an op another
    conversion lists runs as PyTorch runs it here."""

    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.matmul(self.fc(x), x.t())

    model = Both()
    everything = amp.auto_mixed_precision(model, "O1", "bf16")
    only_matmul = amp.custom_mixed_precision(model, white_list=[torch.matmul], dtype="bf16")
    assert _region(everything).kernels
    assert _region(only_matmul).kernels
    x = torch.randn(2, 4)
    with Computes("addmm", "mm") as computes:
        everything(x)
    assert computes.seen == {"addmm": [BF16], "mm": [BF16]}
    with Computes("addmm", "mm") as computes:
        only_matmul(x)
    assert computes.seen == {"addmm": [torch.float32], "mm": [BF16]}


def test_o1_runs_under_inference_mode() -> None:
    """An inference tensor has no version counter: it is cast at each use, never served
    from the call's memo (a write into it could not be seen)."""

    class Writes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.matmul(x, x.t())
            z = y @ x
            y.mul_(2)  # a write the next matmul must see
            return self.fc(z) + y @ x

    torch.manual_seed(0)
    model = Writes()
    x = torch.randn(3, 4)
    converted = amp.auto_mixed_precision(model, "O1", "bf16")
    with torch.no_grad():
        expected = converted(x)
    with torch.inference_mode():
        out = converted(x)
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)


def test_a_key_another_library_uses_leaves_o1_to_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key is used only where no one else registered kernels: here one PyTorch's own
    autocast uses, so O1 runs its list as the mode, with the same results."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    expected = amp.auto_mixed_precision(model, "O1", "bf16")(x)
    monkeypatch.setattr(dispatch, "_CANDIDATE_KEYS", ("AutocastCPU",))
    monkeypatch.setattr(dispatch, "_KERNELS", None)
    converted = amp.auto_mixed_precision(model, "O1", "bf16")
    assert not _region(converted).kernels
    with Computes("addmm") as computes:
        out = converted(x)
    assert computes.seen == {"addmm": [BF16, BF16]}
    assert torch.equal(out, expected)


def test_a_mode_of_the_users_sees_each_listed_call_once() -> None:
    """A kernel computes its op by the op's Python binding (a faster call than the
    operator's own), never seen by a torch-function mode of the user's: the mode sees the
    calls the model makes, as on the original, and the results are the same with it on."""
    from torch.overrides import TorchFunctionMode

    class Records(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = getattr(func, "__name__", "")
            if name in ("linear", "addmm", "matmul", "bmm", "mm"):
                self.names.append(name)
            return func(*args, **(kwargs or {}))

    class Calls(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.addmm(self.fc.bias, self.fc(x), self.w)
            return torch.matmul(y, self.w) + F.linear(y, self.w)

    torch.manual_seed(0)
    model = Calls()
    x = torch.randn(2, 4)
    with Records() as original:
        model(x)
    converted = amp.auto_mixed_precision(model, "O1", "bf16")
    assert _region(converted).kernels
    plain = converted(x)
    with Records() as seen:
        out = converted(x)
    assert seen.names == original.names == ["linear", "addmm", "matmul", "linear"]
    assert torch.equal(out, plain)
    with Computes("addmm", "mm", "matmul") as computes:
        converted(x)
    assert set(computes.seen["addmm"]) == {BF16}


def test_a_one_call_layer_inside_a_block_set_aside_leaves_the_kernels_aside() -> None:
    """A Linear or ReLU making its one call directly sets the kernels' key aside for it and
    puts back what it found: inside a block where the kernels already stand aside (a child
    with casts of its own), the ops after it are still left to PyTorch."""

    class Aside(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.relu = nn.ReLU()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with dispatch.aside():
                h = self.relu(self.fc(x))
                assert torch._C._dispatch_tls_is_dispatch_key_excluded(dispatch.key())
                after = torch.mm(h, self.w)  # (left to PyTorch: float32)
            assert not torch._C._dispatch_tls_is_dispatch_key_excluded(dispatch.key())
            return after + torch.mm(h, self.w)  # (listed: low, cast back)

    converted = amp.auto_mixed_precision(Aside(), "O1", "bf16")
    assert _region(converted).kernels
    with Computes("mm", "addmm") as computes:
        out = converted(torch.randn(2, 4))
    assert computes.seen["mm"] == [torch.float32, BF16]
    assert out.dtype == torch.float32
