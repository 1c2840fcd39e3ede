"""One training run through ``./run_train.sh``, its figures read from the trainer's record
(:class:`torchtitan_seq.instrumentation.record.Run`), not from the console, which is kept to show
why a run failed. Used by :mod:`bench` and :mod:`context_parallel`.
"""

from __future__ import annotations

from pathlib import Path

from torchtitan_seq.instrumentation.record import Run, run_job

__all__ = ["ROOT", "run_train"]

ROOT = Path(__file__).resolve().parents[1]


def run_train(*overrides: str, dump_folder: Path, env: dict | None = None, timeout: int = 600) -> Run:
    """``./run_train.sh`` with torchtitan overrides; the job writes under ``dump_folder``."""
    script = ROOT / "run_train.sh"
    if not script.is_file():
        raise FileNotFoundError(f"{script} not found: the benchmark runs from the source checkout")
    return run_job([str(script), *overrides], dump_folder, cwd=ROOT, env=env, timeout=timeout)
