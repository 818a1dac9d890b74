"""O1's mechanisms, measured side by side: the mode, the shipped kernels, candidate D.

O1 runs every white-list op in the low dtype and casts its result back to float32; every
other op follows its inputs. Three ways to apply that rule:

* **the mode**: a ``TorchFunctionMode`` (what O1 runs under ``torch.compile``): every op,
  tensor method and property pays a Python call;
* **O1 as shipped** (``mixprec.convert.dispatch``): a Python kernel per listed ATen op at a
  dispatch key of its own (a free autocast key, a fallthrough for every other op), in effect
  only inside a converted call; ``nn.Linear``/``nn.Conv*``/``nn.ReLU`` make their one call
  directly;
* **candidate D**: Python kernels for the white-list ops at ``AutocastCPU``, the model run
  under ``torch.autocast``. Not used: those kernels replace ``torch.autocast``'s own for those
  ops in the whole process (every ``torch.autocast`` region then pays them and loses
  autocast's weight-cast cache), which is why it runs in its own process and last.

Prints host time per forward (no grad) as ratios to ``torch.autocast`` with PyTorch's own
kernels (measured first, before candidate D's kernels are registered), and checks that the
three give bit-identical outputs.

Two diagnostics of what O1's gap is made of: the column "kept low" is O1 with its
white-list results kept low (autocast's rule, by O1's own kernels; not O1, and not
bit-identical): the difference to "O1" is what O1's float32 rule costs (the casts back and
the ops after them computing in float32). The last line times ``F.gelu`` on a (1, 8, 32)
tensor in float32, in bfloat16 and in float32 with oneDNN off: on CPU PyTorch runs a float32
GELU through oneDNN, whose fixed cost per call O1 (GELU computes in float32 there) pays and
``torch.autocast`` (GELU follows its bfloat16 input) does not. And one listed op's kernel:
``F.scaled_dot_product_attention`` timed outside and inside a converted call.

Run: python benchmarks/bench_o1_autocast_kernels.py [--models gpt2,bert] [--rounds 40]
"""

from __future__ import annotations

import argparse
import threading
import timeit
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import mixprec as amp
from bench_overhead import _call, _first_tensor, build, time_rounds
from mixprec.convert.runtime import RuntimeListMode
from mixprec.convert.structure import forward_of

#: The white-list ops the tiny transformers reach (aten names).
OPS = ("addmm", "linear", "matmul", "bmm", "baddbmm", "mm", "scaled_dot_product_attention")
_STATE = threading.local()
_BELOW = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _region(converted: torch.nn.Module) -> Any:
    """The run-time state of an O1 conversion (its ``kernels`` flag picks the mechanism)."""
    return next(
        forward_of(m).region for m in converted.modules() if hasattr(forward_of(m), "region")
    )


