"""Every script of docs/multi-node.md, run as it stands under torchrun on 127.0.0.1.

The SLURM script runs with stand-ins for ``srun`` (one torchrun per "node", all local) and
``scontrol``. Every collective has a 30 s timeout; every launch is killed after 240 s.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spawn import free_port

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "multi-node.md"
FENCE = re.compile(r"^```(?:python|bash)\n(.*?)^```", re.MULTILINE | re.DOTALL)
NAME = re.compile(r"^# (\w+\.(?:py|sh)):", re.MULTILINE)
SRUN = """#!/bin/bash
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i "$@" & pids+=($!); done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
"""


def _scripts(into: Path) -> dict[str, Path]:
    """The page's named scripts, written into ``into``."""
    out = {}
    for source in FENCE.findall(PAGE.read_text()):
        name = NAME.search(source)
        if name:
            out[name.group(1)] = into / name.group(1)
            out[name.group(1)].write_text(source)
    return out


def _launch(command: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    bin_dir = Path(sys.executable).parent
    full = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "PATH": f"{cwd / 'bin'}:{bin_dir}:{os.environ['PATH']}",
        "TIMEOUT_S": "30",
        "OMP_NUM_THREADS": "1",
        **env,
    }
    return subprocess.run(
        command, cwd=cwd, env=full, capture_output=True, text=True, timeout=240, check=False
    )


def _torchrun(script: Path, *args: str, procs: int = 2) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={procs}", str(script), *args,
    ]  # fmt: skip


# PyTorch's gloo teardown race (see the page): a rank that finished aborts at interpreter
# exit (-6) and torchrun ends the others (-15). Only that failure is let through; the
# callers still require every rank's result line.
TEARDOWN_ABORT = "terminate called without an active exception"


def _finished(result: subprocess.CompletedProcess[str]) -> bool:
    if result.returncode == 0:
        return True
    codes = set(re.findall(r"exitcode\s*:\s*(-?\d+)", result.stderr))
    return TEARDOWN_ABORT in result.stderr and "-6" in codes and codes <= {"-6", "-15"}


def _lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    assert _finished(result), result.stdout[-3000:] + result.stderr[-3000:]
    # the ranks print at once into one pipe: a line may run into the next
    return sorted(re.findall(r"rank \d+[^\n]*?(?=rank \d|\n|$)", result.stdout))


def _tail(line: str) -> str:
    return line.split(": ", 1)[1]


def test_every_recipe_of_the_multi_node_page_runs(tmp_path: Path) -> None:
    scripts = _scripts(tmp_path)
    assert sorted(scripts) == ["ddp.py", "fail.py", "fsdp.py", "launch.sh", "pipeline.py"]
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text(SRUN)
    (tmp_path / "bin" / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\n")
    for tool in ("srun", "scontrol"):
        (tmp_path / "bin" / tool).chmod(0o755)

    # DDP, one node: uneven inputs under step.join(), the ranks end identical
    ddp = _lines(_launch(_torchrun(scripts["ddp.py"]), tmp_path))
    assert len(ddp) == 2, ddp
    assert _tail(ddp[0]) == _tail(ddp[1]), ddp
    assert _tail(ddp[0]).startswith("4 steps, scale 1.0, sum ")

    # FSDP2 on 2 ranks (an empty shard on rank 1), saved with DCP
    fsdp = _lines(_launch(_torchrun(scripts["fsdp.py"], "ckpt"), tmp_path))
    assert len(fsdp) == 2, fsdp
    assert _tail(fsdp[0]) == _tail(fsdp[1]), fsdp
    assert _tail(fsdp[0]).startswith("3 steps, sum ")

    # SLURM: 2 "nodes" x 2 processes, torchrun's c10d rendezvous, HSDP on a (2, 2) mesh,
    # resuming the 2-rank checkpoint on 4 ranks
    slurm = _launch(
        ["bash", str(scripts["launch.sh"]), "ckpt"],
        tmp_path,
        SLURM_NNODES="2",
        SLURM_JOB_NODELIST="node[0-1]",
        SLURM_JOB_ID="42",
        MASTER_PORT=str(free_port()),
    )
    hsdp = _lines(slurm)
    resumed = [line for line in hsdp if "resumed" in line]
    assert resumed == [f"rank {r} of 4: resumed at step 3" for r in range(4)], hsdp
    sums = {_tail(line) for line in hsdp if "resumed" not in line}
    assert len(hsdp) == 8, hsdp
    assert len(sums) == 1, hsdp
    assert sums.pop().startswith("6 steps, sum "), hsdp

    # one rank raises: torchrun ends the other and exits non-zero, well within the timeout
    failed = _launch(_torchrun(scripts["fail.py"]), tmp_path)
    assert failed.returncode == 1
    assert "RuntimeError: rank 1: a bad batch" in failed.stderr
    assert "SIGTERM" in failed.stderr


@pytest.mark.parametrize(
    ("rc", "stderr", "finished"),
    [
        (0, "", True),
        (1, f"{TEARDOWN_ABORT}\n  exitcode  : -6 (pid: 1)\n  exitcode  : -15 (pid: 2)", True),
        (1, "  exitcode  : -6 (pid: 1)", False),  # an abort of another cause
        (1, f"{TEARDOWN_ABORT}\n  exitcode  : 1 (pid: 1)\n  exitcode  : -6 (pid: 2)", False),
        (1, f"{TEARDOWN_ABORT}\n  exitcode  : -15 (pid: 2)", False),
    ],
)
def test_only_the_teardown_abort_is_let_through(rc: int, stderr: str, finished: bool) -> None:
    assert _finished(subprocess.CompletedProcess([], rc, "", stderr)) is finished


def test_the_pipeline_recipe_runs(tmp_path: Path) -> None:
    """Two stages under 1F1B at O2 float16: both stages take the same steps at one scale."""
    lines = _lines(_launch(_torchrun(_scripts(tmp_path)["pipeline.py"]), tmp_path))
    assert len(lines) == 2, lines
    assert _tail(lines[0]) == _tail(lines[1]), lines
    assert _tail(lines[0]).startswith("4 steps, scale "), lines
