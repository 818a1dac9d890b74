"""Warnings that point at the user's line.

Every warning mixprec raises goes through :func:`warn`, which attributes it to the first
stack frame outside mixprec and torch: the user's call of ``auto_mixed_precision``,
``build_train_network``, or the model call whose hook warned, whichever entry point
that was. Each warning carries a ``mixprec`` attribute, so that the command line can
print mixprec's own warnings as one ``mixprec: warning: ...`` line (:func:`is_mixprec`).
"""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType

import torch

__all__ = ["is_mixprec", "warn"]

_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep for path in (__file__, torch.__file__)
)


def _stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside mixprec and torch, as seen from
    :func:`warn`'s call of ``warnings.warn``."""
    frame: FrameType | None = sys._getframe(1)  # warn() itself is stacklevel 1
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame = frame.f_back
        level += 1
    return level


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the user's line."""
    warning = category(message)
    warning.mixprec = True  # type: ignore[attr-defined]
    warnings.warn(warning, stacklevel=_stacklevel())


def is_mixprec(message: Warning | str) -> bool:
    """Whether a warning (``warnings.showwarning``'s ``message``) came from :func:`warn`."""
    return getattr(message, "mixprec", False) is True
