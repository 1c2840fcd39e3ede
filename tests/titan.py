"""Run ./run_train.sh as a user would and read its step lines (the parser is the benchmark's)."""

from __future__ import annotations

import math

from torchtitan_seq.bench import Run, run_train

__all__ = ["Run", "run_train", "assert_trained"]


def assert_trained(run: Run, steps: int) -> None:
    assert run.returncode == 0, run.output[-4000:]
    assert len(run.losses) == steps, run.output[-4000:]
    assert all(math.isfinite(x) and x > 0 for x in run.losses), run.losses
    assert all(t > 0 for t in run.tps) and all(m > 0 for m in run.memory_gib)
