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
class as much as the instance, so moving the decisions' key from the instance to a class of
its own would save nothing.

Run: python benchmarks/bench_guard_reads.py [--modules 20]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch._dynamo
from torch import nn

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


if __name__ == "__main__":
    main()
