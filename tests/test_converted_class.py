"""A converted module's class: a subclass of the user's class that holds the conversion's
code (its ``__call__`` and ``forward``), the per-module state in one instance slot."""

from __future__ import annotations

import copy
import gc
import inspect
import io
import pickle
import warnings
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import mixprec as amp
from mixprec.convert.structure import (
    KEY_SLOT,
    converted_class,
    forward_of,
    is_converted_exactly,
    user_class,
)

LEVELS = ["O1", "autocast", "O2", "O3"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.norm(self.linear(x)) * scale


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), nn.GELU(), Block())


@pytest.mark.parametrize("level", LEVELS)
def test_a_converted_module_is_of_a_subclass_of_its_class_that_reads_as_it(level: str) -> None:
    model = _model()
    converted = amp.auto_mixed_precision(model, level, torch.bfloat16)
    for (name, original), (_, module) in zip(
        model.named_modules(), converted.named_modules(), strict=True
    ):
        cls = type(original)
        assert isinstance(module, cls), name
        assert user_class(module) is cls
        assert type(module) is not cls
        assert type(module).__bases__[-1] is cls  # (after the conversion's own base)
        mro = type(module).__mro__
        assert mro[mro.index(cls) :] == cls.__mro__
        for attribute in ("__name__", "__qualname__", "__module__"):
            assert getattr(type(module), attribute) == getattr(cls, attribute)
        # the class's forward is the user's, the module's the conversion's
        assert type(module).forward is cls.forward
        assert module.forward is forward_of(module)
    assert repr(converted).splitlines()[2:] == repr(model).splitlines()[1:]  # (the level line)
    shown = inspect.signature(converted[0].forward)
    assert shown == inspect.signature(model[0].forward)
    assert list(shown.parameters) == ["x", "scale"]


@pytest.mark.parametrize("level", LEVELS)
def test_one_converted_class_per_class_and_decisions(level: str) -> None:
    """Modules of one class with equal decisions share a converted class, whose
    ``__call__`` holds their decisions' key as a constant of its code (under
    ``torch.compile`` no module reads a key of its own); an O1 conversion's decisions
    name its own region."""
    converted = amp.auto_mixed_precision(_model(), level, torch.bfloat16)
    again = amp.auto_mixed_precision(_model(), level, torch.bfloat16)
    assert type(converted[0]) is type(converted[2])
    assert type(converted[0].linear) is type(converted[2].linear)
    shared = level != "O1"  # (equal decisions: one key, one class)
    assert (type(converted[0]) is type(again[0])) == shared
    assert (type(converted[0].linear) is type(again[2].linear)) == shared
    for module in converted.modules():
        key = module.__dict__[KEY_SLOT]
        assert type(module) is converted_class(user_class(module), key)
        assert key in type(module).__call__.__code__.co_consts
    assert type(converted).__call__.__code__ is not type(converted[0]).__call__.__code__


_WRAPPED: list[type] = []  # each class _Rewriting's __init_subclass__ wrapped


class _Rewriting(nn.Module):
    """A base class that wraps each subclass's ``forward`` as it is made, as transformers'
    ``GradientCheckpointingLayer`` does: a converted class is such a subclass too."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        forward = cls.forward

        def rewritten(self: nn.Module, *args: Any, **kw: Any) -> Any:
            return forward(self, *args, **kw)

        cls.forward = rewritten  # type: ignore[method-assign]
        _WRAPPED.append(cls)


class _Layer(_Rewriting):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("hooked", [False, True])
def test_a_base_class_that_rewrites_forward_keeps_the_conversion(level: str, hooked: bool) -> None:
    """The converted class's own ``forward`` and ``__call__`` stand whatever a base's
    ``__init_subclass__`` set: a float32-pinned layer computes in float32, with a hook
    (its call then goes through ``nn.Module._call_impl`` and ``module.forward``) too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Layer(), nn.Linear(4, 4))
    converted = amp.auto_mixed_precision(model, level, torch.bfloat16, fp32_modules=["1"])
    seen: list[torch.dtype] = []
    converted[1].linear.register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    if hooked:
        converted[1].register_forward_hook(lambda m, a, out: None)
    out = converted(torch.randn(3, 4))
    assert seen == [torch.float32]
    assert out.dtype == (torch.bfloat16 if level == "autocast" else torch.float32)
    assert type(converted[1]).forward is _Layer.forward
    assert [_Layer] == _WRAPPED  # (the converted class is not the user's: not rewritten)


