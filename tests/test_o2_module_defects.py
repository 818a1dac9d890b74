"""O2/O3 with PyTorch's special modules: the old ``spectral_norm``/``weight_norm`` hooks and
the fused fast paths (``nn.TransformerEncoder``'s nested tensors, the layer, the attention)."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable

import pytest
import torch
from torch import nn

import mixprec as amp
from mixprec.inspect import CastCounter

LEVELS = ["O2", "O3"]
BF16 = torch.bfloat16
# max abs error of a LayerNorm-scaled (unit) output of 1-2 small layers in bfloat16 against
# float32: a few roundings of 8 mantissa bits (2**-8 = 0.004 each)
ATOL = 0.05


pytestmark = pytest.mark.filterwarnings("ignore:.*(deprecated|nested tensors|no native)")


def _normed(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "spectral_norm":
        return nn.utils.spectral_norm(nn.Linear(4, 4))
    return nn.utils.weight_norm(nn.Linear(4, 4))


NORMS = ["spectral_norm", "weight_norm"]
ORIGINALS = {"spectral_norm": ("weight_orig",), "weight_norm": ("weight_g", "weight_v")}


# ------------------------------------------------------------------ old weight hooks


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("kind", NORMS)
@pytest.mark.parametrize("level", LEVELS)
def test_old_weight_hook_runs_in_float32_and_the_matmul_low(
    level: str, kind: str, when: str
) -> None:
    """A hook applied before conversion or to the converted layer (at its next call)."""
    reference = nn.Sequential(_normed(kind), nn.ReLU()).train()  # (no deepcopy: weight_norm)
    if when == "before":
        model = nn.Sequential(_normed(kind), nn.ReLU()).train()
        converted = amp.auto_mixed_precision(model, level, BF16)
    else:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).train()
        rng = torch.random.get_rng_state()
        converted = amp.auto_mixed_precision(model, level, BF16)
        torch.random.set_rng_state(rng)  # (spectral norm draws its vectors)
        getattr(nn.utils, kind)(converted[0])
        model = converted  # (the hook's originals are the converted layer's)
    x = torch.randn(3, 4)
    seen: dict[str, torch.dtype] = {}

    def record(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        seen.update(weight=module.weight.dtype, input=args[0].dtype, output=out.dtype)
        for name in ORIGINALS[kind]:
            seen[name] = getattr(module, name).dtype

    converted[0].register_forward_hook(record)
    out = converted(x)
    expected = reference(x)

    assert out.dtype == torch.float32
    assert seen["weight"] == seen["input"] == seen["output"] == BF16  # the matmul runs low
    assert all(seen[name] == torch.float32 for name in ORIGINALS[kind])  # the hook's math
    assert (out - expected).abs().max() <= ATOL * expected.abs().max()
    linear = converted[0]
    for name in ORIGINALS[kind]:  # the stored originals are the user's float32 Parameters
        assert linear._parameters[name] is model[0]._parameters[name]
        assert linear._parameters[name].dtype == torch.float32


@pytest.mark.parametrize("kind", NORMS)
def test_the_plan_shows_the_computed_weight_cast(kind: str) -> None:
    model = nn.Sequential(_normed(kind), nn.ReLU(), nn.Linear(4, 4))
    converted = amp.auto_mixed_precision(model, "O2", BF16)
    plan = amp.explain(converted)
    casts = [cast.value for row in plan.rows for cast in row.casts_before]
    assert "0.weight" in casts
    assert not any(name in casts for name in ("0.weight_orig", "0.weight_g", "0.weight_v"))
    with CastCounter() as counter:
        converted(torch.randn(2, 4))
    assert plan.num_casts == counter.total


@pytest.mark.parametrize("level", LEVELS)
def test_spectral_norm_power_iteration_updates_the_buffers_as_the_original(level: str) -> None:
    original = nn.Sequential(_normed("spectral_norm"), nn.ReLU()).train()
    reference = copy.deepcopy(original)
    converted = amp.auto_mixed_precision(original, level, BF16)
    x = torch.randn(3, 4)
    for _ in range(3):
        converted(x)
        reference(x)
    u, v = converted[0].weight_u, converted[0].weight_v
    assert u.dtype == v.dtype == torch.float32
    # the same float32 power iteration on the same float32 weight: the same bits
    assert torch.equal(u, reference[0].weight_u)
    assert torch.equal(v, reference[0].weight_v)
    assert original[0].weight_u is u  # shared with the user's model, updated in place


@pytest.mark.parametrize("kind", NORMS)
def test_old_weight_hook_trains_with_float32_masters(kind: str) -> None:
    model, reference = (nn.Sequential(_normed(kind), nn.ReLU(), nn.Linear(4, 2)) for _ in "ab")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = amp.build_train_network(model, optimizer, nn.MSELoss(), "O2", dtype=BF16)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    before_u = model[0].weight_u.clone() if kind == "spectral_norm" else None
    losses, ref_losses = [], []
    for _ in range(3):
        losses.append(float(step(x, y)))
        ref_optimizer.zero_grad()
        loss = nn.functional.mse_loss(reference(x), y)
        loss.backward()
        ref_optimizer.step()
        ref_losses.append(float(loss.detach()))

    assert losses[-1] < losses[0]  # it trains
    assert step.network[0]._parameters["bias"].dtype == BF16  # masters on: low Parameters
    assert losses == pytest.approx(ref_losses, rel=3e-2)
    for name in ORIGINALS[kind]:
        stored = step.network[0]._parameters[name]
        assert stored.dtype == torch.float32
        assert torch.allclose(stored, reference[0]._parameters[name], atol=2e-2)
    if kind == "spectral_norm":
        u = step.network[0].weight_u
        assert u.dtype == torch.float32
        assert not torch.equal(u, before_u)
        assert torch.allclose(u, reference[0].weight_u, atol=2e-2)


def test_spectral_norm_in_eval_and_called_directly() -> None:
    model = nn.Sequential(_normed("spectral_norm"), nn.ReLU())
    model(torch.randn(2, 4))  # one power iteration in training mode
    model.eval()
    converted = amp.auto_mixed_precision(model, "O2", BF16)
    x = torch.randn(2, 4)
    u = model[0].weight_u.clone()
    direct = converted[0](x)  # a submodule called on its own, outside the root's call
    assert direct.dtype == BF16
    assert torch.allclose(direct.float(), model[0](x), atol=ATOL)
    assert torch.equal(model[0].weight_u, u)  # eval: no power iteration


def test_spectral_norm_state_dict_and_removal_after_conversion() -> None:
    model = nn.Sequential(_normed("spectral_norm"))
    converted = amp.auto_mixed_precision(model, "O2", BF16)
    state = converted.state_dict()
    assert list(state) == list(model.state_dict())
    assert all(value.dtype == torch.float32 for value in state.values())
    converted.load_state_dict(model.state_dict())
    nn.utils.remove_spectral_norm(converted[0])
    out = converted(torch.randn(2, 4))
    assert out.dtype == torch.float32
    assert converted[0].weight.dtype == torch.float32


# ------------------------------------------------------------ the encoder's fast path

PAD = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])


def _encoder(norm: bool = False) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
    return nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(8) if norm else None).eval()


def _compare(
    original: nn.Module,
    converted: nn.Module,
    call: Callable[[nn.Module], torch.Tensor],
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``call`` on both without gradients (the fast path's condition); the converted
    output must have ``dtype``; returned in float32."""
    with torch.no_grad():
        expected, out = call(original), call(converted)
    assert out.dtype == dtype
    return expected, out.float()


