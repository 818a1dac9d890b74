"""O1 and the autocast level: the user's code run under the lists, the casts it makes, the plan."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec as amp
from helpers import MLP, ConvBranch, SmallCNN, TinyTransformer, count_casts, rel_error
from mixprec.convert.plan import RowKind

BF16_TOL = 3e-2  # relative error of a small network in bfloat16 against float32


# ----------------------------------------------------------------------------- O1


def test_o1_conv_relu_conv_casts_each_value_once_per_dtype() -> None:
    torch.manual_seed(0)
    model = ConvBranch().eval()
    x = torch.randn(2, 3, 8, 8)
    converted = amp.auto_mixed_precision(model, "O1", "bf16")
    out, counter = count_casts(converted, x)
    # down: x and the two convs' weights and biases; the relu and conv2 take the low
    # originals of conv1's and relu's results (no second cast down); up: each white-list
    # result once (conv1's for the bn branch, relu's, conv2's for the sum)
    assert counter.casts == {(torch.float32, torch.bfloat16): 5, (torch.bfloat16, torch.float32): 3}
    assert amp.explain(converted, x).num_casts == counter.total
    assert out.dtype == torch.float32
    assert rel_error(out, model(x)) < BF16_TOL


def test_o1_white_ops_compute_low_and_the_rest_fp32() -> None:
    seen: dict[str, torch.dtype] = {}

    class Spy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.norm = nn.LayerNorm(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(x)
            z = self.norm(y)
            return torch.matmul(z, self.fc.weight) + y.exp()

    model = Spy()
    converted = amp.auto_mixed_precision(model, "O1", "bf16")
    dtypes: dict[str, torch.dtype] = {}

    class Watch(TorchDispatchMode):  # what each kernel computes in (below any cast back)
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in ("addmm", "native_layer_norm", "mm", "exp"):
                dtypes[name] = (out[0] if isinstance(out, tuple) else out).dtype
            return out

    with Watch():
        out = converted(torch.randn(2, 4))
    seen.update(dtypes)
    assert seen == {
        "addmm": torch.bfloat16,  # fc
        "native_layer_norm": torch.float32,
        "mm": torch.bfloat16,  # torch.matmul
        "exp": torch.float32,
    }
    assert out.dtype == torch.float32
    for p, q in zip(model.parameters(), converted.parameters(), strict=True):
        assert p is q
        assert p.dtype == torch.float32


def test_o1_ops_in_helper_methods_compute_low() -> None:
    class Helper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def project(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.project(x).softmax(-1)

    model = Helper()
    converted = amp.auto_mixed_precision(model, "O1", "bf16")
    x = torch.randn(3, 4)
    out, counter = count_casts(converted, x)
    # x and w down for the matmul, its result up for the softmax
    assert counter.casts == {(torch.float32, torch.bfloat16): 2, (torch.bfloat16, torch.float32): 1}
    assert rel_error(out, model(x)) < BF16_TOL


class IfElse(nn.Module):
    """MindSpore's O1 case: convs chosen by data-dependent control flow."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_a = nn.Conv2d(3, 4, 3, padding=1)
        self.conv_b = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv_a(x) if x.mean() > 0 else self.conv_b(x)
        return self.head(torch.relu(y)).mean(dim=(2, 3))