class _OwnCall(nn.Module):
    """A class with a ``__call__`` of its own (which calls ``nn.Module.__call__``)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return super().__call__(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


@pytest.mark.parametrize("level", LEVELS)
def test_a_class_with_its_own_call_keeps_it(level: str) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    own = nn.Sequential(nn.Linear(4, 4), _OwnCall())
    own[1].linear.load_state_dict(plain[1].state_dict())
    own[0].load_state_dict(plain[0].state_dict())
    x = torch.randn(3, 4)
    expected = amp.auto_mixed_precision(plain, level, torch.bfloat16)(x)
    converted = amp.auto_mixed_precision(own, level, torch.bfloat16)
    assert torch.equal(converted(x), expected)
    assert converted[1].calls == 1
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(converted, backend="eager")(x)
    assert torch.equal(compiled, expected.detach())


@pytest.mark.parametrize("level", LEVELS)
def test_module_compile_in_place(level: str) -> None:
    converted = amp.auto_mixed_precision(_model(), level, torch.bfloat16)
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected = converted(x)
    torch._dynamo.reset()
    converted.compile(backend="eager")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(converted(x), expected)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_copy_is_of_the_converted_class_with_its_decisions(level: str, how: str) -> None:
    converted = amp.auto_mixed_precision(_model(), level, torch.bfloat16)
    if how == "deepcopy":
        twin = copy.deepcopy(converted)
    elif how == "pickle":
        twin = pickle.loads(pickle.dumps(converted))
    else:
        buffer = io.BytesIO()
        torch.save(converted, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)
    x = torch.randn(3, 4)
    with torch.no_grad():
        assert torch.equal(twin(x), converted(x))
    for module, copied in zip(converted.modules(), twin.modules(), strict=True):
        assert user_class(copied) is user_class(module)
        assert (KEY_SLOT in copied.__dict__) == (KEY_SLOT in module.__dict__)
        assert type(copied) is converted_class(user_class(copied), copied.__dict__[KEY_SLOT])
        if level != "O1":  # (an O1 copy's region is its own: its key is in its facts)
            assert copied.__dict__.get(KEY_SLOT) == module.__dict__.get(KEY_SLOT)
            assert type(copied) is type(module)
        assert forward_of(copied) is not forward_of(module)


@pytest.mark.parametrize("level", ["autocast", "O2", "O3"])
def test_converted_copies_of_a_model_share_compiled_graphs(level: str) -> None:
    """Equal decisions have one key: a second converted copy of the model runs the graph
    compiled for the first (its own weights, no recompilation), as a copy of the
    original does."""
    x = torch.randn(3, 4)
    first = amp.auto_mixed_precision(_model(), level, torch.bfloat16)
    second = amp.auto_mixed_precision(_model(), level, torch.bfloat16)
    with torch.no_grad():
        for parameter in second.parameters():
            parameter.add_(0.5)
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.compile(first, backend="eager")(x)
            with torch._dynamo.config.patch(error_on_recompile=True):
                out = torch.compile(second, backend="eager")(x)
        assert torch.equal(out, second(x))
        assert not torch.equal(out, first(x))


@pytest.mark.parametrize("level", LEVELS)
def test_a_module_parametrized_before_conversion_can_drop_its_parametrization(
    level: str,
) -> None:
    """``register_parametrization`` gives a module a class of its own over its class;
    the converted module's is made over the converted class, so ``remove_parametrizations``
    (which deletes the property from the module's class and restores its base) leaves
    the converted class, and the user's module keeps its parametrization."""
    model = _model()
    nn.utils.parametrizations.weight_norm(model[0].linear)
    converted = amp.auto_mixed_precision(model, level, "bf16")
    layer = converted[0].linear
    assert type(layer).__name__ == "ParametrizedLinear"
    assert isinstance(layer, nn.Linear)
    assert user_class(layer) is nn.Linear
    x = torch.randn(2, 4)
    before = converted(x)
    nn.utils.parametrize.remove_parametrizations(layer, "weight")
    assert is_converted_exactly(layer)  # a converted Linear (of its decisions)
    assert user_class(layer) is nn.Linear
    assert not nn.utils.parametrize.is_parametrized(layer)
    assert torch.allclose(converted(x).float(), before.float(), atol=1e-2)
    assert nn.utils.parametrize.is_parametrized(model[0].linear, "weight")
    assert type(model[0].linear).__name__ == "ParametrizedLinear"
    assert torch.allclose(model(x), before.float(), atol=5e-2)  # the user's runs as it did


class _CountCalls:
    """A mixin a wrapper library puts in front of a module's class."""

    calls: ClassVar[list[str]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _CountCalls.calls.append(type(self).__name__)
        return super().__call__(*args, **kwargs)  # type: ignore[misc]


@pytest.mark.parametrize("level", LEVELS)
def test_a_class_made_over_a_converted_class_keeps_a_call_of_its_own(level: str) -> None:
    """A class made over a converted class calls through the module's own key (its class
    is not the converted one), except where a class between them defines ``__call__`` (a
    mixin's, or an intermediate subclass's): that one runs, as over the user's class,
    and reaches the converted call."""
    x = torch.randn(2, 4)
    expected = amp.auto_mixed_precision(nn.Linear(4, 4), level, torch.bfloat16)
    layer = amp.auto_mixed_precision(nn.Linear(4, 4), level, torch.bfloat16)
    layer.load_state_dict(expected.state_dict())
    converted = type(layer)
    layer.__class__ = type("Counted", (_CountCalls, converted), {})
    _CountCalls.calls.clear()
    assert torch.equal(layer(x), expected(x))
    assert _CountCalls.calls == ["Counted"]

    class Intermediate(converted):  # type: ignore[misc, valid-type]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            _CountCalls.calls.append("Intermediate")
            return super().__call__(*args, **kwargs)

    class Leaf(Intermediate):
        pass

    layer.__class__ = Leaf
    _CountCalls.calls.clear()
    assert torch.equal(layer(x), expected(x))
    assert _CountCalls.calls == ["Intermediate"]
    assert Leaf.__call__ is Intermediate.__call__
    assert not is_converted_exactly(layer)


def test_o1_conversions_leave_no_classes_behind() -> None:
    """Each O1 conversion (and each copy of one) makes converted classes of its own (its
    decisions name its region); they go with its modules. The other levels' classes are
    one per class and decision set, shared by every conversion, and kept."""
    gc.collect()
    before = len(nn.Linear.__subclasses__())
    for _ in range(20):
        converted = amp.auto_mixed_precision(_model(), "O1", torch.bfloat16)
        copy.deepcopy(converted)(torch.randn(3, 4))
        del converted
    gc.collect()
    assert len(nn.Linear.__subclasses__()) <= before + 1
    first = amp.auto_mixed_precision(_model(), "O2", torch.bfloat16)
    second = amp.auto_mixed_precision(_model(), "O2", torch.bfloat16)
    assert type(first[0].linear) is type(second[0].linear)


_REGISTRY: dict[str, type] = {}


class _Registering(nn.Module):
    """A base that keeps a registry of its subclasses by name, filled by
    ``__init_subclass__`` (as plugin registries are), which refuses a second class of
    one name."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__name__ in _REGISTRY:
            raise TypeError(f"a second plugin named {cls.__name__}")
        _REGISTRY[cls.__name__] = cls


class _Plugin(_Registering):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


@pytest.mark.parametrize("level", LEVELS)
def test_a_converted_class_called_makes_a_module_of_the_users_class(level: str) -> None:
    """``type(converted)(...)`` makes a new module of the user's class, unconverted, as a
    module the user makes is: it calls and computes as the original class's (it raised
    ``KeyError: '_mixprec_forward'``). A registry filled by a base's ``__init_subclass__``
    never receives a converted class."""
    torch.manual_seed(0)
    converted = amp.auto_mixed_precision(nn.Sequential(nn.Linear(4, 4), _Plugin(4)), level, "bf16")
    x = torch.randn(2, 4)
    made = type(converted[0])(4, 4)
    assert type(made) is nn.Linear
    assert made(x).dtype == torch.float32
    assert type(type(converted[1])(4)) is _Plugin
    # a converted class is the conversion's, not the program's: the registry a base's
    # ``__init_subclass__`` fills never receives it (this one refused conversion)
    assert {"_Plugin": _Plugin} == _REGISTRY


@pytest.mark.parametrize("level", LEVELS)
def test_a_converted_class_made_empty_stays_converted(level: str) -> None:
    """Copies that make an empty module with ``__new__`` and fill it (``copy.deepcopy`` of
    a parametrized module, ``DataParallel``'s replicas) keep the converted class: only a
    module made by calling the class (its ``__init__``) is the user's."""
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    converted = amp.auto_mixed_precision(
        nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), level, "bf16"
    )
    nn.utils.parametrizations.weight_norm(converted[0])
    twin = copy.deepcopy(converted)
    assert torch.equal(twin(x), converted(x))
    layer = converted[1]
    if level in ("O2", "O3"):  # (its forward holds the module: a replica would compute
        # with the original's weights, not the replica's copies)
        with pytest.raises(TypeError, match="DataParallel cannot replicate"):
            layer._replicate_for_data_parallel()
        return
    replica = layer._replicate_for_data_parallel()  # (its tensors are set by replicate())
    assert type(replica) is type(layer)
    assert replica.__dict__["_mixprec_forward"] is layer.__dict__["_mixprec_forward"]


class _NewTakesArguments(nn.Module):
    """A class whose ``__new__`` takes the constructor's arguments."""

    def __new__(cls, width: int) -> _NewTakesArguments:
        made = super().__new__(cls)
        made.tag = f"made {width}"
        return made

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


@pytest.mark.parametrize("level", LEVELS)
def test_a_class_whose_new_takes_arguments_converts(level: str) -> None:
    """The structural copy makes a module of a class whose ``__new__`` takes arguments
    without calling it (``Odd.__new__() missing 1 required positional argument``)."""
    torch.manual_seed(0)
    model = nn.Sequential(_NewTakesArguments(4))
    converted = amp.auto_mixed_precision(model, level, "bf16")
    x = torch.randn(2, 4)
    assert converted[0].tag == "made 4"
    torch.testing.assert_close(converted(x).float(), model(x), rtol=0.02, atol=0.02)


class _Slotted(nn.Module):
    """A module that keeps state in ``__slots__`` (set in ``__init__``, read in forward)."""

    __slots__ = ("scale",)

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scale = 3.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


@pytest.mark.parametrize("level", LEVELS)
def test_a_module_with_slots_keeps_their_values(level: str) -> None:
    """A module's ``__slots__`` values go with it into the conversion (its copy took the
    instance dict alone: ``AttributeError: 'scale'`` at the first call); its converted
    class is made over the user's (a layout of its own)."""
    torch.manual_seed(0)
    model = nn.Sequential(_Slotted(), nn.ReLU())
    converted = amp.auto_mixed_precision(model, level, "bf16")
    x = torch.randn(2, 4)
    assert converted[0].scale == 3.0
    with torch.autocast("cpu", torch.bfloat16):
        want = model(x)
    assert isinstance(converted[0], _Slotted)
    # (bfloat16 rounding of the product apart: O1 multiplies the cast-back result in
    # float32, autocast in bfloat16)
    torch.testing.assert_close(converted(x).float(), want.float(), rtol=2**-7, atol=1e-6)
