"""torchtitan 0.3 end to end: from one seed checkpoint, Seq1F1B and BSIPipe log torch's 1F1B losses."""

from __future__ import annotations

import pytest

from titan03_run import losses_from_one_seed
from torchtitan_seq.titan.version import TITAN_03

pytestmark = pytest.mark.skipif(not TITAN_03, reason="runs ./run_train.sh with torchtitan 0.3")

SMALL = ("--training.seq-len", "256", "--training.local-batch-size", "4", "--sequence-pipeline.length-multiple", "16")
STEPS = 3


@pytest.mark.slow
def test_seq1f1b_and_bsipipe_log_the_losses_of_1f1b_from_one_seed_checkpoint(tmp_path):
    """Each schedule from one seed checkpoint; BSIPipe through ./run_train.sh's start-up check, the others
    without it."""
    runs = {
        schedule: (
            ("--parallelism.pipeline-parallel-schedule", schedule),
            {"TORCHTITAN_SEQ_SKIP_CHECK": "1"} if schedule != "BSIPipe" else {},
        )
        for schedule in ("1F1B", "Seq1F1B", "BSIPipe")
    }
    losses = losses_from_one_seed(tmp_path, SMALL, runs, STEPS)
    for schedule in ("Seq1F1B", "BSIPipe"):
        assert max(abs(a - b) for a, b in zip(losses[schedule], losses["1F1B"])) < 1e-3, losses
