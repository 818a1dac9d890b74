"""The demo's settings: what ``mixprec demo``'s flags can say, parsed and checked.

Kept apart from :mod:`mixprec.cli.demo` so that the command line starts (``plan``,
``doctor``, ``--help``) without the demo's extra packages.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mixprec.policy.dtypes import resolve_dtype

__all__ = ["LEVEL_CHOICES", "DemoConfig", "config_from_args", "parse_levels"]

#: The runs ``--levels`` can name, in the order the table shows them.
LEVEL_CHOICES: tuple[str, ...] = ("O0", "O1", "O2", "O3", "autocast", "auto", "O2-fp16")


@dataclass(frozen=True)
class DemoConfig:
    """The demo's settings (the command line's flags, parsed)."""

    levels: tuple[str, ...] = LEVEL_CHOICES
    dtype: torch.dtype = torch.bfloat16
    epochs: int = 16
    batch_size: int = 32
    lr: float = 2e-3
    seed: int = 0
    out: Path = Path("mixprec-demo")
    steps_limit: int | None = None
    #: run the low levels emulated: None = where the CPU has no native support for the dtype
    emulate: bool | None = None


def parse_levels(text: str) -> tuple[str, ...]:
    """``"O0,o2,auto"`` -> ``("O0", "O2", "auto")``; unknown names are a ValueError."""
    by_key = {choice.lower(): choice for choice in LEVEL_CHOICES}
    chosen: list[str] = []
    for part in text.split(","):
        key = part.strip().lower()
        if key not in by_key:
            raise ValueError(
                f"--levels names {part.strip()!r}, which is not a level; "
                f"choose from {', '.join(LEVEL_CHOICES)}"
            )
        if by_key[key] not in chosen:
            chosen.append(by_key[key])
    return tuple(chosen)


def config_from_args(args: Any) -> DemoConfig:
    """A :class:`DemoConfig` from the parsed command line (validating each flag)."""
    for name in ("epochs", "batch_size"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {value!r}")
    if args.steps_limit is not None and args.steps_limit < 1:
        raise ValueError(f"--steps-limit must be >= 1; got {args.steps_limit!r}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be > 0; got {args.lr!r}")
    try:
        dtype = resolve_dtype(args.dtype)
    except ValueError as error:
        raise ValueError(f"--dtype: {error}") from error
    return DemoConfig(
        levels=parse_levels(args.levels),
        dtype=dtype,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        out=Path(args.out),
        steps_limit=args.steps_limit,
        emulate=getattr(args, "emulate", None),
    )
