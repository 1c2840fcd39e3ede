"""Run ``./run_train.sh`` under torchtitan 0.3 as a user would, and read the losses it logs."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# 0.3's console line per logged step, e.g. "step:  1  loss:  8.14182  grad_norm: ...", not its validator's
# ("validate step:  1  loss:  7.9609 ...")
_STEP = re.compile(r"(?<!validate )step:\s*(\d+)\s+loss:\s*([-\d.]+)")


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


def losses_from_one_seed(
    tmp_path: Path, overrides: tuple[str, ...], runs: dict[str, tuple[tuple[str, ...], dict]], steps: int,
    config: str | None = None,
) -> dict[str, list[float]]:  # fmt: skip
    """The losses each of ``runs`` logs, every one from a copy of one seed checkpoint: torchtitan seeds each
    pipeline rank differently, so runs of other pipelines start from different weights otherwise.

    Args:
        tmp_path: where the runs write.
        overrides: every run's overrides (and the seed's, which one rank creates without a pipeline).
        runs: per name, the run's own overrides and its environment.
        steps: training steps of each run.
        config: the job (:func:`run_train`'s).

    Returns:
        Per name, the run's losses, ``steps`` of them (asserted, as that each run succeeded).
    """
    seed = run_train(
        *overrides,
        "--parallelism.pipeline-parallel-degree",
        "1",
        "--checkpoint.enable",
        "--checkpoint.create-seed-checkpoint",
        dump_folder=tmp_path / "seed",
        config=config,
        env={"NGPU": "1"},
    )
    assert seed.returncode == 0, seed.output[-3000:]
    seed_step = (tmp_path / "seed" / "checkpoint" / "step-0").resolve()
    losses = {}
    for name, (own, env) in runs.items():
        folder = tmp_path / name
        # Loaded, never saved: a debug model's checkpoint is up to a gigabyte (gpt-oss's vocabulary).
        checkpoint = ("--checkpoint.enable", "--checkpoint.initial-load-path", str(seed_step), "--checkpoint.load-only")
        run = run_train(
            *overrides, *own, "--training.steps", str(steps), *checkpoint, dump_folder=folder, config=config, env=env
        )
        assert run.returncode == 0, run.output[-4000:]
        assert len(run.losses) == steps, run.output[-4000:]
        losses[name] = run.losses
    return losses


def parse_job(*args: str):
    """The 0.3 job of ``--module torchtitan_seq.recipes args``, the shipped datasets registered (as
    ``torchtitan_seq.train`` does before its check)."""
    from torchtitan.config import ConfigManager

    from torchtitan_seq.titan.v03.registration import register

    register()
    return ConfigManager().parse_args(["--module", "torchtitan_seq.recipes", *args])