class Straight(IfElse):
    """The traceable twin of IfElse (always the first branch)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv_a(x))).mean(dim=(2, 3))


@pytest.mark.parametrize("level", ["O1", "autocast"])
def test_untraceable_module_matches_its_traceable_twin(level: str) -> None:
    torch.manual_seed(0)
    branchy = IfElse().eval()
    straight = Straight().eval()
    straight.load_state_dict(branchy.state_dict())
    x = torch.rand(2, 3, 6, 6) + 0.1  # mean > 0: the first branch
    a = amp.auto_mixed_precision(branchy, level, "bf16")
    b = amp.auto_mixed_precision(straight, level, "bf16")
    # the model's own code runs: data-dependent branches are just Python
    assert amp.explain(a).runtime_parts == amp.explain(b).runtime_parts == ()
    out_a, out_b = a(x), b(x)
    assert out_a.dtype == out_b.dtype
    torch.testing.assert_close(out_a, out_b, rtol=0, atol=0)
    assert rel_error(out_a.float(), branchy(x)) < BF16_TOL


def test_exception_inside_an_untraceable_forward_leaves_no_mode_active() -> None:
    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(x)
            if y.sum() > -1e9:
                raise RuntimeError("inside")
            return y

    converted = amp.auto_mixed_precision(nn.Sequential(nn.Linear(4, 4), Fails()), "O1", "bf16")
    with pytest.raises(RuntimeError, match="inside"):
        converted(torch.randn(2, 4))
    assert torch.overrides._get_current_function_mode_stack() == []
    assert torch.matmul(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float32


def test_runtime_part_applies_lists_to_its_own_ops() -> None:
    class Dynamic(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(int(x.abs().sum() > 0) + 1):  # data-dependent loop
                x = torch.relu(x @ self.w)
            return x.exp()

    seen: list[torch.dtype] = []
    model = Dynamic()
    converted = amp.auto_mixed_precision(model, "O1", "bf16")
    converted.register_forward_hook(lambda m, a, o: seen.append(o.dtype))
    x = torch.randn(2, 4)
    out, counter = count_casts(converted, x)
    assert out.dtype == torch.float32
    assert counter.total > 0  # matmul and relu were cast to bfloat16 at run time
    assert counter.casts[(torch.float32, torch.bfloat16)] >= 2
    assert rel_error(out, model(x)) < 4 * BF16_TOL


# ---------------------------------------------------------------- cast counts


def _models() -> list[tuple[str, nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    return [
        ("mlp", MLP(), torch.randn(4, 16)),
        ("cnn_bn", SmallCNN().eval(), torch.randn(2, 3, 8, 8)),
        (
            "encoder",
            nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True).eval(),
            torch.randn(2, 5, 16),
        ),
        ("transformer", TinyTransformer().eval(), torch.randint(0, 50, (2, 7))),
    ]


@pytest.mark.parametrize(("name", "model", "x"), _models(), ids=[m[0] for m in _models()])
def test_autocast_level_casts_as_torch_autocast(
    name: str, model: nn.Module, x: torch.Tensor
) -> None:
    converted = amp.auto_mixed_precision(model, "autocast", "bf16")
    ours, our_count = count_casts(converted, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        theirs, their_count = count_casts(model, x)
    # the level runs the model under torch.autocast itself: the same casts, the same result
    assert our_count.total == their_count.total
    assert ours.dtype == theirs.dtype
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize(("name", "model", "x"), _models(), ids=[m[0] for m in _models()])
def test_o1_does_exactly_what_its_plan_says(name: str, model: nn.Module, x: torch.Tensor) -> None:
    converted = amp.auto_mixed_precision(model, "O1", "bf16")
    out, counter = count_casts(converted, x)
    assert counter.total == amp.explain(converted, x).num_casts
    assert out.dtype == torch.float32
    assert rel_error(out, model(x)) < BF16_TOL
    # minimal: at most one cast down per floating weight and input, one cast up per
    # white-list result (a low result feeding the next white-list op is not cast again)
    weights = sum(1 for p in model.parameters() if p.is_floating_point())
    assert counter.casts[(torch.float32, torch.bfloat16)] <= weights + 1


def test_o1_cast_count_of_an_mlp_is_the_closed_form() -> None:
    # Linear-ReLU-Linear-ReLU-Linear: input, 3 weights, 3 biases down (each relu and
    # linear takes the low original of the result before it); every result up once
    converted = amp.auto_mixed_precision(MLP(), "O1", "bf16")
    _, counter = count_casts(converted, torch.randn(4, 16))
    assert counter.casts == {(torch.float32, torch.bfloat16): 7, (torch.bfloat16, torch.float32): 5}


def test_an_activation_feeding_q_k_v_is_cast_once() -> None:
    class QKV(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x * 2.0
            return F.scaled_dot_product_attention(self.q(x), self.k(x), self.v(x))

    model = QKV()
    x = torch.randn(2, 3, 8)
    converted = amp.auto_mixed_precision(model, "autocast", "bf16")
    _, ours = count_casts(converted, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, theirs = count_casts(model, x)
    # the level is torch.autocast itself: x is cast once per projection, as there
    assert ours.total == theirs.total
    assert amp.explain(converted).num_casts == 6  # the static view: three weights, three biases


# ------------------------------------------------------- autocast level vs torch.autocast


def _op_cases() -> list[tuple[str, Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]]:
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    img, w = torch.randn(1, 3, 6, 6), torch.randn(4, 3, 3, 3)
    target = torch.tensor([0, 1, 2, 3])
    return [
        ("linear", lambda x, y: F.linear(x, y), (a, b)),
        ("matmul", lambda x, y: x @ y, (a, b)),
        ("mm", torch.mm, (a, b)),
        ("bmm", torch.bmm, (a[None], b[None])),
        ("addmm", lambda x, y: torch.addmm(x, x, y), (a, b)),
        ("conv2d", F.conv2d, (img, w)),
        ("einsum", lambda x, y: torch.einsum("ij,jk->ik", x, y), (a, b)),
        ("sdpa", lambda x, y: F.scaled_dot_product_attention(x[None], y[None], y[None]), (a, b)),
        ("softmax", lambda x: torch.softmax(x @ x, -1), (a,)),
        ("layer_norm", lambda x: F.layer_norm(x @ x, (4,)), (a,)),
        ("exp", lambda x: (x @ x).exp(), (a,)),
        ("cross_entropy", lambda x: F.cross_entropy(x @ x, target), (a,)),
        ("mse_loss", lambda x, y: F.mse_loss(x @ y, y), (a, b)),
        ("prod", lambda x: (x @ x).prod(dim=0), (a,)),
        ("cdist", lambda x, y: torch.cdist(x @ y, y), (a, b)),
        ("cat", lambda x, y: torch.cat([x @ y, y]), (a, b)),
        ("stack", lambda x, y: torch.stack([x @ y, y]), (a, b)),
        ("add", lambda x, y: (x @ y) + y, (a, b)),
        ("relu", lambda x: torch.relu(x @ x), (a,)),
        ("sum", lambda x: (x @ x).sum(), (a,)),
    ]


@pytest.mark.parametrize(("name", "fn", "inputs"), _op_cases(), ids=[c[0] for c in _op_cases()])
def test_autocast_level_makes_torch_autocast_decision(
    name: str, fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...]
) -> None:
    class Op(nn.Module):
        def forward(self, *args: torch.Tensor) -> torch.Tensor:
            return fn(*args)

    converted = amp.auto_mixed_precision(Op(), "autocast", "bf16")
    ours = converted(*inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = Op()(*inputs)
    assert ours.dtype == theirs.dtype, name
    torch.testing.assert_close(ours, theirs, rtol=1.6e-2, atol=1e-2)


def test_promote_ops_run_in_the_widest_input_type() -> None:
    class Cat(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.index_copy(x @ x, 0, torch.tensor([0]), y)

    converted = amp.auto_mixed_precision(Cat(), "autocast", "bf16")
    out = converted(torch.randn(2, 2), torch.randn(1, 2))
    assert out.dtype == torch.float32  # bf16 matmul result promoted to meet the fp32 source


# --------------------------------------------------------------------- coverage


class Everything(nn.Module):
    """Keyword inputs, several nested outputs, non-tensor and int/bool/float64 arguments,
    buffers, containers, a shared block used twice, MHA, LSTM and GRU."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.seq = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.heads = nn.ModuleDict({"a": nn.Linear(8, 2), "b": nn.Linear(8, 3)})
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.register_buffer("bias", torch.full((8,), 0.1))

    def forward(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        *,
        mask: torch.Tensor,
        f64: torch.Tensor,
        scale: float = 1.0,
        mode: str = "sum",
    ) -> dict[str, object]:
        h = self.shared(self.shared(x)) + self.bias
        h = self.seq(h) * scale
        for block in self.blocks:
            h = block(h)
        h, _ = self.attn(h, h, h, need_weights=False)
        h, _ = self.lstm(h)
        h, _ = self.gru(h)
        pooled = h.sum(1) if mode == "sum" else h.mean(1)
        return {
            "a": self.heads["a"](pooled),
            "nested": (self.heads["b"](pooled), [ids + 1, mask & True]),
            "f64": f64 * 2,
            "mode": mode,
        }


