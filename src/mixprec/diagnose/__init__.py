"""Where precision breaks: :func:`find_overflow`, :func:`calibrate` and :func:`lint`.

- :mod:`.probes`: hooks on every module, and a run that leaves no trace;
- :mod:`.overflow` and :mod:`.report`: the first non-finite module, and the fix;
- :mod:`.skip`: the same probe for a training step's skipped batch;
- :mod:`.calibrate`: the float32 pins that meet a tolerance;
- :mod:`.lint`: settings that cannot work in a dtype.
"""

from mixprec.diagnose.calibrate import CalibrationReport, ModuleSensitivity, calibrate
from mixprec.diagnose.lint import Finding, FindingKind, LintReport, lint
from mixprec.diagnose.overflow import find_overflow
from mixprec.diagnose.report import Culprit, Fix, FixKind, OverflowReport
from mixprec.diagnose.skip import OverflowDebugger, probe_skipped_step

__all__ = [
    "CalibrationReport",
    "Culprit",
    "Finding",
    "FindingKind",
    "Fix",
    "FixKind",
    "LintReport",
    "ModuleSensitivity",
    "OverflowDebugger",
    "OverflowReport",
    "calibrate",
    "find_overflow",
    "lint",
    "probe_skipped_step",
]
