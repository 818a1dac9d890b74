"""O0, O2 and O3: module-level conversion (cast at use, float32 islands, float32 outputs)."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec as amp
from helpers import MLP, CastCounter, SmallCNN, TinyTransformer, count_casts, rel_error

DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
LEVELS = ["O2", "O3"]
# relative error of a whole small network against float32: a few roundings of 8 (bf16) or
# 11 (fp16) mantissa bits, summed over the layers
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _record_compute_dtypes(model: nn.Module) -> tuple[dict[str, torch.dtype], list[object]]:
    """Forward hooks that record, per module with weights, the dtype of its weight and
    input *while it runs*."""
    seen: dict[str, torch.dtype] = {}
    handles = []
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is None:
            continue

        def hook(
            mod: nn.Module, args: tuple[torch.Tensor, ...], out: object, name: str = name
        ) -> None:
            seen[name] = mod.weight.dtype
            seen[name + ":input"] = args[0].dtype

        handles.append(module.register_forward_hook(hook))
    return seen, handles


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", LEVELS)
def test_modules_compute_in_the_level_dtype(level: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 6, 6)
    expected = model(x)
    converted = amp.auto_mixed_precision(model, level, dtype)
    seen, _ = _record_compute_dtypes(converted)
    out = converted(x)

    assert seen["conv1"] == dtype
    assert seen["conv1:input"] == dtype
    assert seen["conv2"] == dtype
    assert seen["fc"] == dtype
    # the norm keeps float32 weights and statistics; its hooks see what its caller passed
    # (as under torch.autocast): O2's island computes in float32 inside its kernel
    assert seen["bn1"] == torch.float32
    assert seen["bn1:input"] == dtype
    assert out.dtype == torch.float32
    assert rel_error(out, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", LEVELS)
def test_parameters_keep_dtype_and_identity_and_receive_fp32_grads(
    level: str, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    model = MLP((8, 16, 4))
    reference = copy.deepcopy(model)
    converted = amp.auto_mixed_precision(model, level, dtype)

    for (name, p), (_, q) in zip(
        model.named_parameters(), converted.named_parameters(), strict=True
    ):
        assert p is q, name
        assert q.dtype == torch.float32

    x = torch.randn(4, 8)
    converted(x).square().sum().backward()
    reference(x).square().sum().backward()
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None
        assert p.grad.dtype == torch.float32
        assert rel_error(p.grad, r.grad) < 4 * TOLERANCE[dtype]


def test_optimizer_built_before_conversion_trains_fp32_weights() -> None:
    torch.manual_seed(0)
    model = MLP((8, 16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    converted = amp.auto_mixed_precision(model, "O2", "bf16")
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = F.mse_loss(converted(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize("level", LEVELS)
def test_each_weight_cast_once_per_forward(level: str) -> None:
    """A weight used twice (a shared layer) is cast once; the count is exactly the plan's."""

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(8, 8)
            self.norm = nn.LayerNorm(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.layer(self.layer(x)))

    converted = amp.auto_mixed_precision(Shared(), level, "bf16")
    _, counter = count_casts(converted, torch.randn(2, 8))
    # inputs (1) + layer.weight, layer.bias (2) + output (1); O2's LayerNorm island takes
    # its low input in one kernel on CPU (no cast); O3 casts its weight and bias (2)
    assert counter.total == {"O2": 4, "O3": 6}[level]
    assert counter.total == amp.explain(converted).num_casts


@pytest.mark.parametrize(
    ("model", "x", "expected"),
    [
        # MLP 16-32-32-8: input + 3 weights + 3 biases + output
        pytest.param(MLP(), torch.randn(4, 16), {"O2": 8, "O3": 8}, id="mlp"),
        # CNN: input + 2 conv weights + fc weight + fc bias + output = 6; the BNs take their
        # low input with their float32 state in one kernel (O2: a float32 island, O3: low)
        pytest.param(SmallCNN().eval(), torch.randn(2, 3, 8, 8), {"O2": 6, "O3": 6}, id="cnn"),
    ],
)
@pytest.mark.parametrize("level", LEVELS)
def test_cast_count_per_forward(
    model: nn.Module, x: torch.Tensor, expected: dict[str, int], level: str
) -> None:
    converted = amp.auto_mixed_precision(model, level, "bf16")
    _, counter = count_casts(converted, x)
    assert counter.total == expected[level]
    assert amp.explain(converted).num_casts == expected[level]