@pytest.mark.parametrize("level", ["O1", "autocast"])
def test_everything_model(level: str) -> None:
    torch.manual_seed(0)
    model = Everything().eval()
    args = (torch.randn(2, 5, 8), torch.arange(3))
    kwargs = {
        "mask": torch.tensor([True, False]),
        "f64": torch.ones(2, dtype=torch.float64),
        "scale": 0.5,
    }
    expected = model(*args, **kwargs)
    converted = amp.auto_mixed_precision(model, level, "bf16")
    out = converted(*args, **kwargs)
    float_out = torch.float32 if level == "O1" else torch.bfloat16
    assert out["a"].dtype == float_out
    assert out["nested"][0].dtype == float_out
    assert out["nested"][1][0].dtype == torch.int64
    assert out["nested"][1][1].dtype == torch.bool
    assert out["f64"].dtype == torch.float64
    assert out["mode"] == "sum"
    assert rel_error(out["a"].float(), expected["a"]) < 2 * BF16_TOL
    assert sorted(converted.state_dict()) == sorted(model.state_dict())
    plan = amp.explain(converted)
    units = {row.path for row in plan.rows if row.kind is RowKind.UNIT}
    assert {"attn", "lstm", "gru"} <= units
    shared_casts = [c for row in plan.rows for c in row.casts_before if c.value == "shared.weight"]
    assert len(shared_casts) == 1  # the shared block's weight: one row of the static view


