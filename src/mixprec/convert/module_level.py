"""Module-level mixed precision (O2 and O3).

A converted module is a structural copy of the original (same classes, same Parameter
objects, same ``state_dict`` keys). Its precision lives in the module tree, so every way
of running it (the root's ``forward``, a submodule, another method such as
``generate()``, a checkpointed recomputation, two threads at once) computes the same:

1. every module gets an instance ``forward`` (:class:`~.cast_at_use.ModuleCall`); the
   root's casts its floating tensor arguments to the low dtype (tensors inside containers,
   such as a detection model's targets, are left to the modules that use them) and
   floating outputs to float32;
2. a module whose Parameters compute in low precision reads them, while it runs, as casts
   made once per outermost call (:class:`~.cast_at_use.LowParameters`); the stored
   Parameters keep their dtype and identity, so gradients reach the float32 Parameters,
   an optimizer built before conversion keeps working, and every write to a weight is
   what the next call computes with. Buffers stay float32 and are read as they are
   (running statistics, counters and EMAs updated in place keep float32 precision);
3. modules that run in float32 (norms on the black list, modules pinned to float32,
   parametrizations, whose math runs on the float32 original) cast their inputs up and
   their outputs back down in their ``ModuleCall`` (their hooks see what their caller
   passed, as a layer's do); a norm whose kernel computes in float32 from a low input
   (:func:`~.cast_at_use.fused_island`) takes it as it is, the same values (within one rounding) with no cast
   kernels; batch and instance norms that compute in low precision (O3) keep float32
   weights and running statistics, which their kernels take with a low-precision input;
4. every low-precision module with weights casts its floating inputs down in its
   ``ModuleCall`` (a no-op when they already are; no hook, so a module without hooks of
   the user's keeps ``nn.Module``'s fast call path), so a tensor the model makes in float32 inside its forward still
   reaches the next layer in low precision, as MindSpore casts each cell's inputs;
5. operands the model itself mixes follow ``torch.autocast``'s rule
   (:class:`~.cast_at_use.MixedOperands`) in the code of the entry module (the root, or
   a submodule called directly), of loss modules and of modules that hold floating
   buffers, where a model mixes them (a loss on the logits, a float32 buffer in a matmul).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

from mixprec.convert import weight_hooks
from mixprec.convert.cast_at_use import (
    CastState,
    LowParameters,
    ModuleCall,
    fused_island,
    has_fast_path,
)
from mixprec.convert.plan import Cast, CastPlan, Conversion, PlanRow, RowKind, dtype_name
from mixprec.convert.structure import (
    CONVERSION_ATTR,
    ExtraRepr,
    add_repr_note,
    forward_of,
    qualified_name,
    set_forward,
    set_parameters,
    structural_copy,
)
from mixprec.policy import lists
from mixprec.policy.dtypes import is_castable
from mixprec.policy.levels import Precision, Recipe

__all__ = ["ExtraRepr", "convert_added", "convert_module_level"]


def _device_type(module: nn.Module, root: nn.Module | None) -> str:
    """The device type of ``module``'s state (of the model's, when it holds none)."""
    for owner in (module,) if root is None else (module, root):
        for tensor in itertools.chain(owner.parameters(), owner.buffers()):
            return tensor.device.type
    return "cpu"


class _Walk:
    """One walk over a module tree that converts it at module level: each module's
    precision from the recipe and its parent's, its ``ModuleCall`` and its
    ``LowParameters``, and the plan's rows. ``root`` is None for a module added to a
    converted model after conversion (:func:`convert_added`)."""

    def __init__(
        self, recipe: Recipe, state: CastState, root: nn.Module | None, rows: list[PlanRow]
    ) -> None:
        self.recipe = recipe
        self.state = state
        self.low = recipe.dtype
        self.root = root
        self.rows = rows
        self.seen_modules: set[int] = set()
        self.seen_tensors: set[int] = set()
        #: id(module) -> where it was converted, what it computes in there and its parent
        self.places: dict[int, tuple[str, Precision, Precision]] = {}

    def _agree(self, module: nn.Module, path: str, parent: Precision) -> None:
        """A module reached a second time (shared: a tied layer, a block in two places)
        computes in one precision: refuse one whose second place decides another, when it
        holds weights (its call there would meet inputs of the other dtype)."""
        first, precision, first_parent = self.places[id(module)]
        here = self.recipe.module_precision(module, path, parent)
        if next(module.parameters(), None) is None:
            return
        if here is precision:
            call = forward_of(module)
            if precision is Precision.FP32 and parent is not first_parent:
                # (its parents compute in two precisions: it casts its inputs up, as an
                # island does, and hands its outputs on in float32, which a low layer
                # after it casts down and a float32 one takes)
                call.dtype = torch.float32
                call.output_dtype = None
                call.island = False
                set_forward(module, call)  # (its decisions changed: their key too)
            return
        raise ValueError(
            f"module {path or '(the network)'!r} is the same module as {first!r}, where it "
            f"computes in {_name(precision, self.low)}; here it would compute in "
            f"{_name(here, self.low)} (a float32 or low pin on one of its parents). A "
            "shared module computes in one precision: pin it at both names "
            f"(fp32_modules=[{first!r}, {path!r}] or low_modules=[...])"
        )

    def visit(self, module: nn.Module, path: str, parent: Precision) -> None:
        if id(module) in self.seen_modules:
            self._agree(module, path, parent)
            return
        if self.root is None and forward_of(module) is not None:
            return  # (added to a converted model: a converted module keeps its conversion)
        if isinstance(module, OptimizedModule) and module is not self.root:
            # a submodule the user compiled: the module it compiles converts, and the
            # wrapper calls it, as the original's does (TorchDynamo, compiling the whole
            # model, unwraps it: a converted wrapper's call would break the graph)
            self.seen_modules.add(id(module))
            self.visit(module._orig_mod, qualified_name(path, "_orig_mod"), parent)
            return
        self.seen_modules.add(id(module))
        precision = self.recipe.module_precision(module, path, parent)
        self.places[id(module)] = (path, precision, parent)
        dtype = self.low if precision is Precision.LOW else torch.float32
        cast_in: torch.dtype | None = None  # what the module casts its floating inputs to
        cast_out: torch.dtype | None = None  # what an island casts its outputs back to
        fused: frozenset[str] = frozenset()
        if precision is not parent and module is not self.root:
            # an island: it casts its inputs in and its outputs back in its own call
            cast_in = dtype
            cast_out = self.low if parent is Precision.LOW else torch.float32
            if dtype == torch.float32:
                fused = fused_island(module)
            # (the plan assumes the device the module's state is on at conversion)
            kernel = fused and _device_type(module, self.root) in fused
            self.rows.append(
                PlanRow.make(
                    path,
                    type(module).__name__,
                    dtype,
                    () if kernel else [Cast("input", dtype)],
                    () if kernel else [Cast("output", cast_out)],
                    kind=RowKind.ISLAND,
                    note="island",
                )
            )
        cast_here: list[Cast] = []
        if precision is Precision.LOW and not isinstance(module, lists.FP32_STATE_MODULES):
            kept = weight_hooks.prepare(module, self.low)  # an old weight hook's originals
            owned = [
                (n, t)
                for n, t in module._parameters.items()
                if t is not None and is_castable(t) and n not in kept
            ]
            for name, tensor in owned:
                if tensor.dtype != self.low and id(tensor) not in self.seen_tensors:
                    cast_here.append(Cast(qualified_name(path, name), self.low))
                self.seen_tensors.add(id(tensor))
            computed = weight_hooks.computed_weights(module)
            cast_here += [Cast(qualified_name(path, name), self.low) for name in computed]
            if owned or kept:
                set_parameters(module, LowParameters(module._parameters, kept, self.state))
            fast = has_fast_path(module)  # its fused kernels take its children's weights
            if (owned or kept or fast) and module is not self.root and precision is parent:
                cast_in = self.low
        if module is not self.root:
            island = precision is Precision.FP32
            # a fused layer kernel takes every weight of the layer in one dtype
            mixed = isinstance(module, nn.TransformerEncoderLayer) and any(
                self.recipe.module_precision(child, qualified_name(path, name), precision)
                is not precision
                for name, child in module.named_children()
            )
            call = ModuleCall(
                module,
                self.state,
                float32=island,
                dtype=cast_in,
                output_dtype=cast_out,
                fused=fused,
                mixed_kernel=mixed,
                path=path,
            )
            set_forward(module, call)
        if cast_here:
            self.rows.append(
                PlanRow.make(
                    path,
                    type(module).__name__,
                    dtype,
                    cast_here,
                    kind=RowKind.WEIGHTS,
                    note="weights",
                )
            )
        for name, child in module._modules.items():
            if child is not None:
                self.visit(child, qualified_name(path, name), precision)


def _name(precision: Precision, low: torch.dtype) -> str:
    return "float32" if precision is Precision.FP32 else dtype_name(low)


def convert_added(parent: ModuleCall, name: str, child: nn.Module) -> None:
    """Convert ``child``, registered as ``name`` in a module converted at O2/O3 (whose
    forward is ``parent``), as conversion would have converted it there: its precision
    from the conversion's recipe (lists and pins, by its class and its qualified name) and
    its parent's, its weights read low where it computes low, an island where its
    precision differs from its parent's. Modules in it that are converted already (a
    converted module moved into a new container) keep their conversion. A changed model
    then computes as the changed original, converted, would: the same decisions, eagerly
    and compiled (where no mode reconciles a float32 layer with low activations).
    (The conversion's plan, made at conversion, is not redone: ``explain`` with inputs
    counts what a call casts.)"""
    recipe = parent.state.recipe
    if recipe is None:  # (a state made without one: nothing to decide by)
        return
    precision = Precision.FP32 if parent.float32 else Precision.LOW
    walk = _Walk(recipe, parent.state, None, [])
    walk.visit(child, qualified_name(parent.path, name), precision)


def convert_module_level(
    network: nn.Module,
    recipe: Recipe,
    *,
    output_dtype: torch.dtype | None = torch.float32,
    prefix: str = "",
    copy: bool = True,
) -> nn.Module:
    """Convert ``network`` at module level: everything low but the float32 islands.

    Args:
        network: the module (not modified when ``copy`` is True).
        recipe: O2 (black list) or O3 (empty black list) recipe; pins apply.
        output_dtype: floating outputs are cast to this (None: left as computed).
        prefix: the module's qualified name inside a larger model (for the plan).
        copy: convert a structural copy (True) or ``network`` itself (already a copy).

    Returns:
        The converted module: same class as ``network``, same Parameters.
    """
    root = structural_copy(network) if copy else network
    low = recipe.dtype
    state = CastState(low, recipe)
    # a root pinned to float32 (or on the black list) takes and computes float32 throughout
    pinned = recipe.module_precision(root, prefix, Precision.LOW) is Precision.FP32
    given = torch.float32 if pinned else low
    rows: list[PlanRow] = [
        PlanRow.make(
            prefix, "inputs", given, [Cast("floating tensor arguments", given)], kind=RowKind.INPUTS
        )
    ]
    _Walk(recipe, state, root, rows).visit(root, prefix, Precision.LOW)
    if output_dtype is not None:
        rows.append(
            PlanRow.make(
                prefix,
                "outputs",
                given,
                (),
                [Cast("floating outputs", output_dtype)],
                kind=RowKind.OUTPUTS,
            )
        )
    set_forward(
        root,
        ModuleCall(root, state, root=True, output_dtype=output_dtype, float32=pinned, path=prefix),
    )
    plan = CastPlan(level=recipe.level.value, dtype=dtype_name(low), rows=tuple(rows))
    root.__dict__[CONVERSION_ATTR] = Conversion(recipe, plan)
    add_repr_note(root, f"mixprec: {recipe.describe()}")
    return root
