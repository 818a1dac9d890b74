"""How the ``mixprec`` command talks: warnings, progress, JSON and output paths.

* mixprec's warnings print as one ``mixprec: warning: ...`` line on stderr
  (:func:`one_line_warnings`); other libraries' warnings keep Python's format.
* A long run shows one progress line on stderr, rewritten in place, only when stderr is a
  terminal (:class:`ProgressLine`): nothing extra when piped.
* JSON is strict (:func:`dumps`): no ``NaN`` or ``Infinity``.
* Output paths are checked before any work (:func:`check_out_dir`, :func:`check_out_file`).

Only the standard library is needed.

Example:
    >>> print(dumps({"ratio": float("nan"), "n": 1}))
    {
      "ratio": null,
      "n": 1
    }
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from mixprec._warn import is_mixprec

__all__ = [
    "ProgressLine",
    "check_out_dir",
    "check_out_file",
    "dumps",
    "finite_or_none",
    "one_line_warnings",
    "warning_line",
]


def warning_line(text: str, stream: TextIO | None = None) -> None:
    """Print ``mixprec: warning: text`` as one line (on stderr by default)."""
    text = " ".join(text.split())
    for prefix in ("mixprec: ", "mixprec "):
        text = text.removeprefix(prefix)
    print(f"mixprec: warning: {text}", file=sys.stderr if stream is None else stream)


@contextlib.contextmanager
def one_line_warnings() -> Iterator[None]:
    """While active, mixprec's warnings print as :func:`warning_line`; others as before."""
    with warnings.catch_warnings():
        previous = warnings.showwarning

        def show(
            message: Warning | str,
            category: type[Warning],
            filename: str,
            lineno: int,
            file: TextIO | None = None,
            line: str | None = None,
        ) -> None:
            if is_mixprec(message):
                warning_line(str(message), file)
            else:
                previous(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


def finite_or_none(data: Any) -> Any:
    """``data`` with every NaN or infinite float (in nested dicts, lists, tuples) as None."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: finite_or_none(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite_or_none(value) for value in data]
    return data


def dumps(data: Any) -> str:
    """Strict, indented JSON: non-finite floats become ``null`` (JSON has no NaN)."""
    return json.dumps(finite_or_none(data), indent=2, allow_nan=False)


def _check_writable_dir(path: Path, flag: str) -> None:
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {str(path)!r}: the folder is not writable")


def check_out_dir(path: Path, flag: str = "--out") -> None:
    """Make sure ``path`` is (or can be made) a writable folder; ValueError if not."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"{flag} {str(path)!r}: cannot make the folder: {error}") from error
    _check_writable_dir(path, flag)


def check_out_file(path: Path, flag: str = "--out") -> None:
    """Make sure a file can be written at ``path`` (its folder exists); ValueError if not."""
    if path.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a folder; give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"{flag} {str(path)!r}: no folder {str(parent)!r}")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {str(path)!r}: the file is not writable")
    _check_writable_dir(parent, flag)


class ProgressLine:
    """One line of progress on a terminal, rewritten in place; silent on a pipe or file.

    Example:
        >>> with ProgressLine() as progress:  # stderr: a terminal in a shell
        ...     progress.update("step 1/10")
    """

    def __init__(self, stream: TextIO | None = None, interval: float = 0.1) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval
        self._shown = 0
        self._last = -math.inf

    def update(self, text: str, force: bool = False) -> None:
        """Show ``text`` (at most every ``interval`` seconds unless ``force``)."""
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < self.interval):
            return
        self._last = now
        self.stream.write("\r" + text.ljust(self._shown))
        self.stream.flush()
        self._shown = len(text)

    def close(self) -> None:
        """Clear the line."""
        if self.enabled and self._shown:
            self.stream.write("\r" + " " * self._shown + "\r")
            self.stream.flush()
            self._shown = 0

    def __enter__(self) -> ProgressLine:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
