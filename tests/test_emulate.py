"""Emulated low precision on whole networks: numerics, training, loss scaling, entry points."""

from __future__ import annotations

import contextlib
import copy
import inspect
import pickle
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import mixprec as amp
from conftest import AVX2_ONLY, fake_cpu
from helpers import rel_error
from mixprec.cli.models import SmallCNN, TinyMLP, TinyTransformer
from mixprec.convert.emulate import EmulationMode, is_emulated
from mixprec.inspect import CastCounter
from mixprec.policy.ops import only_plain_tensors

LEVELS = ("O1", "O2", "autocast")


def _nets() -> dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return {
        "mlp": (TinyMLP(), torch.randn(8, 16), torch.randint(0, 8, (8,))),
        "cnn": (SmallCNN(), torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))),
        "transformer": (TinyTransformer(), torch.randint(0, 50, (4, 6)), torch.randint(0, 5, (4,))),
    }


def _loss_and_grads(net: nn.Module, owner: nn.Module, x: torch.Tensor, y: torch.Tensor):
    owner.zero_grad(set_to_none=True)
    out = net(x)
    F.cross_entropy(out.float(), y).backward()
    grads = torch.cat([p.grad.float().flatten() for p in owner.parameters() if p.grad is not None])
    return out.detach().float(), grads


def _no_mode_left() -> bool:
    stack = torch.overrides._get_current_function_mode_stack()
    return not any(isinstance(mode, EmulationMode) for mode in stack)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_network_emulated_is_closer_to_native_than_native_to_fp32(
    name: str, level: str, dtype: str
) -> None:
    """Outputs and the float32 Parameters' gradients (a training backward)."""
    model, x, y = _nets()[name]
    model.train()
    ref_out, ref_grads = _loss_and_grads(model, model, x, y)
    native = amp.auto_mixed_precision(model, level, dtype)
    nat_out, nat_grads = _loss_and_grads(native, model, x, y)
    emulated = amp.auto_mixed_precision(model, level, dtype, emulate=True)
    with CastCounter() as counter:
        emu_out, emu_grads = _loss_and_grads(emulated, model, x, y)
    low = amp.explain(emulated).dtype
    assert any(
        source != torch.float32 and target == torch.float32 for source, target in counter.casts
    )
    assert low in ("bfloat16", "float16")
    assert emulated(x).dtype == native(x).dtype
    # attention is emulated whole (native rounds its projections and probabilities too):
    # there the emulated values sit between native and float32, a little further off
    factor = 1.5 if name == "transformer" else 1.0
    for emu, nat, ref in ((emu_out, nat_out, ref_out), (emu_grads, nat_grads, ref_grads)):
        assert rel_error(emu, nat) <= factor * rel_error(nat, ref) + 1e-6
    assert _no_mode_left()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_training_steps_follow_native_training(level: str) -> None:
    """Five steps of build_train_network: emulated losses track native ones closer than
    native ones track float32."""
    model, x, y = _nets()["mlp"]
    losses = {}
    for variant, options in {
        "fp32": {"level": "O0"},
        "native": {"level": level, "dtype": "bf16"},
        "emulated": {"level": level, "dtype": "bf16", "emulate": True},
    }.items():
        net = copy.deepcopy(model)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        step = amp.build_train_network(net, optimizer, nn.CrossEntropyLoss(), **options)
        losses[variant] = torch.stack([step(x, y) for _ in range(5)])
        if variant == "emulated":
            assert "emulated=bfloat16" in repr(step)
    assert rel_error(losses["emulated"], losses["native"]) <= rel_error(
        losses["native"], losses["fp32"]
    )


