"""Boost levels and ``boost_config``: what each level may switch on, parsed at the edge.

==========  ====================================================================  ==========
level       techniques (each only where it pays, see :mod:`mixprec.boost.plan`)   accuracy
==========  ====================================================================  ==========
``"O0"``    none                                                                  unchanged
``"O1"``    fused / foreach optimizer, channels-last for conv nets,               unchanged
            ``torch.compile`` of the network
``"O2"``    O1, plus gradient freezing and (under DDP, 2^k ranks) AdaSum          may drop
==========  ====================================================================  ==========

``boost_config`` keys (defaults in :class:`BoostConfig`): ``optimizer`` ("auto", "fused",
"foreach", "off"), ``compile`` ("auto", True, False), ``compile_backend``,
``channels_last`` ("auto", True, False), ``freeze`` (None = the level's default),
``param_groups``, ``freeze_type``, ``freeze_p``, ``total_steps``, ``seed``, ``adasum``
("auto", True, False), ``min_speedup``.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import numbers
from collections.abc import Mapping
from typing import Any

__all__ = ["BoostConfig", "BoostLevel", "parse_boost_config"]


class BoostLevel(str, enum.Enum):
    """MindSpore's boost levels."""

    O0 = "O0"
    O1 = "O1"
    O2 = "O2"

    @classmethod
    def parse(cls, value: object, argument: str = "boost_level") -> BoostLevel:
        """``"O1"``, ``"o1"``, ``BoostLevel.O1`` -> ``BoostLevel.O1``.

        Example:
            >>> BoostLevel.parse("o2")
            <BoostLevel.O2: 'O2'>
        """
        if isinstance(value, BoostLevel):
            return value
        choices = ", ".join(repr(level.value) for level in cls)
        if not isinstance(value, str):
            raise TypeError(f"{argument} must be one of {choices}; got {value!r}")
        for level in cls:
            if value.strip().upper() == level.value:
                return level
        close = difflib.get_close_matches(value.strip().upper(), [lv.value for lv in cls], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{argument} must be one of {choices}; got {value!r}{hint}")


_AUTO_BOOL = ("auto", True, False)


@dataclasses.dataclass(frozen=True)
class BoostConfig:
    """``boost_config`` after validation (MindSpore's gradient-freeze defaults).

    Attributes:
        optimizer: "auto" = time the optimizer's fused and foreach kernels at build time
            and keep the fastest (if ``min_speedup`` faster than its current one);
            "fused"/"foreach" force one; "off" leaves the optimizer alone.
        compile: ``torch.compile`` the network: "auto" = on CUDA only (on CPU it measured
            slower, see docs/measurements.md); True forces it.
        compile_backend: the backend for ``torch.compile`` ("inductor", "eager", ...).
        channels_last: "auto" = conv nets are timed both ways on the first batch and the
            faster layout kept; True/False force it.
        freeze: gradient freezing (None: on at O2, off at O1).
        param_groups, freeze_type, freeze_p, total_steps, seed: the freeze schedule
            (see :mod:`mixprec.boost.freeze`).
        adasum: AdaSum under DDP ("auto" = at O2 with 2^k ranks).
        min_speedup: a measured technique is kept only if at least this much faster.
    """

    optimizer: str = "auto"
    compile: bool | str = "auto"
    compile_backend: str = "inductor"
    channels_last: bool | str = "auto"
    freeze: bool | None = None
    param_groups: int = 10
    freeze_type: int = 1
    freeze_p: float = 0.7
    total_steps: int = 65536
    seed: int = 0
    adasum: bool | str = "auto"
    min_speedup: float = 1.05


_CHOICES: dict[str, tuple[object, ...]] = {
    "optimizer": ("auto", "fused", "foreach", "off"),
    "compile": _AUTO_BOOL,
    "channels_last": _AUTO_BOOL,
    "adasum": _AUTO_BOOL,
    "freeze": (None, True, False),
    "freeze_type": (0, 1),
}


def _check_int(value: object, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < low:
        raise ValueError(f"boost_config[{name!r}] must be an int >= {low}; got {value!r}")
    return int(value)


def parse_boost_config(config: Mapping[str, Any] | None) -> BoostConfig:
    """Validate ``boost_config`` (a dict, or None for the defaults).

    Example:
        >>> parse_boost_config({"freeze_p": 0.5}).freeze_p
        0.5
    """
    if config is None:
        return BoostConfig()
    if isinstance(config, BoostConfig):
        return config
    if not isinstance(config, Mapping):
        raise TypeError(f"boost_config must be a dict or None; got {config!r}")
    names = [f.name for f in dataclasses.fields(BoostConfig)]
    for key in config:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=2)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise ValueError(
                f"boost_config has an unknown key {key!r}{hint} Its keys: {', '.join(names)}"
            )
    for key, choices in _CHOICES.items():
        value = config.get(key, choices[0])
        exact = any(value is c or (isinstance(c, str) and value == c) for c in choices)
        an_int = key == "freeze_type" and type(value) is int and value in choices
        if not (exact or an_int):
            raise ValueError(
                f"boost_config[{key!r}] must be one of {', '.join(map(repr, choices))}; "
                f"got {value!r}"
            )
    values = dict(config)
    for key, low in (("param_groups", 1), ("total_steps", 1), ("seed", 0)):
        if key in values:
            values[key] = _check_int(values[key], key, low)
    if "freeze_p" in values:
        p = values["freeze_p"]
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 <= float(p) <= 1:
            raise ValueError(
                f"boost_config['freeze_p'] (the share of steps that train every group) must be "
                f"a number in [0, 1]; got {p!r}"
            )
        values["freeze_p"] = float(p)
    if "min_speedup" in values:
        s = values["min_speedup"]
        if isinstance(s, bool) or not isinstance(s, numbers.Real) or s < 1:
            raise ValueError(f"boost_config['min_speedup'] must be a number >= 1; got {s!r}")
    backend = values.get("compile_backend", "inductor")
    if not isinstance(backend, str):
        raise ValueError(f"boost_config['compile_backend'] must be a str; got {backend!r}")
    return BoostConfig(**values)
