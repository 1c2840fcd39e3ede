"""Run ./run_train.sh as a user would and read its metrics record (:mod:`torchtitan_seq.instrumentation.record`)."""

from __future__ import annotations

import math
from pathlib import Path

from forked_run import ROOT, run_forked
from torchtitan_seq.instrumentation.record import Run, run_job

__all__ = ["Run", "run_train", "assert_trained", "assert_same_losses", "max_diff", "REFERENCE"]

# The 2-rank pp=2 runs several files compare against, shared through the
# ``shared_run`` fixture (conftest.py): Seq1F1B (the config's schedule) with
# these arguments, and 1F1B with these arguments plus
# ``--parallelism.pipeline_parallel_schedule 1F1B``. 10 steps at seq 512, 4
# microbatches; lr_scheduler.total_steps = 10 is what torchtitan derives from
# 10 steps anyway, and pins the LR schedule for shorter runs compared with
# these; TensorBoard keeps the fp32 losses.
REFERENCE = (
    "--training.seq_len",
    "512",
    "--training.local_batch_size",
    "4",
    "--lr_scheduler.total_steps",
    "10",
    "--training.steps",
    "10",
    "--metrics.enable_tensorboard",
)


def run_train(
    *overrides: str, dump_folder: Path, env: dict | None = None, timeout: int = 600, check: bool = True
) -> Run:
    """The job ``./run_train.sh`` runs with these torchtitan overrides (``env``: its ``CONFIG_FILE``, ``NGPU``).

    ``check=True`` runs ./run_train.sh itself, as a user does: its start-up check, torchrun, each rank
    importing torch and torchtitan. ``check=False``, for jobs known to be valid whose test is about
    the training, not the start-up: the same job on ranks forked from a server that imported them
    once (:func:`forked_run.run_forked`), about 15 s less a run.
    """
    if not check:
        return run_forked(*overrides, dump_folder=dump_folder, env=env, timeout=timeout)
    return run_job([str(ROOT / "run_train.sh"), *overrides], dump_folder, cwd=ROOT, env=env, timeout=timeout)


def assert_trained(run: Run, steps: int) -> None:
    assert run.returncode == 0, run.output[-4000:]
    assert len(run.losses) == steps, run.output[-4000:]
    assert all(math.isfinite(x) and x > 0 for x in run.losses), run.losses
    assert all(t > 0 for t in run.tps) and all(m > 0 for m in run.memory_gib)


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


def assert_same_losses(run: Run, ref: Run, tol: float = 1e-3, steps: int | None = None) -> None:
    """Two runs logged the same losses, step by step, within ``tol`` (1e-3: the same maths
    summed in another order, as the console rounds it); with ``steps``, the first ``steps``
    of ``ref`` (a shorter run with REFERENCE's LR schedule against a shared 10-step run)."""
    expected = ref.losses if steps is None else ref.losses[:steps]
    assert max_diff(run.losses, expected) <= tol, (run.losses, expected)
