"""``apply_fp8``: the module swap that puts chosen linear layers in fp8.

torchao's swap, the mixprec way: a post-order walk over ``named_children()`` of a
structural copy of the model (the user's module is never edited), each chosen
``nn.Linear`` replaced by a layer that computes with the very same Parameters, so an
optimizer built before the swap keeps stepping the weights the model uses.

Which layers: by default every plain ``nn.Linear`` whose two dimensions are multiples of
16 (what fp8 GEMM kernels take), except the model's first and last linear layers (the
embedding-like input projection and the head, where fp8 costs accuracy and saves little);
a filter ``(module, qualified_name) -> bool`` replaces that rule. A layer pinned to
float32 (``fp32_modules``) is never swapped, whatever the filter says.

How they run: emulated (:class:`~mixprec.fp8.linear.Fp8Linear`, bit-identical to torchao's
``emulate=True``) on any machine, or natively through torchao's ``convert_to_float8_training``
on a CUDA GPU with fp8 (compute capability 8.9 or newer).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mixprec._check import require_module
from mixprec.convert.structure import structural_copy
from mixprec.fp8.linear import Fp8Linear
from mixprec.fp8.recipes import Fp8Config, Fp8Recipe

__all__ = [
    "Fp8Filter",
    "apply_fp8",
    "chosen_layers",
    "default_fp8_filter",
    "fp8_layers",
    "native_fp8_missing",
]

#: A filter choosing the layers: ``(module, qualified_name) -> bool``.
Fp8Filter = Callable[[nn.Module, str], bool]


def _candidates(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The linear layers that can be swapped: ``nn.Linear`` or a subclass with its forward."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and not isinstance(module, Fp8Linear)
        and type(module).forward is nn.Linear.forward
    ]


def default_fp8_filter(model: nn.Module) -> Fp8Filter:
    """The default choice for ``model``: dims multiples of 16, not the first or last linear.

    Example:
        >>> choose = default_fp8_filter(model)
        >>> [name for name, m in model.named_modules() if choose(m, name)]
        ['1', '3']
    """
    names = [name for name, _ in _candidates(model)]
    ends = frozenset(names[:1] + names[-1:])

    def choose(module: nn.Module, name: str) -> bool:
        return (
            isinstance(module, nn.Linear)
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
            and name not in ends
        )

    return choose


def chosen_layers(
    model: nn.Module, filter: Fp8Filter | None, fp32_pin: Fp8Filter | None
) -> list[tuple[str, nn.Linear]]:
    """The linear layers ``apply_fp8`` puts in fp8: chosen by ``filter`` (default
    :func:`default_fp8_filter`), not pinned by ``fp32_pin``; by qualified name."""
    choose = default_fp8_filter(model) if filter is None else filter
    return [
        (name, module)
        for name, module in _candidates(model)
        if choose(module, name) and not (fp32_pin is not None and fp32_pin(module, name))
    ]


def native_fp8_missing(device: torch.device) -> str | None:
    """What native fp8 training lacks on ``device`` (None when nothing is missing)."""
    if device.type != "cuda":
        return (
            f"native fp8 needs a CUDA GPU with fp8 (compute capability 8.9 or newer); the model "
            f"is on {device.type}"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return (
            f"native fp8 needs a GPU with fp8 (compute capability 8.9 or newer); {name} has "
            f"{major}.{minor}"
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "native fp8 needs torchao (pip install 'mixprec[fp8]')"
    return None


def _device_of(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def apply_fp8(
    model: nn.Module,
    recipe: Fp8Recipe | str | None,
    *,
    filter: Fp8Filter | None = None,
    fp32_pin: Fp8Filter | None = None,
    emulate: bool | None = None,
    inplace: bool = False,
) -> nn.Module:
    """A copy of ``model`` (sharing its Parameters) whose chosen linear layers run in fp8.

    Args:
        model: the model; it is not modified (unless ``inplace``).
        recipe: ``"tensorwise"``, ``"rowwise"`` or ``"rowwise_with_gw_hp"``; None returns
            ``model`` itself (what the ``fp8=`` option of every entry point passes through).
        filter: ``(module, qualified_name) -> bool`` choosing the layers among the
            ``nn.Linear`` ones; default :func:`default_fp8_filter`.
        fp32_pin: layers never to swap (the level's float32 pins).
        emulate: True: emulated fp8 (any machine); False: native through torchao (a CUDA
            GPU with fp8); None: native on CUDA, emulated elsewhere.
        inplace: swap the layers in ``model`` itself (what FSDP2's in-place sharding needs)
            instead of in a copy.

    Returns:
        The copy (``model`` itself with ``inplace``); ``explain()`` and ``print()`` show each fp8 layer and its recipe.

    Raises:
        ValueError: an unknown recipe; native fp8 where the GPU or torchao is missing (the
            message names what is missing); a chosen layer whose dims native fp8 cannot take.
        TypeError: ``filter`` or ``fp32_pin`` not callable, ``emulate`` not a bool or None.

    Example:
        >>> fp8_model = apply_fp8(model, "rowwise", emulate=True)
        >>> sum(isinstance(m, Fp8Linear) for m in fp8_model.modules())
        2
    """
    require_module(model, "model")
    if recipe is None:
        return model
    config = Fp8Config.from_recipe(Fp8Recipe.parse(recipe, "fp8"))
    for argument, value in (("filter", filter), ("fp32_pin", fp32_pin)):
        if value is not None and not callable(value):
            raise TypeError(
                f"{argument} must be a function (module, qualified_name) -> bool; got {value!r}"
            )
    if emulate is not None and not isinstance(emulate, bool):
        raise TypeError(f"emulate must be True, False or None; got {emulate!r}")
    device = _device_of(model)
    if emulate is None:
        emulate = device.type != "cuda"
    if not emulate:
        missing = native_fp8_missing(device)
        if missing is not None:
            raise ValueError(f"{missing}. Pass emulate=True to check fp8 numerics anywhere")
    chosen = {name for name, _ in chosen_layers(model, filter, fp32_pin)}
    copy = model if inplace else structural_copy(model)
    if emulate:
        return _swap(
            copy, "", lambda linear, name: Fp8Linear.from_linear(linear, config, name), chosen
        )
    return _swap_native(copy, config, chosen)


def _swap(
    module: nn.Module,
    prefix: str,
    make: Callable[[nn.Linear, str], nn.Module],
    chosen: set[str],
) -> nn.Module:
    """Post-order: children first, then ``module`` itself if it is chosen."""
    for name, child in list(module.named_children()):
        path = f"{prefix}.{name}" if prefix else name
        new = _swap(child, path, make, chosen)
        if new is not child:
            setattr(module, name, new)
    if prefix in chosen and isinstance(module, nn.Linear):
        return make(module, prefix)
    return module


def _swap_native(model: nn.Module, config: Fp8Config, chosen: set[str]) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    modules = dict(model.named_modules())
    for name in sorted(chosen):
        linear = modules[name]
        assert isinstance(linear, nn.Linear)
        if linear.in_features % 16 or linear.out_features % 16:
            raise ValueError(
                f"native fp8 needs linear dims that are multiples of 16; layer {name!r} is "
                f"{linear.in_features}x{linear.out_features}: leave it out with filter="
            )
    ao_config = Float8LinearConfig.from_recipe_name(config.recipe.value)
    names = {id(modules[name]): name for name in chosen}
    return convert_to_float8_training(
        model,
        module_filter_fn=lambda module, fqn: names.get(id(module)) is not None,
        config=ao_config,
    )


def fp8_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The fp8 layers of ``model`` (emulated or torchao's), by qualified name."""
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear) or type(module).__name__ == "Float8Linear":
            found[name] = module
    return found