def test_every_call_casts_afresh_so_data_writes_are_seen() -> None:
    model = MLP()
    converted = amp.auto_mixed_precision(model, "O2", "bf16")
    x = torch.randn(4, 16)
    with torch.no_grad():
        first, c1 = count_casts(converted, x)
        second, c2 = count_casts(converted, x)
        model.net[0].weight.data.mul_(2.0)  # bumps no version counter
        third = converted(x)
    assert c1.total == c2.total == 8
    assert torch.equal(first, second)
    assert not torch.equal(third, second)


@pytest.mark.parametrize("level", LEVELS)
def test_batchnorm_running_stats_stay_fp32_and_update(level: str) -> None:
    torch.manual_seed(0)
    model = SmallCNN()
    reference = copy.deepcopy(model)
    converted = amp.auto_mixed_precision(model, level, "bf16")
    x = torch.randn(4, 3, 6, 6) * 3 + 1
    converted(x)
    reference(x)
    for name in ("bn1", "bn2"):
        ours, ref = getattr(model, name), getattr(reference, name)
        assert ours.running_mean.dtype == torch.float32
        assert ours.running_var.dtype == torch.float32
        assert int(ours.num_batches_tracked) == 1
        assert not torch.equal(ours.running_mean, torch.zeros_like(ours.running_mean))
        torch.testing.assert_close(ours.running_mean, ref.running_mean, rtol=0.05, atol=0.05)
        torch.testing.assert_close(ours.running_var, ref.running_var, rtol=0.05, atol=0.05)


def test_o0_returns_the_network_unchanged() -> None:
    model = MLP()
    assert amp.auto_mixed_precision(model) is model
    assert amp.auto_mixed_precision(model, "O0", "bf16") is model


def test_nested_outputs_are_all_fp32() -> None:
    class Outputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(
            self, x: torch.Tensor, ids: torch.Tensor, scale: float = 2.0
        ) -> dict[str, object]:
            y = self.fc(x) * scale
            return {"y": y, "pair": (y, [y.sum()]), "ids": ids + 1, "f64": x.double(), "text": "hi"}

    converted = amp.auto_mixed_precision(Outputs(), "O3", "bf16")
    ids = torch.arange(3)
    out = converted(torch.randn(3, 4), ids, scale=3.0)
    assert out["y"].dtype == torch.float32
    assert out["pair"][0].dtype == torch.float32
    assert out["pair"][1][0].dtype == torch.float32
    assert out["ids"].dtype == torch.int64
    assert out["text"] == "hi"


def test_int_bool_and_float64_inputs_are_never_cast() -> None:
    seen: dict[str, torch.dtype] = {}

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(
            self, x: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, f64: torch.Tensor
        ) -> torch.Tensor:
            seen.update(x=x.dtype, ids=ids.dtype, mask=mask.dtype, f64=f64.dtype)
            return self.fc(x)[mask] + ids.sum() + f64.sum().float()

    converted = amp.auto_mixed_precision(Probe(), "O2", "bf16")
    converted(
        torch.randn(3, 4),
        torch.arange(3),
        torch.tensor([True, False, True]),
        f64=torch.ones(2, dtype=torch.float64),
    )
    assert seen == {
        "x": torch.bfloat16,
        "ids": torch.int64,
        "mask": torch.bool,
        "f64": torch.float64,
    }


def test_float64_parameters_are_never_cast_down() -> None:
    model = nn.Linear(3, 3).double()
    converted = amp.auto_mixed_precision(model, "O3", "bf16")
    out = converted(torch.randn(2, 3, dtype=torch.float64))
    assert out.dtype == torch.float64


