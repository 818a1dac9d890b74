"""The O2/O3 hot path: what a submodule call costs and where the mixed-operand rule runs.

A converted model's submodules run their own ``forward`` with no torch-function mode and
no hooks of mixprec's (but float32 islands'); the mixed-operand rule runs in the code of
the entry module, of loss modules and of modules that hold floating buffers. The root
casts its floating tensor arguments, never tensors inside containers (targets).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import mixprec as amp
from mixprec.convert.cast_at_use import MixedOperands

LEVELS = ["O2", "O3"]
DTYPES = [torch.bfloat16, torch.float16]


class _Counting:
    """Counts the calls :class:`MixedOperands` sees, by patching its method."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.funcs: list[str] = []
        original = MixedOperands.__torch_function__

        def counted(mode: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.funcs.append(getattr(func, "__name__", str(func)))
            return original(mode, func, types, args, kwargs)

        monkeypatch.setattr(MixedOperands, "__torch_function__", counted)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.relu(h.view(-1, 4).transpose(0, 1).transpose(0, 1)) + h


class _Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[_Block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x).sum(-1)


@pytest.mark.parametrize("level", LEVELS)
def test_submodules_run_their_ops_without_a_mode(
    level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    counting = _Counting(monkeypatch)
    model = _Deep()
    converted = amp.auto_mixed_precision(model, level, torch.bfloat16)
    x = torch.randn(2, 4)
    out = converted(x)
    # the root's own code: one op (sum); the blocks' 15 ops run as PyTorch runs them
    assert counting.funcs == ["sum"]
    torch.testing.assert_close(out, model(x), rtol=0.05, atol=0.05)
    counting.funcs.clear()
    converted.blocks[0](x)  # a submodule called directly: its own code is the entry's
    assert counting.funcs.count("relu") == 1
    assert "linear" not in counting.funcs  # its child runs without the mode


@pytest.mark.parametrize("level", LEVELS)
def test_no_mixprec_hooks_on_low_layers(level: str) -> None:
    converted = amp.auto_mixed_precision(_Deep(), level, torch.bfloat16)
    fc = converted.blocks[0].fc
    assert not fc._forward_pre_hooks
    assert not fc._forward_hooks


class _Buffered(nn.Module):
    """A submodule that mixes its float32 buffer into a matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("proj", torch.randn(4, 4))
        self.register_buffer("shift", torch.randn(4))
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        product = h @ self.proj
        self.seen += [product.dtype, (h + self.shift).dtype]
        return product


class _WithLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(_Buffered())
        self.head = nn.Linear(4, 3)
        self.criterion = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.inner(x))
        return logits, self.criterion(logits, y)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", LEVELS)
def test_buffered_and_loss_submodules_follow_the_mixed_operand_rule(
    level: str, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    model = _WithLoss()
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    control_logits, control_loss = model(x, y)
    converted = amp.auto_mixed_precision(model, level, dtype)
    buffered = converted.inner[0]
    losses: list[torch.dtype] = []
    converted.criterion.register_forward_hook(lambda m, a, out: losses.append(out.dtype))
    buffered.seen.clear()  # (the copy shares the original's list: it ran the control)
    logits, loss = converted(x, y)
    assert buffered.seen == [dtype, torch.float32]  # autocast's rule, then type promotion
    assert losses == [torch.float32]  # the loss module computes in float32
    assert logits.dtype == loss.dtype == torch.float32
    assert buffered.proj.dtype == torch.float32
    torch.testing.assert_close(loss, control_loss, rtol=0.05, atol=0.02)
    torch.testing.assert_close(logits, control_logits, rtol=0.05, atol=0.05)


class _MakesFloat32(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ torch.ones(4, 4)  # a float32 tensor made here, into a matmul


@pytest.mark.parametrize("level", LEVELS)
def test_a_float32_tensor_made_in_a_plain_submodule_gets_a_clear_error(level: str) -> None:
    model = nn.Sequential(nn.Linear(4, 4), _MakesFloat32())
    converted = amp.auto_mixed_precision(model, level, torch.bfloat16)
    with pytest.raises(RuntimeError) as raised:
        converted(torch.randn(2, 4))
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "mixprec" in notes
    assert ".to(x.dtype)" in notes
    assert "fp32_modules" in notes
    assert converted[0]._parameters["weight"].dtype == torch.float32  # nothing changed
    # pinned to float32, the module computes (and the model runs)
    pinned = amp.auto_mixed_precision(model, level, torch.bfloat16, fp32_modules=["1"])
    torch.testing.assert_close(
        pinned(torch.ones(2, 4)), model(torch.ones(2, 4)), rtol=0.02, atol=0.1
    )


class _Detector(nn.Module):
    """A detection-style model: images and targets in lists, as torchvision's take them."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Conv2d(3, 4, 3, padding=1)
        self.anchors_seen: list[torch.dtype] = []
        self.box_values: list[torch.Tensor] = []

    def forward(
        self, images: list[torch.Tensor], targets: list[dict[str, torch.Tensor]], scale: Any
    ) -> torch.Tensor:
        features = self.backbone(torch.stack(images))
        boxes = targets[0]["boxes"]
        self.anchors_seen += [boxes.dtype, scale.dtype]
        self.box_values.append(boxes)
        return features.mean() + (boxes * 0).sum()


@pytest.mark.parametrize("level", LEVELS)
def test_root_casts_its_tensor_arguments_not_the_targets_in_containers(level: str) -> None:
    model = _Detector()
    converted = amp.auto_mixed_precision(model, level, torch.bfloat16)
    boxes = torch.tensor([[1.0, 2.0, 30.123456, 40.654321]])
    scale = torch.tensor(0.5)
    out = converted([torch.randn(3, 5, 5)], [{"boxes": boxes}], scale)
    assert model.anchors_seen == [torch.float32, torch.bfloat16]  # boxes as given; scale cast
    assert model.box_values[0] is boxes  # the very tensor, not a copy
    assert out.dtype == torch.float32


@pytest.mark.parametrize("level", LEVELS)
def test_a_hook_on_a_low_layer_sees_its_callers_arguments(level: str) -> None:
    seen: list[tuple[torch.dtype, torch.dtype, torch.dtype]] = []
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    converted = amp.auto_mixed_precision(model, level, torch.bfloat16)

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        seen.append((args[0].dtype, module.weight.dtype, out.dtype))

    converted[1].register_forward_hook(hook)
    converted(torch.randn(2, 4))
    converted[1](torch.randn(2, 4))  # called directly with a float32 tensor
    bf16, fp32 = torch.bfloat16, torch.float32
    # inside the model: what its caller passed (low); called directly: the float32 input as
    # given (as under torch.autocast), while the layer computes low
    assert seen == [(bf16, bf16, bf16), (fp32, fp32, bf16)]


def test_recurrent_and_island_modules_take_the_full_path() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.LSTM(4, 4, batch_first=True))
    converted = amp.auto_mixed_precision(model, "O2", torch.bfloat16)
    seen: list[torch.dtype] = []
    converted[1].register_forward_hook(lambda m, args, out: seen.append(args[0].dtype))
    x = torch.randn(2, 3, 4)
    out, (h, c) = converted(x)
    ref, _ = model(x)
    assert seen == [torch.bfloat16]  # the island's hooks see what its caller passed
    assert out.dtype == h.dtype == c.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0.05, atol=0.05)
    assert all(p.dtype == torch.float32 for p in model[2].parameters())  # not written


