"""The planner's best configuration, trained with ./run_train.sh (2 CPU ranks), cuts the lengths it evaluated."""

import json

import pytest

from titan import assert_trained, run_train
from torchtitan_seq import plan as planner

# The debug model at 512 tokens on 2 ranks. FLOPs only: at this size the H200's fixed cost per unit
# would make one-unit schedules win. Lengths on a grid of 16 tokens, where the config run_train.sh
# reads (train_configs/debug_model.toml) cuts on 64: the overrides must carry the cut.
PLANNER = (
    "--flavor",
    "debugmodel",
    "--seq-len",
    "512",
    "--gpus",
    "2",
    "--local-batch-size",
    "4",
    "--gpu-memory-gib",
    "80",
    "--unit-overhead-ms",
    "0",
    "--length-multiple",
    "16",
    "--json",
)


@pytest.mark.slow
def test_the_top_plan_trains_the_lengths_the_planner_evaluated(tmp_path, capsys):
    assert planner.main(list(PLANNER)) == 0
    out = json.loads(capsys.readouterr().out)
    best = out["plans"][0]
    assert best["schedule"] in planner.SEQUENCE_SCHEDULES, best
    assert any(n % 64 for n in best["lengths"]), best  # a cut the config's own multiple would not make
    run = run_train(*out["overrides"].split(), "--training.steps", "1", dump_folder=tmp_path, check=False)
    assert_trained(run, 1)
    assert run.lengths == best["lengths"], (run.lengths, best)