def test_state_dict_round_trip_under_original_keys() -> None:
    model = SmallCNN()
    converted = amp.auto_mixed_precision(model, "O2", "bf16")
    assert list(converted.state_dict()) == list(model.state_dict())
    other = SmallCNN()
    fresh = amp.auto_mixed_precision(other, "O2", "bf16")
    fresh.load_state_dict(converted.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key
    # and the converted model's state loads into a plain model
    plain = SmallCNN()
    plain.load_state_dict(converted.state_dict())


def test_original_is_not_modified() -> None:
    model = SmallCNN()
    before = repr(model)
    hooks = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    amp.auto_mixed_precision(model, "O2", "bf16")
    assert repr(model) == before
    assert [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()] == hooks
    assert "forward" not in model.__dict__
    assert model(torch.randn(1, 3, 4, 4)).dtype == torch.float32


def test_repr_shows_level_and_dtype() -> None:
    converted = amp.auto_mixed_precision(MLP(), "O2", "fp16")
    assert "mixprec: level=O2, dtype=float16" in repr(converted)
    assert isinstance(converted, MLP)


@pytest.mark.parametrize("level", LEVELS)
def test_deepcopy_and_pickle(level: str) -> None:
    torch.manual_seed(0)
    converted = amp.auto_mixed_precision(SmallCNN().eval(), level, "bf16")
    x = torch.randn(2, 3, 5, 5)
    expected = converted(x)
    clone = copy.deepcopy(converted)
    buffer = io.BytesIO()
    torch.save(converted, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    unpickled = pickle.loads(pickle.dumps(converted))
    for other in (clone, loaded, unpickled):
        assert torch.equal(other(x), expected)
        assert amp.explain(other).num_casts == amp.explain(converted).num_casts
        other_params = set(map(id, other.parameters()))
        assert not other_params & set(map(id, converted.parameters()))  # a real copy


def test_converting_twice_is_refused() -> None:
    converted = amp.auto_mixed_precision(MLP(), "O2")
    with pytest.raises(ValueError, match="already converted by mixprec"):
        amp.auto_mixed_precision(converted, "O3")
    outer = nn.Sequential(converted, nn.ReLU())
    with pytest.raises(ValueError, match=r"its submodule '0'"):
        amp.auto_mixed_precision(outer, "O1")


def test_failure_mid_forward_leaves_parameters_in_place() -> None:
    class Boom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.fc(x)
            raise RuntimeError("boom")

    model = Boom()
    weight = model.fc.weight
    converted = amp.auto_mixed_precision(model, "O2", "bf16")
    with pytest.raises(RuntimeError, match="boom"):
        converted(torch.randn(2, 4))
    assert converted.fc.weight is weight
    assert converted.fc.weight.dtype == torch.float32


def test_recurrent_layers_use_the_cast_weights() -> None:
    torch.manual_seed(0)
    model = nn.LSTM(4, 8, batch_first=True)
    converted = amp.auto_mixed_precision(model, "O2", "bf16")
    x = torch.randn(2, 5, 4)
    out, (h, _c) = converted(x)
    expected, _ = model(x)
    assert out.dtype == h.dtype == torch.float32
    assert rel_error(out, expected) < TOLERANCE[torch.bfloat16]
    assert model.weight_ih_l0.dtype == torch.float32
    with CastCounter() as counter:
        converted(x)
    assert counter.total == 1 + 4 + 3  # input, four weights, three outputs


def test_pins_override_the_black_list() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4))
    seen: dict[str, torch.dtype] = {}
    converted = amp.auto_mixed_precision(model, "O2", "bf16", low_modules=["1"], fp32_modules=["2"])
    converted[1].register_forward_hook(lambda m, a, o: seen.update(norm=m.weight.dtype))
    converted[2].register_forward_hook(
        lambda m, a, o: seen.update(last=m.weight.dtype, last_in=a[0].dtype)
    )
    out = converted(torch.randn(2, 4))
    # the pinned Linear's hooks see what its caller passed; it computes in float32
    assert seen == {"norm": torch.bfloat16, "last": torch.float32, "last_in": torch.bfloat16}
    assert out.dtype == torch.float32


def test_torchvision_style_cnn_and_transformer_train_at_o2_and_o3() -> None:
    torch.manual_seed(0)
    for level in LEVELS:
        cnn = SmallCNN(classes=3)
        optimizer = torch.optim.Adam(cnn.parameters(), lr=1e-2)
        converted = amp.auto_mixed_precision(cnn, level, "bf16")
        x, y = torch.randn(16, 3, 6, 6), torch.randint(0, 3, (16,))
        first = last = 0.0
        for step in range(15):
            optimizer.zero_grad()
            loss = F.cross_entropy(converted(x), y)
            loss.backward()
            optimizer.step()
            first, last = (loss.item(), last) if step == 0 else (first, loss.item())
        assert last < 0.6 * first, (level, first, last)

        lm = TinyTransformer()
        optimizer = torch.optim.AdamW(lm.parameters(), lr=3e-3)
        converted = amp.auto_mixed_precision(lm, level, "bf16")
        tokens, labels = torch.randint(0, 50, (16, 6)), torch.randint(0, 5, (16,))
        losses = []
        for _ in range(15):
            optimizer.zero_grad()
            loss = F.cross_entropy(converted(tokens), labels)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[-1] < 0.6 * losses[0], (level, losses)