class _Huge(nn.Module):
    """A layer whose float16 gradients overflow at a large loss scale."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        with torch.no_grad():
            self.fc.weight.fill_(30.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _square_loss(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def test_fp16_overflow_backs_the_loss_scale_off_as_natively() -> None:
    x, y = torch.full((2, 4), 20.0), torch.tensor([0, 1])
    traces = {}
    for emulate in (False, True):
        torch.manual_seed(0)
        model = _Huge()
        manager = amp.DynamicLossScaleManager(init_loss_scale=2.0**14, scale_window=100)
        step = amp.build_train_network(
            model,
            torch.optim.SGD(model.parameters(), lr=0.0),
            _square_loss,
            level="O2",
            dtype="fp16",
            loss_scale_manager=manager,
            emulate=emulate,
        )
        trace = []
        for _ in range(4):
            step(x, y)
            trace.append((step.overflow, step.loss_scale))
        traces[emulate] = trace
    assert traces[True] == traces[False]
    assert traces[True][0] == (True, 2.0**13)  # the first step overflowed and backed off


def test_every_entry_point_runs_emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model, a submodule, a helper method, checkpointed recomputation and another
    thread run under the mode; a backward called outside the model runs float32 GEMMs."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

        def features(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(checkpoint(self.a, x, use_reentrant=False).relu())

    net = amp.auto_mixed_precision(Net(), "O2", "bf16", emulate=True)
    x = torch.randn(3, 8)
    seen: list[object] = []
    original = EmulationMode.__torch_function__

    def spy(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is F.linear:
            seen.append(threading.get_ident())
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(EmulationMode, "__torch_function__", spy)

    def linears(fn) -> int:  # type: ignore[no-untyped-def]
        seen.clear()
        # O2 itself may refuse a submodule called alone (weights are cast in the model's
        # forward); the mode has seen the call by then, which is what is checked here
        with contextlib.suppress(RuntimeError):
            fn()
        return len(seen)

    assert linears(lambda: net(x)) == 2
    assert linears(lambda: net.b(x)) == 1
    assert linears(lambda: net.features(x)) == 1
    out = net(x)
    assert _no_mode_left()
    with CastCounter() as counter:
        assert linears(lambda: out.sum().backward()) == 1  # a's forward, recomputed
    assert counter.casts[(torch.float32, torch.bfloat16)] >= 2  # float32 gradients rounded
    thread = threading.Thread(target=lambda: net(x))
    seen.clear()
    thread.start()
    thread.join()
    assert len(seen) == 2
    assert threading.get_ident() not in seen
    assert _no_mode_left()


def test_an_exception_inside_forward_leaves_no_mode_active() -> None:
    class Boom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.fc(x)
            raise KeyError("boom")

    net = amp.auto_mixed_precision(Boom(), "O2", "bf16", emulate=True)
    with pytest.raises(KeyError, match="boom"):
        net(torch.randn(2, 4))
    assert _no_mode_left()
    torch.testing.assert_close(torch.ones(2, 2) @ torch.ones(2, 2), torch.full((2, 2), 2.0))


def test_plan_repr_pickle_and_deepcopy_say_emulated() -> None:
    model = TinyMLP()
    net = amp.auto_mixed_precision(model, "O1", "bf16", emulate=True)
    plan = amp.explain(net)
    assert "bfloat16 emulated" in plan.table().splitlines()[0]
    assert plan.to_dict()["emulated"] is True
    assert "emulated=bfloat16" in repr(net)
    native_plan = amp.explain(amp.auto_mixed_precision(model, "O1", "bf16"))
    assert plan.num_casts == native_plan.num_casts
    assert "emulated" not in native_plan.table()
    assert amp.explain(net, torch.randn(2, 16)).to_dict()["emulated"] is True
    x = torch.randn(2, 16)
    for copied in (pickle.loads(pickle.dumps(net)), copy.deepcopy(net)):
        assert is_emulated(copied)
        torch.testing.assert_close(copied(x), net(x))


def test_custom_lists_and_o0() -> None:
    model = TinyMLP()
    net = amp.custom_mixed_precision(model, white_list=[nn.Linear], dtype="bf16", emulate=True)
    assert is_emulated(net)
    assert amp.auto_mixed_precision(model, "O0", emulate=True) is model  # nothing is low
    assert not is_emulated(model)
    assert "emulated" not in repr(model)


def _convert_with(call: str, model: nn.Module, emulate: object) -> object:
    if call == "auto":
        return amp.auto_mixed_precision(model, "O2", emulate=emulate)  # type: ignore[arg-type]
    if call == "custom":
        return amp.custom_mixed_precision(model, white_list=[nn.Linear], emulate=emulate)  # type: ignore[arg-type]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.build_train_network(model, optimizer, level="O2", emulate=emulate)  # type: ignore[arg-type]


@pytest.mark.parametrize("call", ["auto", "custom", "build"])
def test_emulate_must_be_a_bool(call: str) -> None:
    with pytest.raises(TypeError, match=r"emulate must be a bool \(True or False\); got 'yes'"):
        _convert_with(call, TinyMLP(), "yes")


def test_emulation_does_not_warn_that_the_dtype_is_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpu(monkeypatch, AVX2_ONLY)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp.auto_mixed_precision(TinyMLP(), "O2", "bf16", emulate=True)
    with pytest.warns(UserWarning, match="bfloat16"):
        amp.auto_mixed_precision(TinyMLP(), "O2", "bf16")


# ------------------------------------------------------------------ layering on a conversion


@pytest.mark.parametrize("level", ["O1", "autocast", "O2", "O3"])
def test_emulation_keeps_the_level_in_the_repr(level: str) -> None:
    net = amp.auto_mixed_precision(nn.Linear(4, 4), level, "bf16", emulate=True)
    text = repr(net)
    assert f"mixprec: level={level}, dtype=bfloat16" in text
    assert "emulated=bfloat16" in text
    assert "in_features=4" in text


class _Interrupted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if bool(x.abs().max() > 100):  # only on the call that should be interrupted
            raise KeyboardInterrupt
        return y


@pytest.mark.parametrize("level", ["O1", "O2", "O3", "autocast"])
def test_an_interrupt_inside_forward_leaves_no_mode_on_the_stack(level: str) -> None:
    from torch.overrides import _get_current_function_mode_stack

    net = amp.auto_mixed_precision(_Interrupted(), level, "bf16", emulate=True)
    before = len(_get_current_function_mode_stack())
    net(torch.randn(2, 4))
    with pytest.raises(KeyboardInterrupt):
        net(torch.full((2, 4), 1000.0))
    assert len(_get_current_function_mode_stack()) == before
    assert torch.randn(2, 2).bfloat16() @ torch.randn(2, 2).bfloat16() is not None


class _Foreign(torch.Tensor):
    """A tensor subclass with its own dispatch (as torchao's Float8 tensors and DTensor)."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        cls.calls += 1
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def test_emulation_leaves_gemms_on_foreign_tensor_subclasses_alone() -> None:
    from mixprec.convert.emulate import emulating

    weight = torch.randn(4, 4).bfloat16().as_subclass(_Foreign)
    x = torch.randn(2, 4).bfloat16()
    with CastCounter() as counter, emulating():
        out = torch.nn.functional.linear(x, weight)
    assert counter.total == 0  # not upcast: the subclass's own GEMM ran
    assert out.dtype == torch.bfloat16
    assert _Foreign.calls > 0


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_emulated_training_step_with_masters_emulates_the_gemms(level: str) -> None:
    """The step's low-precision Parameter copies (a Parameter subclass with no rules of its
    own) are plain tensors to the emulation: its convolutions run in float32 kernels."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[torch.dtype] = []

    class Convolutions(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.ops.aten.convolution.default:
                seen.append(args[1].dtype)  # the weight
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Flatten(), torch.nn.Linear(8, 2))
    step = amp.build_train_network(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.CrossEntropyLoss(), level,
        dtype="bf16", emulate=True,
    )  # fmt: skip
    low = step.network[0].weight
    assert low.dtype == torch.bfloat16
    assert only_plain_tensors((low,), {})
    with Convolutions():
        step(torch.randn(2, 1, 4, 4), torch.tensor([0, 1]))
    assert seen  # the forward's convolution, at least
    assert set(seen) == {torch.float32}  # emulated: float32 kernels on rounded values


class _Keywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, *, scale: float = 1.0
    ) -> torch.Tensor:
        out = self.fc(x) * scale
        return out if mask is None else out * mask


@pytest.mark.parametrize("level", ["O1", "autocast", "O2", "O3"])
def test_the_root_forward_shows_the_original_signature(level: str) -> None:
    """``generate()`` passes ``position_ids`` or ``attention_mask`` only to a forward whose
    signature names them; ``torch.export`` reads the code object."""
    model = _Keywords()
    emulated = amp.auto_mixed_precision(model, level, "bf16", emulate=True)
    assert inspect.signature(emulated.forward) == inspect.signature(model.forward)
    assert emulated.forward.__code__ is _Keywords.forward.__code__
    assert emulated.forward.__code__.co_varnames[:4] == ("self", "x", "mask", "scale")
    x = torch.randn(2, 4)
    assert emulated(x, torch.ones(2, 4), scale=2.0).dtype == torch.float32
    patched = _Keywords()
    patched.forward = lambda x, y: patched.fc(x + y)  # (an instance forward: its own)
    emulated = amp.auto_mixed_precision(patched, level, "bf16", emulate=True)
    assert list(inspect.signature(emulated.forward).parameters) == ["x", "y"]


@pytest.mark.parametrize("level", ["O1", "autocast"])
def test_generate_on_a_left_padded_batch_matches_native(level: str) -> None:
    """With the signature hidden, ``generate()`` passed no ``position_ids``: the padded
    row's logits were 0.17 off."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.GPT2Config(
        vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32, pad_token_id=0
    )
    model = tf.GPT2LMHeadModel(config).eval()
    ids = torch.randint(1, 64, (2, 6))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0  # left padding

    def generate(net: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        out = net.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=3,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        return out.sequences, out.logits[0]

    native = generate(amp.auto_mixed_precision(model, level, "bf16"))
    emulated = generate(amp.auto_mixed_precision(model, level, "bf16", emulate=True))
    assert torch.equal(emulated[0], native[0])
    assert (emulated[1] - native[1]).abs().max() < 1e-2  # (0 here: same roundings)