def test_print_deepcopy_pickle_state_dict() -> None:
    torch.manual_seed(0)
    model = SmallCNN().eval()
    model.register_buffer("unused", torch.ones(2))
    model.register_buffer("scratch", torch.ones(3), persistent=False)
    converted = amp.auto_mixed_precision(model, "O1", "bf16")
    assert "mixprec: level=O1, dtype=bfloat16" in repr(converted)
    assert list(converted.state_dict()) == list(model.state_dict())
    x = torch.randn(2, 3, 6, 6)
    expected = converted(x)
    buffer = io.BytesIO()
    torch.save(converted, buffer)
    buffer.seek(0)
    for other in (
        copy.deepcopy(converted),
        pickle.loads(pickle.dumps(converted)),
        torch.load(buffer, weights_only=False),
    ):
        assert torch.equal(other(x), expected)
        assert list(other.state_dict()) == list(model.state_dict())
        assert amp.explain(other).num_casts == amp.explain(converted).num_casts
        assert type(other.forward).__name__ == "ListedForward"  # still converted
        assert count_casts(other, x)[1].casts == count_casts(converted, x)[1].casts


def test_compile_and_export() -> None:
    torch.manual_seed(0)
    converted = amp.auto_mixed_precision(MLP((8, 8, 4)), "O1", "bf16")
    x = torch.randn(2, 8)
    expected = converted(x)
    compiled = torch.compile(converted, backend="eager")
    assert torch.equal(compiled(x), expected)
    exported = torch.export.export(converted, (x,))
    assert torch.equal(exported.module()(x), expected)


# ------------------------------------------------------------------ custom lists


def my_scale(x: torch.Tensor) -> torch.Tensor:
    """A function of the user's own."""
    return x * 3.0


class ScaledNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(my_scale(self.norm(self.fc(x))))


def test_custom_white_list_with_classes_and_functions() -> None:
    converted = amp.custom_mixed_precision(
        ScaledNorm(), white_list=[nn.LayerNorm, torch.tanh], dtype="bf16"
    )
    x = torch.randn(2, 4)
    out, counter = count_casts(converted, x)
    # the norm runs whole low (its input, weight and bias down, its result up); tanh
    # takes my_scale's float32 result down and returns float32; the Linear is not listed
    assert counter.casts == {(torch.float32, torch.bfloat16): 4, (torch.bfloat16, torch.float32): 2}
    assert out.dtype == torch.float32
    assert torch.equal(out, out.to(torch.bfloat16).float())  # tanh computed low


def test_a_function_of_the_users_own_on_a_white_list_is_refused() -> None:
    with pytest.raises(ValueError, match=r"white_list holds my_scale.*torch functions"):
        amp.custom_mixed_precision(ScaledNorm(), white_list=[torch.tanh, my_scale], dtype="bf16")


def test_pins_beat_the_lists() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
    by_path = amp.auto_mixed_precision(model, "O1", "bf16", fp32_modules=["0"], low_modules=["1"])
    rows = {row.path: row.dtype for row in amp.explain(by_path).rows}
    assert rows == {"0": "float32", "1": "bfloat16"}  # "1" runs whole low, its norm too
    by_filter = amp.auto_mixed_precision(
        model, "autocast", "bf16", fp32_modules=lambda module, name: isinstance(module, nn.Linear)
    )
    rows = {row.path: row.dtype for row in amp.explain(by_filter).rows if row.op == "linear"}
    assert rows == {"0": "float32", "1.0": "float32"}


# -------------------------------------------------------------------------- plan


def test_plan_table_and_dict() -> None:
    converted = amp.auto_mixed_precision(SmallCNN(), "O1", "bf16")
    plan = amp.explain(converted)
    table = str(plan)
    lines = table.splitlines()
    assert lines[0].startswith("cast plan: level O1, bfloat16")
    header = lines[1]
    assert header.split() == ["path", "op", "computes", "in", "casts", "before", "casts", "after"]
    assert lines[-1].startswith(f"totals: {plan.num_casts} casts per forward")
    column = header.index("computes in")
    assert all(line[column - 2 : column] == "  " for line in lines[3:-1])  # aligned
    data = plan.to_dict()
    assert data["totals"]["casts_per_forward"] == plan.num_casts
    assert len(data["rows"]) == len(plan.rows)
    assert {"path", "op", "dtype", "casts_before", "casts_after", "note"} <= set(data["rows"][0])


