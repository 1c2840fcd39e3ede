"""Run ``./run_train.sh`` under torchtitan 0.3 as a user would, and read the losses it logs."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# 0.3's console line per logged step, e.g. "step:  1  loss:  8.14182  grad_norm: ..."
_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.]+)")


@dataclass
class Run:
    returncode: int
    output: str

    @property
    def losses(self) -> list[float]:
        """The logged loss of each step, in step order (rank 0's console)."""
        return [float(loss) for _, loss in _STEP.findall(self.output)]


def run_train(*overrides: str, dump_folder: Path, config: str | None = None, env: dict | None = None) -> Run:
    """``TORCHTITAN=0.3 ./run_train.sh --dump-folder DUMP [overrides]`` in this session's environment
    (``TORCH_VERSION``/``VENV`` as the test command set them), the job ``config`` of
    ``torchtitan_seq.recipes`` (run_train.sh's default when None)."""
    extra = {"TORCHTITAN": "0.3", "VENV": os.environ.get("TORCHTITAN_SEQ_VENV", ""), **(env or {})}
    if config:
        extra["CONFIG"] = config
    proc = subprocess.run(
        [str(ROOT / "run_train.sh"), "--dump-folder", str(Path(dump_folder).resolve()), *overrides],
        cwd=ROOT,
        env={**os.environ, **{k: v for k, v in extra.items() if v}},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    return Run(proc.returncode, proc.stdout + proc.stderr)