@pytest.mark.parametrize("norm", [False, True], ids=["no-norm", "final-norm"])
@pytest.mark.parametrize("level", LEVELS)
def test_encoder_fast_path_gives_what_the_original_gives(level: str, norm: bool) -> None:
    encoder = _encoder(norm)
    x = torch.randn(2, 5, 8)
    converted = amp.auto_mixed_precision(encoder, level, BF16)
    expected, out = _compare(encoder, converted, lambda m: m(x, src_key_padding_mask=PAD))

    padded = expected[1, 3:]
    if not norm:
        assert torch.equal(padded, torch.zeros_like(padded))  # the original's fast path
    assert torch.allclose(out[1, 3:], padded, atol=ATOL)  # zeros (or the norm of zeros)
    assert (out - expected).abs().max() <= ATOL
    # the padded positions of the slow path are not zero: the check can fail
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        _, slow = _compare(encoder, converted, lambda m: m(x, src_key_padding_mask=PAD))
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    assert slow[1, 3:].abs().max() > 0.5


@pytest.mark.parametrize("level", LEVELS)
def test_encoder_inside_a_model_and_when_the_fast_path_does_not_apply(level: str) -> None:
    encoder = _encoder()
    model = nn.Sequential(nn.Linear(8, 8), encoder)
    x = torch.randn(2, 5, 8)
    converted = amp.auto_mixed_precision(model, level, BF16)

    def call(m: nn.Module) -> torch.Tensor:
        return m[1](m[0](x), src_key_padding_mask=PAD)

    # a child called on its own (outside the root: low output), the fast path taken
    expected, out = _compare(model, converted, call, BF16)
    assert out[1, 3:].abs().max() == 0
    assert (out - expected).abs().max() <= ATOL
    # with gradients on, neither takes the fast path: the padded positions are computed
    expected = encoder(x, src_key_padding_mask=PAD)
    out = amp.auto_mixed_precision(encoder, level, BF16)(x, src_key_padding_mask=PAD)
    assert expected[1, 3:].abs().max() > 0.5
    assert (out - expected).abs().max() <= ATOL
    out.sum().backward()


