"""Each model family end to end through ./run_train.sh under torchtitan 0.2.2: from one seed checkpoint,
Seq1F1B on 2 pipeline ranks logs the losses of the same job without a pipeline (one process, the whole
sequence through the family's own attention path)."""

from __future__ import annotations

import pytest

from harness import TITAN
from titan import assert_same_losses, assert_trained, run_train

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(TITAN.version != "0.2.2", reason="torchtitan 0.2.2's families (0.3: tests/titan03)"),
]

FLAVORS = {
    "qwen3": "debugmodel_untied",  # debugmodel ties its embeddings, which no pipeline splits
    "deepseek_v3": "debugmodel",
    "llama4": "debugmodel_irope",
    "gpt_oss": "debugmodel",
}
"""Per family the debug flavor the run trains: the smallest that has the family's attention and MoE."""

SMALL = (
    "--training.seq_len",
    "256",
    "--training.local_batch_size",
    "2",
    "--sequence_pipeline.num_subsequences",
    "2",
    "--sequence_pipeline.length_multiple",
    "16",
    "--training.mixed_precision_param",
    "float32",
)
STEPS = 3


NEEDS_FSDP = {"gpt_oss"}
"""Families torchtitan 0.2.2 trains under FSDP only (gpt-oss: bfloat16 blocks, float32 embeddings): both runs
shard over 2 data-parallel ranks."""


ONE = ("--parallelism.pipeline_parallel_degree", "1", "--parallelism.pipeline_parallel_schedule", "1F1B")
"""The job without a pipeline."""


def _from_one_seed(model: tuple[str, ...], tmp_path) -> tuple[str, ...]:
    """Write a seed checkpoint of ``model`` (one process); returns the overrides of a run that loads it."""
    seed = run_train(
        *SMALL, *model, *ONE, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint", "--training.steps", "1",
        dump_folder=tmp_path / "seed", env={"NGPU": "1"}, check=False,
    )  # fmt: skip
    assert seed.returncode == 0 and "Created seed checkpoint" in seed.output, seed.output[-3000:]
    load = ("--checkpoint.initial_load_path", str(tmp_path / "seed" / "checkpoint" / "step-0"))
    return (
        *SMALL,
        *model,
        "--training.steps",
        str(STEPS),
        "--checkpoint.enable",
        *load,
        "--checkpoint.load_only",  # loaded, never saved: the debug models' checkpoints are large
    )


@pytest.mark.parametrize("family", list(FLAVORS))
def test_seq1f1b_logs_the_losses_of_the_job_without_a_pipeline(family, tmp_path):
    """Both runs load one seed checkpoint (torchtitan seeds each pipeline rank differently)."""
    common = _from_one_seed(("--model.name", family, "--model.flavor", FLAVORS[family]), tmp_path)
    dp = 2 if family in NEEDS_FSDP else 1
    fsdp = ("--parallelism.data_parallel_shard_degree", str(dp))
    whole = run_train(*common, *ONE, *fsdp, dump_folder=tmp_path / "pp1", env={"NGPU": str(dp)}, check=False)
    piped = run_train(*common, *fsdp, dump_folder=tmp_path / "pp2", env={"NGPU": str(2 * dp)})
    assert_trained(whole, STEPS)
    assert_trained(piped, STEPS)
    assert "pp=2" in piped.output and "Seq1F1B" in piped.output, piped.output[-3000:]
    assert_same_losses(piped, whole)


def test_expert_parallel_seq1f1b_logs_the_losses_of_the_job_without_a_pipeline(tmp_path):
    """pp 2 x FSDP 2 with the experts split over the FSDP ranks (EP 2; 4 ranks) logs the losses of FSDP 2
    alone, DeepSeek-V3 from one seed checkpoint: a unit's tokens reach their experts over gloo's
    all-to-all, and the step's per-expert counts (the routing bias's update) are the whole batch's."""
    common = _from_one_seed(("--model.name", "deepseek_v3", "--model.flavor", "debugmodel"), tmp_path)
    # Both read the batches of 2 data-parallel ranks (each its own shard of the data): FSDP 2 without a
    # pipeline or EP, and the pipeline with the experts split over the FSDP ranks.
    fsdp = ("--parallelism.data_parallel_shard_degree", "2")
    whole = run_train(*common, *ONE, *fsdp, dump_folder=tmp_path / "pp1", env={"NGPU": "2"}, check=False)
    ep = (*fsdp, "--parallelism.expert_parallel_degree", "2")
    piped = run_train(*common, *ep, dump_folder=tmp_path / "ep2", env={"NGPU": "4"})
    assert_trained(whole, STEPS)
    assert_trained(piped, STEPS)
    assert "'ep']" in piped.output and "pp=2" in piped.output, piped.output[-3000:]  # the experts' mesh
    assert_same_losses(piped, whole)