class _OwnNorm(nn.LayerNorm):
    """A norm with its own ``forward``: its island casts (its code may not take a low input)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


_NORMS = {
    "batch_norm_1d": (lambda: nn.BatchNorm1d(6), (5, 6)),
    "batch_norm_2d": (lambda: nn.BatchNorm2d(6), (2, 6, 3, 3)),
    "layer_norm": (lambda: nn.LayerNorm(6), (5, 6)),
    "layer_norm_plain": (lambda: nn.LayerNorm(6, elementwise_affine=False), (5, 6)),
    "group_norm": (lambda: nn.GroupNorm(2, 6), (2, 6, 3, 3)),
    "instance_norm": (lambda: nn.InstanceNorm2d(6, affine=True), (2, 6, 3, 3)),
}


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", sorted(_NORMS))
def test_an_o2_norm_island_is_one_kernel_with_the_bits_of_casting(
    norm: str, dtype: torch.dtype, train: bool
) -> None:
    """O2's black-list norms compute in float32 on their low input inside their kernel (CPU):
    no cast kernels, and within one rounding of what casting the input up, computing in float32 and
    casting the output back gives; running statistics alike."""
    from mixprec.inspect import CastCounter

    torch.manual_seed(0)
    make, shape = _NORMS[norm]
    model = nn.Sequential(nn.Identity(), make()).train(train)
    with torch.no_grad():
        for p in model[1].parameters():
            p.uniform_(0.5, 1.5)
    reference = make().train(train)
    reference.load_state_dict(model[1].state_dict())
    converted = amp.auto_mixed_precision(model, "O2", dtype)
    x = torch.randn(shape) * 3 + 1
    with CastCounter() as counter:
        out = converted(x)
    expected = reference(x.to(dtype).float()).to(dtype).float()
    assert out.dtype == torch.float32
    # one kernel may sum in another order than the float32 one (vector widths differ by
    # CPU): at most one rounding of the low dtype apart (bit for bit on an AVX2 CPU)
    ulp = torch.finfo(dtype).eps * expected.abs().clamp_min(1.0)
    assert ((out - expected).abs() <= ulp).all()
    assert counter.total == 2  # the root's input and output casts only
    for name, buffer in reference.named_buffers():
        if buffer.is_floating_point():
            torch.testing.assert_close(converted[1].get_buffer(name), buffer, rtol=1e-6, atol=1e-7)
    assert all(p.dtype == torch.float32 for p in converted[1].parameters())


def test_a_norm_island_with_its_own_forward_or_under_autocast_casts() -> None:
    from mixprec.inspect import CastCounter

    torch.manual_seed(0)
    for norm, casts in ((_OwnNorm(4), 2), (nn.LayerNorm(4), 0)):
        converted = amp.auto_mixed_precision(
            nn.Sequential(nn.Identity(), norm), "O2", torch.bfloat16
        )
        seen: list[torch.dtype] = []
        converted[1].register_forward_pre_hook(lambda m, a, seen=seen: seen.append(a[0].dtype))
        x = torch.randn(3, 4)
        with CastCounter() as counter:
            out = converted(x)
        assert counter.total == 2 + casts  # the root's in and out; the island's in and out
        assert seen == [torch.bfloat16]
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.float(), norm(x.bfloat16().float()), rtol=0.02, atol=0.02)
        # called directly with a float32 tensor: computes in float32, returns low
        assert converted[1](x).dtype == torch.bfloat16
        with torch.autocast("cpu", torch.bfloat16), pytest.warns(UserWarning, match="outer"):
            assert converted(x).dtype == torch.float32  # outer autocast is off inside


@pytest.mark.parametrize("level", LEVELS)
def test_a_fused_encoder_layer_with_islands_takes_its_standard_path(level: str) -> None:
    """At O2 the layer's norms compute in float32 and its linears low: its fused kernel takes
    one dtype, so the layer runs its standard path (at O3 all is low: the fused kernel)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0).eval()
    converted = amp.auto_mixed_precision(layer, level, torch.bfloat16)
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        out = converted(x)
        expected = layer(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("level", ["O1", "autocast", "O2", "O3"])
def test_a_converted_call_takes_the_frames_of_the_original(level: str) -> None:
    """A converted module's call (no hooks) runs in as many Python frames as the original's:
    a chain of nested modules runs as deep under a recursion limit; hooks added later, and a
    ``forward`` the user sets later, still run."""
    import sys

    def chain(n: int) -> nn.Module:
        return nn.Linear(2, 2) if n == 0 else nn.Sequential(chain(n - 1))

    x = torch.randn(1, 2)

    def deepest(make: Any) -> int:
        ok = 0
        for n in range(5, 120, 5):
            try:
                make(n)(x)
            except RecursionError:
                break
            ok = n
        return ok

    limit = sys.getrecursionlimit()
    try:
        sys.setrecursionlimit(200)
        ours = deepest(lambda n: amp.auto_mixed_precision(chain(n), level, torch.bfloat16))
        theirs = deepest(chain)
    finally:
        sys.setrecursionlimit(limit)
    assert theirs > 0
    assert ours >= theirs - 5  # (the root's entry adds a few frames once)
    converted = amp.auto_mixed_precision(chain(3), level, torch.bfloat16)
    inner = converted[0][0][0]
    seen: list[torch.dtype] = []
    inner.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    converted(x)
    assert seen == [torch.bfloat16]
    inner.forward = lambda t: t * 0  # the user's own forward, set on the instance
    assert torch.equal(converted(x), torch.zeros(1, 2))


def test_a_transformers_output_is_cast_as_a_copy_of_its_state() -> None:
    """The root's output cast rebuilds a ``ModelOutput`` (a dict whose attributes mirror its
    items) as a copy of its state, not through its constructor: same type, keys, attribute
    mirror and aliases; the object itself when no value changes."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    from mixprec.policy.ops import cast_tree

    hidden = torch.randn(1, 3, 4, dtype=torch.bfloat16)
    out = BaseModelOutputWithPooling(
        last_hidden_state=hidden, pooler_output=hidden[:, 0], hidden_states=(hidden,)
    )
    cast = cast_tree(out, torch.float32)
    assert type(cast) is BaseModelOutputWithPooling
    assert list(cast.keys()) == ["last_hidden_state", "pooler_output", "hidden_states"]
    assert cast.attentions is None
    assert cast["last_hidden_state"] is cast.last_hidden_state
    assert cast.last_hidden_state.dtype == torch.float32
    assert torch.equal(cast.last_hidden_state, hidden.float())
    assert cast.hidden_states[0] is cast.last_hidden_state  # one tensor, cast once
    assert cast.to_tuple()[1].dtype == torch.float32
    assert out.last_hidden_state.dtype == torch.bfloat16  # the original is untouched
    only_tensors = BaseModelOutputWithPooling(last_hidden_state=hidden.float())
    assert cast_tree(only_tensors, torch.float32) is only_tensors  # nothing to cast


def test_an_output_beside_an_object_of_its_own_is_cast_as_the_tree_walk_casts_it() -> None:
    """A flat tuple of tensors and objects the tree walk keeps as they are (a KV cache
    object beside the logits) takes the short path: the tensors cast (a tensor given twice
    cast once), the objects the same objects; a dataclass, a registered pytree node or a
    container beside them is still walked."""
    import dataclasses

    import torch.utils._pytree as pytree

    from mixprec.policy.ops import cast_tree

    class Cache:  # (a leaf to the tree walk: no container, not registered)
        def __init__(self, keys: torch.Tensor) -> None:
            self.keys = keys

    @dataclasses.dataclass
    class Pair:
        left: torch.Tensor
        right: int

    class Node:
        def __init__(self, value: torch.Tensor) -> None:
            self.value = value

    pytree.register_pytree_node(
        Node, lambda n: ([n.value], None), lambda values, _: Node(values[0])
    )
    try:
        logits = torch.randn(2, 3, dtype=torch.bfloat16)
        cache = Cache(logits)
        cast = cast_tree((logits, cache, logits), torch.float32)
        assert cast[1] is cache
        assert cache.keys.dtype == torch.bfloat16
        assert cast[0].dtype == torch.float32
        assert cast[0] is cast[2]
        assert torch.equal(cast[0], logits.float())
        walked = cast_tree((logits, Pair(logits, 1), Node(logits), [logits]), torch.float32)
        assert walked[1].left.dtype == torch.float32
        assert walked[1].right == 1
        assert walked[2].value.dtype == torch.float32
        assert walked[3][0].dtype == torch.float32
        assert walked[0] is walked[2].value is walked[3][0]  # (one memo for the walk)
    finally:
        pytree._deregister_pytree_node(Node)


class _WritesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2.0)
        return self.fc(x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_an_island_called_with_one_tensor_walks_no_tree(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A norm's call (one tensor in: what a float32 island meets on every device whose
    norm kernel takes one dtype, CUDA's LayerNorm and RMSNorm among them) casts it with no
    tree walk, computes as casting up and back would, and a write into the cast reaches
    the caller's tensor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.RMSNorm(4), _WritesItsInput(), nn.Linear(4, 4))
    converted = amp.auto_mixed_precision(model, "O2", dtype, fp32_modules=["2"])
    x = torch.randn(3, 4)
    walks: list[Any] = []
    import torch.utils._pytree as pytree

    real = pytree.tree_leaves
    monkeypatch.setattr(pytree, "tree_leaves", lambda *a, **k: walks.append(a) or real(*a, **k))
    with torch.no_grad():
        out = converted(x)
    assert not walks
    with torch.no_grad():
        h = nn.functional.linear(x.to(dtype), model[0].weight.to(dtype), model[0].bias.to(dtype))
        h = model[1](h.float()).to(dtype)
        h32 = h.float() * 2.0
        h = model[2].fc(h32).to(dtype)
        expected = nn.functional.linear(h, model[3].weight.to(dtype), model[3].bias.to(dtype))
    torch.testing.assert_close(out, expected.float())
    seen: list[torch.Tensor] = []
    converted[2].register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        converted(x)
    # the caller's (low) tensor took the island's in-place write, rounded to its dtype
    assert seen[0].dtype == dtype
    torch.testing.assert_close(seen[0].float(), h32.to(dtype).float())


def _one_call_layers() -> list[nn.Module]:
    return [
        nn.Linear(4, 4),
        nn.Linear(4, 4, bias=False),
        nn.Conv1d(4, 4, 3, padding=1),
        nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect", bias=False),
        nn.Conv3d(4, 4, 1),
        nn.LayerNorm(4),
        nn.LayerNorm(4, bias=False),
        nn.Embedding(10, 4, padding_idx=0),
    ]


def _sample(layer: nn.Module) -> torch.Tensor:
    if isinstance(layer, nn.Embedding):
        return torch.tensor([[0, 3, 9], [1, 1, 2]])
    dims = {nn.Linear: (3, 4), nn.LayerNorm: (3, 4), nn.Conv1d: (2, 4, 5), nn.Conv2d: (2, 4, 5, 5)}
    return torch.randn(dims.get(type(layer), (1, 4, 2, 3, 3)))


def _forward_calls(cls: type, run: Any) -> int:
    """How many times ``cls.forward``'s code runs in ``run()`` (a Python frame each)."""
    import sys

    code = cls.forward.__code__
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call" and frame.f_code is code:
            calls += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("index", range(8))
@pytest.mark.parametrize("nested", [False, True], ids=["root-child", "nested"])
def test_a_one_call_layer_runs_its_forwards_call_without_its_frame(
    level: str, index: int, nested: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Linear, Conv, Embedding or low LayerNorm called by its parent computes its class
    forward's one call on its weights cast once, with no frame for the forward: the same
    output and gradients, bit for bit, as running the class forward (an O2 LayerNorm, a
    float32 island, runs its forward)."""
    from mixprec.convert.cast_at_use import ModuleCall

    torch.manual_seed(index)
    layer = _one_call_layers()[index]
    island = level == "O2" and isinstance(layer, nn.LayerNorm)
    model = nn.Sequential(nn.Sequential(layer) if nested else layer, nn.Tanh())
    low = copy.deepcopy(layer).bfloat16()
    x = _sample(layer)

    def run(converted: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        converted.zero_grad()
        out = converted(x)
        out.float().sum().backward()
        return out, [p.grad for p in converted.parameters()]

    converted = amp.auto_mixed_precision(model, level, torch.bfloat16)
    assert _forward_calls(type(layer), lambda: run(converted)) == int(island)
    out, grads = run(converted)
    monkeypatch.setattr(ModuleCall, "_direct", lambda self, module, frame, x: NotImplemented)
    assert _forward_calls(type(layer), lambda: run(converted)) == 1
    expected, expected_grads = run(converted)
    assert out.dtype == expected.dtype
    assert torch.equal(out, expected)
    for grad, want in zip(grads, expected_grads, strict=True):
        assert grad.dtype == torch.float32
        assert torch.equal(grad, want)
    if island:
        return
    with torch.no_grad():  # and it is the layer's computation in bfloat16
        want = torch.tanh(low(x if x.dtype == torch.int64 else x.bfloat16()).float())
    torch.testing.assert_close(out.float(), want, rtol=0.02, atol=0.02)


class _OwnLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2.0


def _tied() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)))
    model[1][0].weight = model[0].weight
    return model


def _parametrized() -> nn.Module:
    from torch.nn.utils import parametrize

    class Doubled(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w * 2.0

    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 4))
    parametrize.register_parametrization(model[0][0], "weight", Doubled())
    return model


CHANGES = {
    # (the model, a change made after conversion, what the change computes as)
    "tied": (_tied, None),
    "parametrized": (_parametrized, None),
    "subclass": (lambda: nn.Sequential(nn.Sequential(_OwnLinear(4, 4))), None),
    "class-forward-patched": (
        lambda: nn.Sequential(nn.Sequential(nn.Linear(4, 4))),
        lambda model, mp: mp.setattr(nn.Linear, "forward", lambda self, x: x @ self.weight * 3.0),
    ),
    "weight-replaced": (
        lambda: nn.Sequential(nn.Sequential(nn.Linear(4, 4))),
        lambda model, mp: setattr(model[0][0], "weight", nn.Parameter(torch.ones(4, 4))),
    ),
    "bias-removed": (
        lambda: nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4))),
        lambda model, mp: setattr(model[1][0], "bias", None),
    ),
}


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("case", list(CHANGES))
def test_a_one_call_layer_whose_forward_decides_computes_as_its_forward(
    level: str, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the layer's own code decides (tied weights, a parametrization, a subclass, the
    class's forward patched, a weight replaced or a bias removed after conversion), the
    converted model computes what its own forward computes: the output and gradients with
    the one-call path taken where it may equal those with it never taken, and the original
    model's (in float32) within bfloat16's rounding."""
    from mixprec.convert.cast_at_use import ModuleCall
    from mixprec.inspect import CastCounter

    make, change = CHANGES[case]
    torch.manual_seed(0)
    model = make()
    original = copy.deepcopy(model)
    converted = amp.auto_mixed_precision(model, level, torch.bfloat16)
    if change is not None:
        change(converted, monkeypatch)
        change(original, monkeypatch)
    x = torch.randn(3, 4)

    def run() -> tuple[torch.Tensor, list[torch.Tensor | None], int]:
        converted.zero_grad()
        with CastCounter() as counter:
            out = converted(x)
        out.float().sum().backward()
        return out, [p.grad for p in converted.parameters()], counter.total

    out, grads, casts = run()
    monkeypatch.setattr(ModuleCall, "_direct", lambda self, module, frame, x: NotImplemented)
    expected, expected_grads, expected_casts = run()
    assert torch.equal(out, expected)
    assert casts == expected_casts
    for grad, want in zip(grads, expected_grads, strict=True):
        assert (grad is None) == (want is None)
        if grad is not None:
            assert torch.equal(grad, want)
    torch.testing.assert_close(out.float(), original(x), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("level", LEVELS)
def test_an_embedding_renormed_in_its_call_writes_its_weight_as_its_forward_does(
    level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``nn.Embedding(max_norm=...)`` renormalizes the rows it looks up in place, inside its
    call: the one-call path, and the path its forward takes when the one call declines,
    renormalize the stored float32 weight before casting it (the original's update, bit
    for bit, eagerly and compiled) and look up the same rows."""
    from mixprec.convert.cast_at_use import ModuleCall

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Sequential(nn.Embedding(10, 4, max_norm=1.0)), nn.Linear(4, 2))

    ids = torch.tensor([[1, 2, 2], [7, 0, 1]])
    original = make()
    original(ids)
    results = []
    for direct in (True, False):
        if not direct:
            monkeypatch.setattr(
                ModuleCall, "_direct", lambda self, module, frame, x: NotImplemented
            )
        for compiled in (False, True) if direct else (False,):
            converted = amp.auto_mixed_precision(make(), level, torch.bfloat16)
            run = torch.compile(converted, backend="eager") if compiled else converted
            with torch.no_grad():
                out = run(ids)
            results.append((out, converted[0][0].weight.detach().clone()))
    (out, weight), (compiled_out, compiled_weight), (forward_out, forward_weight) = results
    stored = original[0][0].weight.detach()
    assert weight.dtype == torch.float32
    assert torch.equal(weight, stored)
    assert torch.equal(compiled_weight, stored)
    assert torch.equal(compiled_out, out)
    touched = ids.unique()
    assert not torch.equal(weight[touched], make()[0][0].weight.detach()[touched])  # renormed
    assert torch.equal(forward_weight, stored)
    assert torch.equal(forward_out, out)


class _Looks(nn.Module):
    """An embedding with ``max_norm`` reached by one of the paths to its call."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.e = nn.Embedding(10, 4, max_norm=1.0)
        self.head = nn.Linear(4, 10)
        if path == "tied":
            self.head.weight = self.e.weight
        if path == "hook":
            self.e.register_forward_hook(lambda module, args, out: out * 1.0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.path == "keyword":
            h = self.e(input=ids)
        elif self.path == "twice":  # (the weight is cast once per call, at the first)
            h = self.e(ids) + self.e(ids + 4)
        elif self.path == "tied":  # (the head reads the weight first)
            h = self.head(torch.ones(1, 4)).sum() + self.e(ids)
        else:
            h = self.e(ids)
        return self.head(h)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("path", ["keyword", "hook", "twice", "tied", "root"])
@pytest.mark.parametrize("level", LEVELS)
def test_an_embedding_renormed_by_any_path_renorms_the_stored_weight(
    level: str, path: str, compiled: bool
) -> None:
    """Whatever the path to an ``nn.Embedding(max_norm=...)`` call (a keyword argument, a
    hook, the root, a second call or a tied head that cast the weight first), its rows are
    renormalised in the stored float32 weight, bit for bit the original's, eagerly and
    compiled. (Compiled, the keyword, hook and root paths renormalised only the cast: the
    stored rows were left 5x too long; eagerly, the renorm was made in bfloat16.)"""

    def make() -> nn.Module:
        torch.manual_seed(0)
        # (below the root: no mode in its code, as in most models)
        model = nn.Embedding(10, 4, max_norm=1.0) if path == "root" else nn.Sequential(_Looks(path))
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(3)
        return model

    ids = torch.tensor([[1, 2, 2], [5, 0, 1]])
    original = make()
    want = original(ids)
    converted = amp.auto_mixed_precision(make(), level, torch.bfloat16)
    torch._dynamo.reset()
    run = torch.compile(converted, backend="eager") if compiled else converted
    got = run(ids)
    stored = {n: p.detach() for n, p in converted.named_parameters()}
    for name, p in original.named_parameters():
        assert torch.equal(stored[name], p.detach()), name
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.1)


def _patched(call: Any) -> Any:
    """A ``forward`` in place of a layer class's own: its one call, then ``* 0 + 7``."""

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return call(self, x) * 0 + 7

    return forward


#: (a layer, its input, a patched forward of its class)
PATCHED_LAYERS = {
    "linear": (
        lambda: nn.Linear(4, 4),
        lambda: torch.randn(3, 4),
        _patched(lambda self, x: torch.nn.functional.linear(x, self.weight, self.bias)),
    ),
    "conv2d": (
        lambda: nn.Conv2d(2, 2, 3, padding=1),
        lambda: torch.randn(1, 2, 4, 4),
        _patched(lambda self, x: self._conv_forward(x, self.weight, self.bias)),
    ),
    "layer_norm": (
        lambda: nn.LayerNorm(4),
        lambda: torch.randn(3, 4),
        _patched(
            lambda self, x: torch.nn.functional.layer_norm(
                x, self.normalized_shape, self.weight, self.bias, self.eps
            )
        ),
    ),
    "embedding": (
        lambda: nn.Embedding(8, 4),
        lambda: torch.tensor([[1, 2, 3]]),
        _patched(lambda self, x: torch.nn.functional.embedding(x, self.weight)),
    ),
    "relu": (lambda: nn.ReLU(), lambda: torch.randn(3, 4), _patched(lambda self, x: torch.relu(x))),
}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("layer", list(PATCHED_LAYERS))
@pytest.mark.parametrize("level", ["O1", "autocast", "O2", "O3"])
def test_a_layer_class_patched_runs_its_patched_forward(
    level: str, layer: str, when: str, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A library that patches a built-in layer class's ``forward`` (as kernel libraries do),
    before conversion or after it, reaches every converted layer of that class: none of
    the paths that make a built-in layer's one call in its place (``F.linear`` for an
    ``nn.Linear``) stands in for a forward PyTorch did not write."""
    make, given, patch = PATCHED_LAYERS[layer]
    cls = type(make())
    torch.manual_seed(0)
    x = given()
    model = nn.Sequential(nn.Linear(x.shape[-1], x.shape[-1]), nn.Sequential(make()))
    if layer == "embedding":
        model = nn.Sequential(nn.Sequential(make()))
    if when == "before":
        monkeypatch.setattr(cls, "forward", patch)
    converted = amp.auto_mixed_precision(model, level, torch.bfloat16)
    run: Any = converted
    if compiled:
        torch._dynamo.reset()
        run = torch.compile(converted, backend="eager")
    with torch.no_grad():
        if when == "after":
            run(x)  # (a first call: whatever it caches or traces)
            monkeypatch.setattr(cls, "forward", patch)
        out = run(x)
    assert torch.equal(out.float(), torch.full_like(out.float(), 7.0)), (level, layer, when)