class _Embedded(nn.Module):
    """An encoder fed float32 activations (a float32 buffer added to the embeddings)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.register_buffer("position", torch.randn(5, 8))
        self.encoder = _encoder()

    def forward(self, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embed(ids) + self.position, src_key_padding_mask=pad)


@pytest.mark.parametrize("level", LEVELS)
def test_encoder_fed_float32_activations_takes_the_fast_path(level: str) -> None:
    model = _Embedded().eval()
    ids = torch.randint(0, 10, (2, 5))
    converted = amp.auto_mixed_precision(model, level, BF16)
    expected, out = _compare(model, converted, lambda m: m(ids, PAD))
    assert out[1, 3:].abs().max() == 0
    assert (out - expected).abs().max() <= ATOL


@pytest.mark.parametrize("level", LEVELS)
def test_bare_layer_and_attention_match_the_original(level: str) -> None:
    encoder = _encoder()
    layer, attention = encoder.layers[0], encoder.layers[0].self_attn
    x = torch.randn(2, 5, 8)
    fast_layer = amp.auto_mixed_precision(layer, level, BF16)
    fast_attention = amp.auto_mixed_precision(attention, level, BF16)
    expected, out = _compare(layer, fast_layer, lambda m: m(x, src_key_padding_mask=PAD))
    assert (out - expected).abs().max() <= ATOL  # padded positions computed by both

    def attend(m: nn.Module) -> torch.Tensor:
        return m(x, x, x, key_padding_mask=PAD, need_weights=False)[0]

    expected, out = _compare(attention, fast_attention, attend)
    assert (out - expected).abs().max() <= ATOL * expected.abs().max()


class _Shifted(nn.TransformerEncoderLayer):
    """A layer of the user's whose own code mixes a float32 buffer into the activations."""

    def __init__(self) -> None:
        super().__init__(8, 2, 16, batch_first=True, dropout=0.0)
        self.register_buffer("shift", torch.randn(8, 8))

    def forward(self, src: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return super().forward(src @ self.shift, *args, **kwargs)


def test_modules_the_encoder_calls_keep_the_mixed_operand_rule() -> None:
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(_Shifted(), 2, enable_nested_tensor=False).eval()
    converted = amp.auto_mixed_precision(encoder, "O2", BF16)
    x = torch.randn(2, 5, 8)
    # without the rule, ``bfloat16 @ float32`` in the layer's own code is a dtype error
    expected, out = _compare(encoder, converted, lambda m: m(x, src_key_padding_mask=PAD))
    assert (out - expected).abs().max() <= ATOL


def test_converted_encoder_copies_pickles_and_keeps_its_signature() -> None:
    import inspect

    converted = amp.auto_mixed_precision(_encoder(), "O2", BF16)
    x = torch.randn(2, 5, 8)
    assert "src_key_padding_mask" in inspect.signature(converted.forward).parameters
    for clone in (copy.deepcopy(converted), pickle.loads(pickle.dumps(converted))):
        with torch.no_grad():
            out = clone(x, src_key_padding_mask=PAD)
        assert out[1, 3:].abs().max() == 0


def test_autocast_on_the_encoder_fast_path_fails_in_pytorch() -> None:
    """What ``torch.autocast`` gives on the same call (documented in docs/levels.md): its
    CPU autocast does not turn the fast path off, and the fused kernel fails."""
    encoder = _encoder()
    x = torch.randn(2, 5, 8)
    with (
        torch.no_grad(),
        torch.autocast("cpu", BF16),
        pytest.raises(RuntimeError, match="expected scalar type"),
    ):
        encoder(x, src_key_padding_mask=PAD)


class _Writes(nn.Module):
    """A layer with weights of its own that writes into containers its parent passes."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(
        self, x: torch.Tensor, cache: list[torch.Tensor], store: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        y = x @ self.w
        cache.append(y)
        store["y"] = y
        return y


class _Passes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = _Writes()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        cache: list[torch.Tensor] = []
        store: dict[str, torch.Tensor] = {}
        y = self.child(x.float() * 2.0, cache, store)  # a float32 tensor: the child casts it
        return y, len(cache), len(store)


@pytest.mark.parametrize("level", LEVELS)
def test_a_container_argument_with_nothing_to_cast_is_the_callers_object(level: str) -> None:
    torch.manual_seed(0)
    model = _Passes()
    x = torch.randn(2, 4)
    y, appended, filled = amp.auto_mixed_precision(model, level, "bf16")(x)
    assert (appended, filled) == (1, 1)
    torch.testing.assert_close(y, model(x)[0], rtol=0.05, atol=0.05)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(torch.relu(self.a(x)))
        norm = getattr(self, "norm", None)  # (one added after conversion)
        return y if norm is None else norm(y)


def _replace_b(model: nn.Module) -> None:
    model[1].b = nn.Linear(4, 4)  # a child replaced


def _append_block(model: nn.Module) -> None:
    model.append(_Block())  # a block appended (registered through add_module)


def _add_norm(model: nn.Module) -> None:
    model[0].add_module("norm", nn.LayerNorm(4))  # on O2's black list: a float32 island


def _new_container(model: nn.Module) -> None:
    model[1] = nn.Sequential(model[1].a, nn.ReLU(), nn.Linear(4, 4))  # converted `a` moved


#: a change made after conversion, and a float32 pin by name it is tried with (a pin that
#: names the module put in, or the one it is put in)
CHANGES: dict[str, tuple[Callable[[nn.Module], None], list[str]]] = {
    "replace": (_replace_b, ["1.b"]),
    "append": (_append_block, ["1"]),
    "norm": (_add_norm, ["0"]),
    "new container": (_new_container, ["1"]),
}


@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("level", LEVELS)
def test_a_module_added_after_conversion_computes_as_if_converted_there(
    level: str, change: str
) -> None:
    """A module registered in a converted model after conversion is converted as
    conversion would have converted it there: the model converted and then changed
    computes what the model changed and then converted does, bit for bit, eagerly and
    compiled (where there is no mode to reconcile a float32 layer with low activations).
    A pin by name applies to the module put at that name."""
    x = torch.randn(3, 4)
    make_change, pinned = CHANGES[change]
    for pins in (None, pinned):
        torch.manual_seed(0)
        first = amp.auto_mixed_precision(
            nn.Sequential(_Block(), _Block()), level, "bf16", fp32_modules=pins
        )
        torch.manual_seed(1)
        make_change(first)
        torch.manual_seed(0)
        changed = nn.Sequential(_Block(), _Block())
        torch.manual_seed(1)
        make_change(changed)
        second = amp.auto_mixed_precision(changed, level, "bf16", fp32_modules=pins)
        want = second(x)
        assert torch.equal(first(x), want)
        torch._dynamo.reset()
        assert torch.equal(torch.compile(first, backend="eager")(x), want)
        with CastCounter() as counted:
            first(x)
        with CastCounter() as expected:
            second(x)
        assert counted.total == expected.total


@pytest.mark.parametrize("level", LEVELS)
def test_a_module_inserted_without_registration_is_named_by_the_dtype_error(level: str) -> None:
    """``Sequential.insert`` writes ``_modules`` with no registration hook: the layer it
    puts in runs unconverted, on float32 weights, and the dtype error it meets below the
    root names it."""
    converted = amp.auto_mixed_precision(
        nn.Sequential(_Block(), nn.Sequential(nn.Linear(4, 4))), level, "bf16"
    )
    converted[1].insert(0, nn.Linear(4, 4))
    with pytest.raises(RuntimeError, match="dtype") as caught:
        converted(torch.randn(2, 4))
    notes = caught.value.__notes__
    assert notes == [
        "mixprec: these modules were added after conversion and run unconverted, on float32 "
        "weights: 1.0; convert the changed model again (auto_mixed_precision on the original, "
        "changed the same way)"
    ]


class _Accumulates(nn.Module):
    """A layer with weights that writes into the float32 tensors its parent passes."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(
        self, x: torch.Tensor, total: torch.Tensor, more: list[torch.Tensor]
    ) -> torch.Tensor:
        total.add_(1.0)  # a float32 tensor: the layer received its low cast
        more[0].mul_(2.0)  # one inside a list
        return x @ self.w


