"""``mixprec plan MODULE:CALLABLE --input SHAPE``: the cast plan of a user's model.

The factory is imported from a dotted module path (``package.module:make_model``) or a
file (``path/to/file.py:make_model``) and called with no arguments. The model runs once,
original and converted, on random inputs of the given shapes (so a plan is never shown
for a model that does not run), then :func:`mixprec.explain` prints its plan.

Every user mistake is a :class:`PlanError` with a one-line message; the command line
prints it and exits with status 2. That includes a user file or factory that raises
``SystemExit`` and an input too large to allocate.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import mixprec
from mixprec.cli.terminal import dumps
from mixprec.policy.dtypes import dtype_name, resolve_dtype
from mixprec.policy.levels import Level

__all__ = [
    "InputSpec",
    "PlanError",
    "build_model",
    "load_factory",
    "parse_input",
    "run_model",
    "run_plan",
]

#: Element types an ``--input`` may name before its shape (``int:1,16``).
INPUT_KINDS: dict[str, torch.dtype] = {"float": torch.float32, "int": torch.int64}
#: Integer inputs are drawn from ``[0, INT_HIGH)``: valid indices for any embedding.
INT_HIGH = 2
#: The most elements an ``--input`` may have (torch's sizes are 64-bit).
MAX_ELEMENTS = 2**62


class PlanError(ValueError):
    """A mistake on the command line of ``mixprec plan``, ``find-overflow`` or ``lint``
    (bad path, shape, model, ...): one line, exit status 2."""


@dataclass(frozen=True)
class InputSpec:
    """One ``--input``: a shape and an element type."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def make(self, generator: torch.Generator) -> torch.Tensor:
        """A random tensor of this shape and type."""
        try:
            if self.dtype.is_floating_point:
                return torch.randn(self.shape, generator=generator, dtype=self.dtype)
            return torch.randint(0, INT_HIGH, self.shape, generator=generator, dtype=self.dtype)
        except (RuntimeError, MemoryError) as error:
            size = math.prod(self.shape) * self.dtype.itemsize
            raise PlanError(
                f"--input {self}: cannot allocate {size / 2**30:,.1f} GiB for it (out of memory)"
            ) from error

    def __str__(self) -> str:
        kind = next(k for k, v in INPUT_KINDS.items() if v == self.dtype)
        return f"{kind}:{','.join(map(str, self.shape))}"


def parse_input(text: str) -> InputSpec:
    """``"1,3,32,32"`` -> float32 ``(1, 3, 32, 32)``; ``"int:1,16"`` -> int64 ``(1, 16)``.

    Example:
        >>> parse_input("int:2,8")
        InputSpec(shape=(2, 8), dtype=torch.int64)
    """
    kind, sep, dims = text.strip().rpartition(":")
    if not sep:
        kind = "float"
    if kind not in INPUT_KINDS:
        raise PlanError(
            f"--input {text!r}: unknown element type {kind!r}; "
            f"write SHAPE or TYPE:SHAPE with TYPE one of {', '.join(INPUT_KINDS)}"
        )
    parts = [p.strip() for p in dims.split(",")] if dims.strip() else []
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise PlanError(
            f"--input {text!r}: a shape is positive integers separated by commas, "
            "like 1,3,32,32 (or int:1,16 for integer inputs)"
        )
    shape = tuple(int(p) for p in parts)
    if math.prod(shape) > MAX_ELEMENTS:
        raise PlanError(
            f"--input {text!r}: {math.prod(shape):.3g} elements, more than a tensor can hold "
            f"({MAX_ELEMENTS:.3g})"
        )
    return InputSpec(shape, INPUT_KINDS[kind])


def _import(location: str) -> Any:
    looks_like_file = location.endswith(".py") or "/" in location or "\\" in location
    if looks_like_file:
        path = Path(location)
        if not path.is_file():
            raise PlanError(f"no such file: {location!r} (from MODULE:CALLABLE)")
        name = f"_mixprec_plan_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise PlanError(f"cannot import {location!r}: not a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look the module up
        try:
            spec.loader.exec_module(module)
        except (Exception, SystemExit) as error:
            del sys.modules[name]
            raise PlanError(f"importing {location!r} failed: {_describe(error)}") from error
        return module
    try:
        return importlib.import_module(location)
    except ModuleNotFoundError as error:
        raise PlanError(f"cannot import module {location!r}: {error}") from error
    except (Exception, SystemExit) as error:
        raise PlanError(f"importing {location!r} failed: {_describe(error)}") from error


