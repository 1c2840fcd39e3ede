"""Run ./run_train.sh as a user would and read its step lines (the parser is the benchmark's)."""

from __future__ import annotations

import math
from pathlib import Path

from torchtitan_seq import bench
from torchtitan_seq.bench import Run

__all__ = ["Run", "run_train", "assert_trained", "REFERENCE"]

# The 2-rank pp=2 runs several files compare against, shared through the
# ``shared_run`` fixture (conftest.py): Seq1F1B (the config's schedule) with
# these arguments, and 1F1B with these arguments plus
# ``--parallelism.pipeline_parallel_schedule 1F1B``. 10 steps at seq 512, 4
# microbatches; lr_scheduler.total_steps = 10 is what torchtitan derives from
# 10 steps anyway, and pins the LR schedule for shorter runs compared with
# these; TensorBoard keeps the fp32 losses.
REFERENCE = ("--training.seq_len", "512", "--training.local_batch_size", "4", "--lr_scheduler.total_steps", "10",
             "--training.steps", "10", "--metrics.enable_tensorboard")


def run_train(*overrides: str, dump_folder: Path, env: dict | None = None, timeout: int = 600,
              check: bool = True) -> Run:
    """``./run_train.sh`` with torchtitan overrides.

    ``check=False`` skips run_train.sh's start-up check (``TORCHTITAN_SEQ_SKIP_CHECK=1``,
    ~7 s a run): for jobs known to be valid, whose test is not about the
    check; every rank still checks the job. The tests of bad input keep it.
    """
    if not check:
        env = {**(env or {}), "TORCHTITAN_SEQ_SKIP_CHECK": "1"}
    return bench.run_train(*overrides, dump_folder=dump_folder, env=env, timeout=timeout)


def assert_trained(run: Run, steps: int) -> None:
    assert run.returncode == 0, run.output[-4000:]
    assert len(run.losses) == steps, run.output[-4000:]
    assert all(math.isfinite(x) and x > 0 for x in run.losses), run.losses
    assert all(t > 0 for t in run.tps) and all(m > 0 for m in run.memory_gib)