class _Counts(nn.Module):
    def __init__(self, island: bool) -> None:
        super().__init__()
        self.layer = _Accumulates()
        self.norm = nn.LayerNorm(4) if island else nn.Identity()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        total, more = torch.zeros(3), [torch.full((3,), 0.5)]
        y = self.layer(self.norm(x), total, more)
        y = self.layer(y, total, more)  # twice: each write goes back before the next call
        return y, total, more[0]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("directly", [False, True])
def test_a_write_into_a_cast_argument_below_the_root_reaches_the_callers_tensor(
    level: str, directly: bool
) -> None:
    torch.manual_seed(0)
    model = _Counts(island=True)
    converted = amp.auto_mixed_precision(model, level, "bf16")
    x = torch.randn(2, 4)
    if directly:  # the layer called by itself: it enters the conversion
        total, more = torch.zeros(3), [torch.full((3,), 0.5)]
        converted.layer(x, total, more)
        assert total.tolist() == [1.0] * 3
        assert more[0].tolist() == [1.0] * 3
        return
    y, total, first = converted(x)
    want_y, want_total, want_first = model(x)
    assert total.dtype == first.dtype == torch.float32
    assert torch.equal(total, want_total)
    assert torch.equal(first, want_first)
    torch.testing.assert_close(y, want_y, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("level", LEVELS)
def test_a_root_recurrent_layer_casts_what_its_containers_hold(level: str, compiled: bool) -> None:
    """A recurrent layer at the root is the layer that uses its state ``(h0, c0)`` and a
    ``PackedSequence``'s data: they are cast as a nested layer's are (the root casts only
    top-level tensors, which left the LSTM mixing bfloat16 with float32: an error)."""
    from torch.nn.utils.rnn import pack_padded_sequence

    torch.manual_seed(0)
    lstm = nn.LSTM(4, 3, batch_first=True)
    x = torch.randn(2, 5, 4)
    state = (torch.randn(1, 2, 3), torch.randn(1, 2, 3))
    converted = amp.auto_mixed_precision(lstm, level, "bf16")
    run = torch.compile(converted, backend="eager") if compiled else converted
    torch._dynamo.reset()
    for args in ((x, state), (pack_padded_sequence(x, torch.tensor([5, 3]), batch_first=True),)):
        got, want = run(*args), lstm(*args)
        out, (h, c) = got
        out = getattr(out, "data", out)
        assert {out.dtype, h.dtype, c.dtype} == {torch.float32}
        torch.testing.assert_close(out, getattr(want[0], "data", want[0]), rtol=0.05, atol=0.05)
        torch.testing.assert_close(c, want[1][1], rtol=0.05, atol=0.05)


class _SharedHead(nn.Module):
    """``head`` is also ``blk.b.1``: one module in two places."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 4)
        self.blk = nn.Sequential(nn.Sequential(nn.Linear(4, 4), self.head))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blk(x))


@pytest.mark.parametrize("level", LEVELS)
def test_a_shared_module_computes_in_one_precision_in_both_places(level: str) -> None:
    """A module shared by a float32-pinned block and a low parent would compute in two
    precisions: refused with the fix (it converted, then failed at the call on mixed
    dtypes). Pinned at both names (every name of a shared module is accepted), it computes
    in float32 in both places, casting its inputs up where its parent computes low."""
    torch.manual_seed(0)
    model = _SharedHead()
    x = torch.randn(3, 4)
    with pytest.raises(
        ValueError, match=r"module '1' is the same module as '0.1'.*fp32_modules=\['0.1', '1'\]"
    ):
        amp.auto_mixed_precision(
            nn.Sequential(model.blk[0], model.head), level, "bf16", fp32_modules=["0"]
        )
    with pytest.raises(ValueError, match="shared module computes in one precision"):
        amp.auto_mixed_precision(model, level, "bf16", fp32_modules=["blk"])
    converted = amp.auto_mixed_precision(model, level, "bf16", fp32_modules=["blk", "head"])
    seen: list[torch.dtype] = []
    converted.head.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    out = converted(x)
    assert out.dtype == torch.float32
    assert seen == [torch.float32, torch.float32]
    torch.testing.assert_close(out, model(x), rtol=0.02, atol=0.02)


class _SlicesParameters(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(4, 4) / 2) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for weight in self.weights[:2]:
            x = x @ weight
        return x


@pytest.mark.parametrize("level", LEVELS)
def test_a_sliced_parameter_list_trains_the_stored_parameters(level: str) -> None:
    """A ``ParameterList`` sliced in a forward is a list of the same Parameters, reading
    low as the list's do: gradients reach the stored float32 Parameters. (The slice made
    new Parameters of the casts: training silently stopped reaching the stored ones.)"""
    torch.manual_seed(0)
    model = _SlicesParameters()
    converted = amp.auto_mixed_precision(model, level, "bf16")
    x = torch.randn(2, 4)
    out = converted(x)
    out.float().sum().backward()
    assert [p.grad is not None for p in model.weights] == [True, True, False]
    assert all(p.grad.dtype == torch.float32 for p in model.weights[:2])
    torch.testing.assert_close(out.float(), model(x), rtol=0.05, atol=0.05)


class _SharedNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        norm = nn.LayerNorm(4)
        self.a = nn.Sequential(norm, nn.Linear(4, 4))
        self.b = nn.Sequential(norm, nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_a_shared_float32_norm_under_a_low_and_a_float32_parent() -> None:
    """A black-list norm reached first under a low parent, then under a float32-pinned
    one (O2): it computes in float32 in both, handing its output on in float32 (it cast
    it down for the first parent and failed in the second)."""
    torch.manual_seed(0)
    model = _SharedNorm()
    x = torch.randn(3, 4)
    for pins in (["b"], ["a"]):
        converted = amp.auto_mixed_precision(model, "O2", "bf16", fp32_modules=pins)
        out = converted(x)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, model(x), rtol=0.03, atol=0.03)