def test_buffers_updated_in_place_by_the_forward_are_written_back() -> None:
    class Tally(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("total", torch.zeros(()))
            self.register_buffer("offset", torch.full((4,), 0.5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.total.add_(x.sum())
            return x + self.offset

    model = Tally()
    converted = amp.auto_mixed_precision(model, "O3", "bf16")
    out = converted(torch.ones(2, 4))
    assert out.dtype == torch.float32
    assert model.total.dtype == torch.float32
    assert float(model.total) == 8.0  # written back
    assert torch.equal(model.offset, torch.full((4,), 0.5))  # read only: untouched


@pytest.mark.parametrize("level", LEVELS)
def test_export_and_compile(level: str) -> None:
    torch.manual_seed(0)
    converted = amp.auto_mixed_precision(SmallCNN().eval(), level, "bf16")
    x = torch.randn(2, 3, 6, 6)
    expected = converted(x)
    exported = torch.export.export(converted, (x,))
    assert torch.equal(exported.module()(x), expected)
    compiled = torch.compile(converted, backend="eager")
    assert torch.equal(compiled(x), expected)


@pytest.mark.parametrize("level", LEVELS)
def test_tensors_made_in_float32_inside_forward_reach_layers_low(level: str) -> None:
    """A timestep embedding built with torch.arange/float() (diffusion models) feeds a Linear."""

    class TimeEmbed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.mlp = nn.Sequential(nn.Linear(8, 8), nn.SiLU(), nn.Linear(8, 8))

        def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            freqs = torch.exp(-torch.arange(4) / 4.0)
            args = t[:, None].float() * freqs[None]
            return self.proj(x) + self.mlp(torch.cat([args.cos(), args.sin()], -1))

    torch.manual_seed(0)
    model = TimeEmbed()
    x, t = torch.randn(3, 8), torch.tensor([1, 5, 9])
    converted = amp.auto_mixed_precision(model, level, "bf16")
    out = converted(x, t)
    assert out.dtype == torch.float32
    assert rel_error(out, model(x, t)) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("level", LEVELS)
def test_counters_and_emas_in_buffers_keep_fp32_precision(level: str) -> None:
    class Stats(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("seen", torch.zeros(()))
            self.register_buffer("ema", torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.seen += 1
                self.ema.mul_(0.999).add_(0.001 * x.mean(0))
            return self.fc(x)

    model = Stats()
    reference = copy.deepcopy(model)
    converted = amp.auto_mixed_precision(model, level, "bf16")
    x = torch.ones(2, 4)
    for _ in range(300):
        converted(x)
        reference(x)
    assert float(model.seen) == 300.0  # bf16 counting would stall at 256
    # the increments come from a bfloat16 input (0.001 * x rounds), the sum stays float32:
    # summed in bfloat16 the EMA would stop moving (0.999 * ema rounds back to ema)
    torch.testing.assert_close(model.ema, reference.ema, rtol=2e-3, atol=0)
    assert model.ema.dtype == torch.float32


# ------------------------------------------------------------------ writes reach the masters


class _WritesCaller(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        state.add_(1.0)  # an in-place update of a tensor the caller passed
        return self.fc(x)


class _WritesOwnWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.fc.weight[0].fill_(0.5)  # an in-place write to a weight inside forward
        return self.fc(x)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("level", LEVELS)
def test_a_forward_that_writes_a_callers_tensor_writes_the_callers_tensor(
    level: str, dtype: str
) -> None:
    converted = amp.auto_mixed_precision(_WritesCaller(), level, dtype)
    state = torch.zeros(3)
    converted(torch.randn(2, 4), state)
    converted(torch.randn(2, 4), state)
    assert state.dtype == torch.float32
    assert torch.equal(state, torch.full((3,), 2.0))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("level", LEVELS)
def test_an_in_place_write_to_a_weight_inside_forward_is_kept(level: str, dtype: str) -> None:
    model = _WritesOwnWeight()
    untouched = model.fc.weight[1:].detach().clone()
    converted = amp.auto_mixed_precision(model, level, dtype)
    converted(torch.randn(2, 4))
    assert torch.equal(model.fc.weight[0], torch.full((4,), 0.5))
    assert torch.equal(model.fc.weight[1:], untouched)  # the rest keeps its float32 bits


class _WritesWeightAfterUse(nn.Module):
    """Calls its layer first (its weight's cast made for the layer's kernel alone), then
    writes into the weight it reads by name: in place, or by replacing its ``.data``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        weight = self.fc.weight
        with torch.no_grad():
            if self.how == "in place":
                weight[0].fill_(0.5)
            else:
                weight.data = torch.full_like(weight, 0.5)
        return out


@pytest.mark.parametrize("how", ["in place", "data"])
@pytest.mark.parametrize("level", LEVELS)
def test_a_write_into_a_weight_after_its_layer_ran_is_kept(level: str, how: str) -> None:
    """The cast a layer's own call made is the one its weight then reads by name: a write
    into it goes into the stored float32 weight, as it does before the layer runs."""
    model = _WritesWeightAfterUse(how)
    untouched = model.fc.weight[1:].detach().clone()
    converted = amp.auto_mixed_precision(model, level, "bf16")
    expected = amp.auto_mixed_precision(copy.deepcopy(model), level, "bf16").fc
    x = torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        out = converted(x)
    replaced = [w for w in warned if "replaced the .data of a Parameter's" in str(w.message)]
    assert len(replaced) == (how == "data")
    assert len(warned) == len(replaced)
    assert out.dtype == torch.float32
    assert torch.equal(out, expected(x))  # (computed before the write)
    assert model.fc.weight.dtype == torch.float32
    assert torch.equal(model.fc.weight[0], torch.full((4,), 0.5))
    if how == "in place":
        assert torch.equal(model.fc.weight[1:], untouched)  # the rest keeps its float32 bits


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("level", LEVELS)
def test_fused_optimizer_updates_are_what_the_next_forward_uses(level: str, dtype: str) -> None:
    """A fused optimizer writes the weights in one kernel; weights are cast afresh on
    every call, so the next forward computes with the updated values."""
    model = MLP()
    converted = amp.auto_mixed_precision(model, level, dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    x = torch.randn(4, 16)
    converted(x).sum().backward()
    optimizer.step()
    reference = amp.auto_mixed_precision(model, level, dtype)  # a fresh conversion
    assert torch.equal(converted(x), reference(x))
    direct = converted.net[0](x)  # a submodule called directly: current weights too
    assert torch.equal(direct, reference.net[0](x))


class _Recording(nn.Linear):
    seen: list[torch.dtype]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.seen.append(out.dtype)  # what it computed in (before any cast back)
        return out


class _PinnedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = _Recording(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(x)))


@pytest.mark.parametrize("level", LEVELS)
def test_float32_islands_hold_inside_an_outer_autocast_which_warns_once(level: str) -> None:
    converted = amp.auto_mixed_precision(_PinnedHead(), level, "bf16", fp32_modules=["head"])
    converted.head.seen = []
    x = torch.randn(3, 4)
    warned = pytest.warns(UserWarning, match="runs under an outer torch.autocast")
    with warned, torch.autocast("cpu", torch.bfloat16):
        converted(x)
    assert converted.head.seen == [torch.float32]  # the pin holds: autocast is off inside it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", torch.bfloat16):
            converted(x)  # once per conversion


class _Keeps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.config = {"scale": 1.0}
        self.seen: list[int] = []
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.shape[0])
        self.count += 1
        return self.fc(x) * self.config["scale"]


@pytest.mark.parametrize("level", ["O1", "O2", "O3", "autocast"])
def test_buffers_and_attributes_are_shared_with_the_original(level: str) -> None:
    model = _Keeps()
    converted = amp.auto_mixed_precision(model, level, "bf16")
    assert converted.fc is not model.fc  # the modules are copies
    assert converted.config is model.config
    assert converted.seen is model.seen
    assert converted.count is model.count
    converted(torch.randn(3, 2))
    model.config["scale"] = 0.0  # seen by the converted model's next call
    out = converted(torch.randn(1, 2))
    assert model.seen == [3, 1]
    assert model.count.item() == 2.0
    assert torch.equal(out, torch.zeros(1, 2))