def test_o1_data_movement_between_low_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reshape/permute between two low ops (attention heads) moves float32 values: the
    views of a white-list result are cast down again where the next white-list op uses
    them; with no gradient to keep on the views' path (inference), each is taken as the
    same view of the low result instead, with no cast and the same values, where making
    the view costs less than the cast (not a small CPU tensor)."""
    from mixprec.convert import runtime

    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(16, 48)
            self.out = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, c = x.shape
            q, k, v = self.qkv(x).reshape(b, t, 3, 4, c // 4).permute(2, 0, 3, 1, 4).unbind(0)
            y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, c)
            return self.out(y) + x

    model = Heads()
    x = torch.randn(2, 5, 16)
    converted = amp.auto_mixed_precision(model, "O1", "bf16")
    out, counter = count_casts(converted, x)
    # down: x, the 4 weights, q, k, v and the attention output's view; up: each result
    assert counter.casts == {(torch.float32, torch.bfloat16): 9, (torch.bfloat16, torch.float32): 3}
    assert amp.explain(converted, x).num_casts == counter.total
    assert rel_error(out, model(x)) < BF16_TOL
    with torch.no_grad():
        cast, counter = count_casts(converted, x)
        assert amp.explain(converted, x).num_casts == counter.total
    # small CPU views: cast, as with gradients
    assert counter.casts == {(torch.float32, torch.bfloat16): 9, (torch.bfloat16, torch.float32): 3}
    assert torch.equal(cast, out)
    monkeypatch.setattr(runtime, "_CPU_VIEW_MIN", 0)  # (as a large or a GPU tensor's)
    with torch.no_grad():
        viewed, counter = count_casts(converted, x)
        assert amp.explain(converted, x).num_casts == counter.total
    # down: x and the 4 weights; q, k, v and the output's view are views of low results
    assert counter.casts == {(torch.float32, torch.bfloat16): 5, (torch.bfloat16, torch.float32): 3}
    assert torch.equal(viewed, out)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_o1_a_view_of_a_value_written_since_its_cast_is_cast_afresh(
    grad: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mixprec.convert import runtime

    monkeypatch.setattr(runtime, "_CPU_VIEW_MIN", 0)  # (views taken as views of the cast)

    class Writes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(x)
            heads = y.view(2, 2, 4)
            first = torch.matmul(heads, heads.transpose(1, 2))  # views of the low result
            y.mul_(3)  # a write through the float32 result: the views now differ from it
            return first.sum() + torch.matmul(heads, heads.transpose(1, 2)).sum()

    torch.manual_seed(0)
    model = Writes()
    x = torch.randn(2, 4)
    with torch.set_grad_enabled(grad):
        out = amp.auto_mixed_precision(model, "O1", "bf16")(x)
    with torch.no_grad():
        y = F.linear(x.bfloat16(), model.fc.weight.bfloat16(), model.fc.bias.bfloat16()).float()
        heads = y.view(2, 2, 4).bfloat16()
        first = torch.matmul(heads, heads.transpose(1, 2)).float().sum()
        heads3 = (y * 3).view(2, 2, 4).bfloat16()
        second = torch.matmul(heads3, heads3.transpose(1, 2)).float().sum()
    assert torch.equal(out, first + second)


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.l1(x)
        if mask is not None:
            h = h.masked_fill(mask, 0.0)
        return self.l2(h)


def test_calls_with_other_arguments_run_the_code_they_reach() -> None:
    torch.manual_seed(0)
    model = Masked()
    x, mask = torch.randn(3, 8), torch.rand(3, 8) > 0.5
    converted = amp.auto_mixed_precision(model, "O1", "bf16")
    plain, counter = count_casts(converted, x)
    assert counter.total == amp.explain(converted, x).num_casts
    masked = converted(x, mask)
    assert rel_error(plain.float(), model(x)) < BF16_TOL
    assert rel_error(masked.float(), model(x, mask)) < BF16_TOL
    assert not torch.equal(plain, masked)
    for other in (copy.deepcopy(converted), pickle.loads(pickle.dumps(converted))):
        assert torch.equal(other(x), plain)
        assert torch.equal(other(x, mask), masked)


# ------------------------------------------------------- regressions found in review


class EmaNoGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("ema", torch.ones(8))
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(h.mean(0) * 0.1)
        self.seen += 1
        return self.l2(h) + self.ema


@pytest.mark.parametrize("level", ["O1", "autocast"])
def test_buffer_updates_and_no_grad_blocks_are_not_lost(level: str) -> None:
    torch.manual_seed(0)
    model = EmaNoGrad()
    reference = copy.deepcopy(model)
    before = copy.deepcopy(model.state_dict())
    converted = amp.auto_mixed_precision(model, level, "bf16")
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key  # converting ran nothing on real buffers
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(4, 8)
        for net, opt in ((converted, optimizer), (reference, reference_opt)):
            opt.zero_grad()
            net(x).sum().backward()  # would fail twice if the no_grad block were lost
            opt.step()
    assert float(model.seen) == 3.0
    torch.testing.assert_close(model.ema, reference.ema, rtol=2e-2, atol=2e-2)


class MutateAfterLinear(nn.Module):
    def __init__(self, inplace_act: bool) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)
        self.inplace_act = inplace_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        if self.inplace_act:
            self.act(h)  # the result is dropped: h itself is relied on to change
            return self.l2(h) + h
        h.mul_(2.0)
        return self.l2(h)


@pytest.mark.parametrize("inplace_act", [False, True], ids=["mul_", "relu-inplace"])
@pytest.mark.parametrize("level", ["O1", "autocast"])
def test_in_place_writes_are_respected(level: str, inplace_act: bool) -> None:
    torch.manual_seed(0)
    model = MutateAfterLinear(inplace_act)
    x = torch.randn(4, 8)
    converted = amp.auto_mixed_precision(model, level, "bf16")
    assert rel_error(converted(x).float(), model(x)) < BF16_TOL


def test_an_argument_left_at_its_none_default() -> None:
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
            h = self.l1(x)
            if mask is not None:
                h = h.masked_fill(mask, 0.0)
            return self.l2(h)

    torch.manual_seed(0)
    model = Masked()
    x, mask = torch.randn(3, 8), torch.rand(3, 8) > 0.5
    for level in ("O1", "autocast"):
        converted = amp.auto_mixed_precision(model, level, "bf16")
        assert rel_error(converted(x).float(), model(x)) < BF16_TOL
        assert rel_error(converted(x, mask).float(), model(x, mask)) < BF16_TOL


def test_transposed_weights_are_cast() -> None:
    class TiedHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(20, 8)
            self.ln = nn.LayerNorm(8)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.ln(self.wte(ids)) @ self.wte.weight.T

    model = TiedHead()
    ids = torch.randint(0, 20, (2, 5))
    for level in ("O1", "autocast"):
        converted = amp.auto_mixed_precision(model, level, "bf16")
        out, counter = count_casts(converted, ids)
        assert rel_error(out.float(), model(ids)) < BF16_TOL
        if level == "O1":
            assert counter.total == amp.explain(converted, ids).num_casts
        else:
            with torch.autocast("cpu", torch.bfloat16):
                _, theirs = count_casts(model, ids)
            assert counter.total == theirs.total


def test_dataclass_outputs_are_fp32() -> None:
    from dataclasses import dataclass

    @dataclass
    class Out:
        logits: torch.Tensor
        hidden: torch.Tensor

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> Out:
            h = self.fc(x)
            return Out(logits=h * 2, hidden=h)

    for level in ("O1", "O2", "O3"):
        out = amp.auto_mixed_precision(Net(), level, "bf16")(torch.randn(2, 4))
        assert isinstance(out, Out)
        assert out.logits.dtype == out.hidden.dtype == torch.float32, level


def test_recurrent_unit_tuple_output_is_cast_where_used() -> None:
    class Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gru = nn.GRU(8, 16, batch_first=True)
            self.head = nn.Linear(16, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out, _ = self.gru(x)
            return self.head(out[:, -1])

    torch.manual_seed(0)
    model = Seq()
    x = torch.randn(4, 6, 8)
    converted = amp.auto_mixed_precision(model, "O1", "bf16")
    out, counter = count_casts(converted, x)
    assert counter.total == amp.explain(converted, x).num_casts
    # down: the input and 4 GRU weights, the last step's view, the head's weight and bias;
    # up: the GRU's sequence and state (the unit returns float32), the head's result
    assert counter.casts == {(torch.float32, torch.bfloat16): 8, (torch.bfloat16, torch.float32): 3}
    assert rel_error(out, model(x)) < BF16_TOL


def test_decision_tables_are_shared_between_parts_of_one_conversion() -> None:
    from mixprec.convert.runtime import decision_table
    from mixprec.policy.levels import resolve

    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    recipe = resolve(model, "O1", "bf16")
    cache: dict[Any, Any] = {}
    first = decision_table(recipe, (("", model),), cache=cache)
    again = decision_table(recipe, (("", model), ("1", model[1])), cache=cache)
    assert again[0] is first[0]
    assert len(cache) == 1
