"""What reading a per-module decision costs in TorchDynamo guards, by the channel it is read by.

A converted module's compiled call must learn its decisions (its casts, whether it is an
island) from the module. Each way of reading them adds guards per module, checked before
every call of the compiled model. This counts the guards of a compiled loop calling 20
modules (``torch._dynamo.explain``), each call's result multiplied by a constant found
through:

* nothing (the calls' own guards: the floor);
* an instance attribute, a key string (what a converted module reads: ``_mixprec_key``);
* a class attribute of one class shared by every module;
* a class attribute of a class per module (a class per decision set);
* the module's class itself, passed to a function answered at trace time;
* an identity check of the module's class.

Each adds about the same count (one guard a module beyond the floor; a class of its own per
module, two): TorchDynamo guards whatever a traced frame reads from its arguments, the
class as much as the instance.

A converted module's class has a ``__call__`` of its own, so a second group times calls
through one, as counts of guard-tree nodes (what the check walks) beside the guards: a
``__call__`` that reads nothing (its floor), one that reads the instance key (a converted
module's before 2026-12-06), one whose key is a closure cell of a class per decision set,
and one whose key is a constant of its code, a class per decision set (a converted
module's now): TorchDynamo guards the cell (through the class's dict), not a constant.

Run: python benchmarks/bench_guard_reads.py [--modules 20]
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Callable

import torch
import torch._dynamo
from torch import nn
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

_FACTS = {"f0": 2.0}


@torch.compiler.assume_constant_result
def _facts(key: str) -> float:
    return _FACTS[key]


@torch.compiler.assume_constant_result
def _class_facts(cls: type) -> float:
    return 2.0


class _Plain(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


_Shared = type("_Shared", (_Plain,), {"_key": "f0"})


def _keyed_modules(count: int) -> nn.ModuleList:
    modules = []
    for _ in range(count):
        module = _Plain()
        module.__dict__["_key"] = "f0"
        modules.append(module)
    return nn.ModuleList(modules)


def _shared_class(count: int) -> nn.ModuleList:
    return nn.ModuleList(_Shared() for _ in range(count))


def _class_each(count: int) -> nn.ModuleList:
    return nn.ModuleList(type("_Own", (_Plain,), {"_key": "f0"})() for _ in range(count))


def _nothing(modules: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for module in modules:
        x = module(x)
    return x


def _instance_key(modules: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for module in modules:
        x = module(x) * _facts(module.__dict__["_key"])
    return x


def _class_key(modules: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for module in modules:
        x = module(x) * _facts(type(module)._key)
    return x


def _the_class(modules: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for module in modules:
        x = module(x) * _class_facts(type(module))
    return x


def _class_is(modules: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for module in modules:
        x = module(x)
        if type(module) is _Shared:
            x = x * 2.0
    return x


CASES: list[tuple[str, Callable[[int], nn.ModuleList], Callable[..., torch.Tensor]]] = [
    ("nothing read (the floor)", _keyed_modules, _nothing),
    ("instance attribute key", _keyed_modules, _instance_key),
    ("class attribute, one class", _shared_class, _class_key),
    ("class attribute, a class each", _class_each, _class_key),
    ("the class, answered at trace", _shared_class, _the_class),
    ("type(module) is C", _shared_class, _class_is),
]


_PLACEHOLDER = "<key>"


def _call_reading_nothing(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return type(self).forward(self, x) * 2.0


def _call_reading_the_key(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return type(self).forward(self, x) * _facts(getattr(self, "_key", None))


def _call_template(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return type(self).forward(self, x) * _facts("<key>")


def _closure_call(key: str) -> Callable[..., torch.Tensor]:
    def call(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return type(self).forward(self, x) * _facts(key)

    return call


def _constant_call(key: str) -> Callable[..., torch.Tensor]:
    code = _call_template.__code__
    consts = tuple(key if c == _PLACEHOLDER else c for c in code.co_consts)
    return types.FunctionType(code.replace(co_consts=consts), _call_template.__globals__)


def _with_call(call: Callable[..., torch.Tensor], classes: int) -> Callable[[int], nn.ModuleList]:
    """Modules of ``classes`` classes whose ``__call__`` is ``call`` (each a key of its own)."""
    made = [type("_Called", (_Plain,), {"__call__": call}) for _ in range(classes)]

    def build(count: int) -> nn.ModuleList:
        modules = nn.ModuleList(made[i % classes]() for i in range(count))
        for module in modules:
            module.__dict__["_key"] = "f0"
        return modules

    return build


def _classes_for(
    factory: Callable[[str], Callable[..., torch.Tensor]],
) -> Callable[[int], nn.ModuleList]:
    """Modules of 4 classes, each class's ``__call__`` made by ``factory`` for key f0."""
    made = [type("_Called", (_Plain,), {"__call__": factory("f0")}) for _ in range(4)]
    return lambda count: nn.ModuleList(made[i % 4]() for i in range(count))


CALLS: list[tuple[str, Callable[[int], nn.ModuleList]]] = [
    ("own __call__, reads nothing", _with_call(_call_reading_nothing, 4)),
    ("own __call__, instance key", _with_call(_call_reading_the_key, 4)),
    ("closure key, 4 classes", _classes_for(_closure_call)),
    ("code constant key, 4 classes", _classes_for(_constant_call)),
]


def _nodes(run: Callable[..., torch.Tensor], modules: nn.ModuleList) -> int:
    """Nodes of the guard tree of ``run(modules, x)`` compiled (a code object of its own)."""
    fresh = types.FunctionType(run.__code__.replace(), run.__globals__, run.__name__)
    torch._dynamo.reset()
    torch.compile(fresh, backend="eager")(modules, torch.randn(3))
    (entry,) = _debug_get_cache_entry_list(fresh.__code__)
    return str(entry.guard_manager).count("GuardManager:")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", type=int, default=20)
    args = parser.parse_args()
    print(f"guards of a compiled loop calling {args.modules} modules (torch {torch.__version__})")
    floor = None
    for name, build, run in CASES:
        torch._dynamo.reset()
        explained = torch._dynamo.explain(run)(build(args.modules), torch.randn(3))
        count = len(explained.out_guards or ())
        floor = count if floor is None else floor
        per_module = (count - floor) / args.modules
        print(f"{name:32s} {count:5d}  ({per_module:+.2f} a module)")
    print("through a __call__ of the class's own: guards, guard-tree nodes")
    floors: tuple[int, int] | None = None
    for name, build in CALLS:
        torch._dynamo.reset()
        explained = torch._dynamo.explain(_nothing)(build(args.modules), torch.randn(3))
        count = len(explained.out_guards or ())
        nodes = _nodes(_nothing, build(args.modules))
        floors = (count, nodes) if floors is None else floors
        extra = (count - floors[0]) / args.modules, (nodes - floors[1]) / args.modules
        print(f"{name:32s} {count:5d} {nodes:5d}  ({extra[0]:+.2f}, {extra[1]:+.2f} a module)")


if __name__ == "__main__":
    main()