def load_factory(target: str) -> Callable[[], Any]:
    """The callable named by ``MODULE:CALLABLE`` (``CALLABLE`` may be dotted: ``Cls.make``)."""
    location, sep, attribute = target.rpartition(":")
    if not sep or not location or not attribute:
        raise PlanError(
            f"model {target!r} must be MODULE:CALLABLE, e.g. mixprec.cli.models:lenet5 "
            "or path/to/file.py:make_model"
        )
    found: Any = _import(location)
    for index, part in enumerate(attribute.split(".")):
        if not hasattr(found, part):
            owner = ".".join([location, *attribute.split(".")[:index]])
            public = sorted(n for n in dir(found) if not n.startswith("_"))
            callables = [n for n in public if callable(getattr(found, n, None))][:12]
            hint = f"; it has {', '.join(callables)}" if callables else ""
            raise PlanError(f"{owner!r} has no attribute {part!r}{hint}")
        found = getattr(found, part)
    if not callable(found):
        raise PlanError(f"{target!r} is a {type(found).__name__}, not a callable model factory")
    return found


def _describe(error: BaseException) -> str:
    if isinstance(error, SystemExit):
        return f"it raised SystemExit({error.code!r})"
    message = str(error).strip().splitlines()
    return f"{type(error).__name__}: {message[0] if message else ''}".rstrip(": ")


def build_model(target: str) -> nn.Module:
    """Call the factory ``MODULE:CALLABLE``; a failure or a non-module is a PlanError."""
    factory = load_factory(target)
    try:
        model = factory()
    except (Exception, SystemExit) as error:
        raise PlanError(f"calling {target}() failed: {_describe(error)}") from error
    if not isinstance(model, nn.Module):
        raise PlanError(
            f"{target}() must return a torch.nn.Module; got {type(model).__name__}: {model!r}"
        )
    return model


def run_model(model: nn.Module, inputs: Sequence[torch.Tensor], what: str, specs: str) -> Any:
    """Run ``model`` in eval mode without gradients; a failure is a PlanError naming
    ``what`` and the input ``specs``."""
    model.eval()
    try:
        with torch.no_grad():
            return model(*inputs)
    except (Exception, SystemExit) as error:
        raise PlanError(f"{what} failed to run on inputs {specs}: {_describe(error)}") from error


def _shapes(output: Any) -> str:
    if isinstance(output, torch.Tensor):
        return f"{tuple(output.shape)} {dtype_name(output.dtype)}"
    if isinstance(output, (tuple, list)):
        return "(" + ", ".join(_shapes(o) for o in output) + ")"
    if isinstance(output, dict):
        return "{" + ", ".join(f"{k!r}: {_shapes(v)}" for k, v in output.items()) + "}"
    return type(output).__name__


def make_plan(
    target: str,
    inputs: Sequence[InputSpec],
    level: str = "O2",
    dtype: str | None = None,
    seed: int = 0,
    emulate: bool = False,
) -> tuple[mixprec.CastPlan, str]:
    """Build, run, convert and run again; returns the plan and a one-line description."""
    try:
        parsed_level = Level.parse(level, argument="--level")
    except ValueError as error:
        raise PlanError(str(error)) from error
    try:
        low = None if dtype is None else resolve_dtype(dtype)
    except ValueError as error:
        raise PlanError(f"--dtype: {error}") from error
    if parsed_level is Level.O0:
        raise PlanError(
            "--level O0 converts nothing, so there is no cast plan; choose O1-O3, autocast or auto"
        )
    model = build_model(target)
    generator = torch.Generator().manual_seed(seed)
    tensors = [spec.make(generator) for spec in inputs]
    specs = " ".join(str(spec) for spec in inputs)
    run_model(model, tensors, f"the model {target}", specs)
    try:
        converted = mixprec.auto_mixed_precision(model, parsed_level, low, emulate=emulate)
    except (TypeError, ValueError) as error:
        raise PlanError(f"converting {target} to {parsed_level} failed: {error}") from error
    if converted is model:
        raise PlanError(f"level {parsed_level} chose O0 on this machine: nothing to plan")
    output = run_model(converted, tensors, f"the converted model ({parsed_level})", specs)
    line = f"{target} on inputs {specs}: ran before and after conversion; output {_shapes(output)}"
    return mixprec.explain(converted, *tensors), line


def run_plan(
    target: str,
    inputs: Sequence[str],
    level: str,
    dtype: str | None,
    as_json: bool,
    write: Callable[[str], None] = print,
    emulate: bool = False,
) -> None:
    """The ``mixprec plan`` command: prints the plan's table or its JSON."""
    if not inputs:
        raise PlanError("give at least one --input SHAPE (e.g. --input 1,3,32,32)")
    specs = [parse_input(text) for text in inputs]
    plan, line = make_plan(target, specs, level, dtype, emulate=emulate)
    if as_json:
        write(dumps(plan.to_dict()))
    else:
        write(line)
        write(str(plan))
