"""One training run through ``./run_train.sh``, its figures read from the trainer's record
(:class:`torchtitan_seq.instrumentation.record.Run`), not from the console, which is kept to show
why a run failed. Used by :mod:`bench` and :mod:`context_parallel`.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from torchtitan_seq.instrumentation.record import Run

__all__ = ["ROOT", "run_train"]

ROOT = Path(__file__).resolve().parents[1]


def run_train(*overrides: str, dump_folder: Path, env: dict | None = None, timeout: int = 600) -> Run:
    """``./run_train.sh`` with torchtitan overrides; the job writes under ``dump_folder``."""
    script = ROOT / "run_train.sh"
    if not script.is_file():
        raise FileNotFoundError(f"{script} not found: the benchmark runs from the source checkout")
    dump_folder = Path(dump_folder).resolve()  # the job runs in ROOT, the caller maybe elsewhere
    proc = subprocess.run(
        [str(script), "--job.dump_folder", str(dump_folder), *overrides],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Run.from_dump_folder(dump_folder, proc.returncode, proc.stdout + proc.stderr)