class _KeptLow(RuntimeListMode):
    """O1's call state with its white-list results kept low (a diagnostic, not O1)."""

    def cast_back_eager(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def cast_back(self, out: Any) -> Any:
        return out


def kept_low(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` converted at O1, its calls run by :class:`_KeptLow`."""
    converted = amp.auto_mixed_precision(model, "O1", torch.bfloat16)
    region = _region(converted)
    region.mode = lambda: _KeptLow(  # type: ignore[method-assign]
        region.table, region.default, region.recipe.dtype, back=False, names=region.names
    )
    return converted


def gelu_costs() -> str:
    """Microseconds per ``F.gelu`` call: float32, bfloat16, float32 with oneDNN off."""
    x = torch.randn(1, 8, 32)
    low = x.bfloat16()

    def per_call(run: Callable[[], Any]) -> float:
        return min(timeit.repeat(run, number=2000, repeat=5)) / 2000 * 1e6

    fp32, bf16 = per_call(lambda: F.gelu(x)), per_call(lambda: F.gelu(low))
    with torch.backends.mkldnn.flags(enabled=False):
        plain = per_call(lambda: F.gelu(x))
    return f"F.gelu (1, 8, 32): float32 {fp32:.1f} us, bfloat16 {bf16:.1f} us, float32 oneDNN off {plain:.1f} us"


def kernel_cost() -> str:
    """Microseconds per ``F.scaled_dot_product_attention`` call on (1, 2, 8, 8) bfloat16
    tensors (no cast to make), outside and inside a converted call (its O1 kernel: the
    call's state read, the operands looked at, the result cast back)."""
    from mixprec.convert import dispatch

    q = torch.randn(1, 2, 8, 8).bfloat16()
    region = _region(amp.auto_mixed_precision(torch.nn.Linear(2, 2), "O1", torch.bfloat16))

    def per_call() -> float:
        run = lambda: F.scaled_dot_product_attention(q, q, q)  # noqa: E731
        return min(timeit.repeat(run, number=3000, repeat=9)) / 3000 * 1e6

    with torch.no_grad():
        outside = per_call()
        with dispatch.ListRegion(region.mode()):
            inside = per_call()
    return f"sdpa (1, 2, 8, 8) bfloat16: {outside:.1f} us outside a converted call, {inside:.1f} us inside"


def install() -> torch.library.Library:
    """Register the candidate's kernels (process-wide, for as long as the library lives)."""
    library = torch.library.Library("aten", "IMPL")
    for name in OPS:
        op = getattr(torch.ops.aten, name).default

        def kernel(*args: Any, op: Any = op, **kwargs: Any) -> Any:
            low = torch.get_autocast_dtype("cpu")
            args = tuple(
                a.to(low) if isinstance(a, torch.Tensor) and a.dtype is torch.float32 else a
                for a in args
            )
            with torch._C._ExcludeDispatchKeyGuard(_BELOW):
                out = op(*args, **kwargs)
            return out.float() if getattr(_STATE, "o1", False) else out

        library.impl(name, kernel, "AutocastCPU", allow_override=True)
    return library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,bert")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    models = {name: build(name) for name in args.models.split(",")}
    before: dict[str, dict[str, float]] = {}
    same: dict[str, bool] = {}
    for name, (model, inputs) in models.items():

        def autocast(model: torch.nn.Module = model, inputs: Any = inputs) -> torch.Tensor:
            with torch.autocast("cpu", torch.bfloat16):
                return _first_tensor(model(**inputs))

        o1 = amp.auto_mixed_precision(model, "O1", torch.bfloat16)
        moded = amp.auto_mixed_precision(model, "O1", torch.bfloat16)
        _region(moded).kernels = False
        low = kept_low(model)
        calls: dict[str, Callable[[], torch.Tensor]] = {
            "torch.autocast": autocast,
            "O1": lambda o1=o1, inputs=inputs: _call(o1, inputs),
            "mode": lambda moded=moded, inputs=inputs: _call(moded, inputs),
            "kept low": lambda low=low, inputs=inputs: _call(low, inputs),
        }
        before[name] = time_rounds(calls, args.rounds, backward=False)
        with torch.no_grad():
            same[name] = torch.equal(_call(o1, inputs), _call(moded, inputs))
    library = install()
    print("host time per forward, ratio to torch.autocast with PyTorch's kernels")
    print(
        f"{'model':8s} {'torch.autocast':>15s} {'mode':>8s} {'O1':>8s} {'cand. D':>8s}"
        f" {'kept low':>9s}  bit-identical"
    )
    for name, (model, inputs) in models.items():
        o1 = amp.auto_mixed_precision(model, "O1", torch.bfloat16)

        def candidate(model: torch.nn.Module = model, inputs: Any = inputs) -> torch.Tensor:
            _STATE.o1 = True
            try:
                with torch.autocast("cpu", torch.bfloat16):
                    return _first_tensor(model(**inputs))
            finally:
                _STATE.o1 = False

        after = time_rounds(
            {"O1": lambda o1=o1, inputs=inputs: _call(o1, inputs), "candidate": candidate},
            args.rounds,
            backward=False,
        )
        # the two runs are tied through O1, timed in both
        base = before[name]["torch.autocast"]
        scale = before[name]["O1"] / after["O1"]
        with torch.no_grad():
            same[name] &= torch.equal(_call(o1, inputs).float(), candidate().float())
        print(
            f"{name:8s} {base * 1e3:12.2f} ms {before[name]['mode'] / base:7.2f}x "
            f"{before[name]['O1'] / base:7.2f}x {after['candidate'] * scale / base:7.2f}x"
            f" {before[name]['kept low'] / base:8.2f}x  {same[name]}"
        )
    del library
    print(gelu_costs())
    print(kernel_cost())


if __name__ == "__main__":
    main()
