"""Sequence schedules composed with torchtitan's FSDP2, TP, CP, activation checkpointing and DCP,
run as ./run_train.sh runs them, on CPU ranks (gloo).

tests/exactness/test_compose.py checks the same compositions against a single-process
reference on a tiny model; these check them end to end through torchtitan's
trainer, mesh, checkpointer and data loader, on the Llama 3 debug model.
"""

from pathlib import Path

import pytest

from titan import REFERENCE, assert_same_losses, assert_trained, max_diff, run_train

STEPS = 10
# lr_scheduler.total_steps fixes the LR schedule (warm-up 2, then decay over
# 80% of 10 steps) whatever training.steps is: without it torchtitan derives
# the decay from training.steps, and a 5-step run would decay from step 4 on.
SMALL = ("--training.seq_len", "512", "--training.local_batch_size", "4", "--lr_scheduler.total_steps", str(STEPS))
TINY = ("--training.seq_len", "256", "--training.local_batch_size", "4", "--lr_scheduler.total_steps", str(STEPS))
TOL_SCHEDULES = 1e-3  # Seq1F1B against 1F1B: same maths, different summation order
TOL_RESUME = 1e-5  # a resumed run against the uninterrupted one
TOL_CP = 2e-5  # pp=2 x cp=2 against pp=2 from the same weights: fp32 round-off, and the log's 5 decimals
LOSS = "loss_metrics/global_avg_loss"

# The runs below are the jobs run_train.sh starts, on ranks forked from a server that imported torch
# and torchtitan once (check=False: tests/helpers/forked_run.py; every rank checks the job anyway): these tests
# are about torchtitan's parallelisms, not the start-up, which the context-parallel test below and
# tests/e2e/test_train.py exercise.


def tensorboard_losses(dump_folder: Path) -> dict[int, float]:
    """step -> loss (fp32) from every TensorBoard event file under ``dump_folder``.

    The log prints losses to 5 decimals, as coarse as the resume tolerance;
    TensorBoard keeps the float32 the trainer computed.
    """
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    losses = {}
    for path in sorted(dump_folder.glob("tb/**/events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag == LOSS:
                    losses[event.step] = value.tensor.float_val[0] if value.HasField("tensor") else value.simple_value
    return losses


# ---------------------------------------------------------------------------
# 1. Meshes: PP x FSDP2, PP x TP, PP x FSDP2 x TP


# 2 steps of each schedule on each mesh (FSDP2 over gloo takes 14 s a step on 2 cores;
# that training learns is asserted on the shared 10-step run, tests/e2e/test_train.py),
# at seq 256 (64-token subsequences):
# the units, and the FSDP2 and TP collectives each makes, are the same at
# seq 512, for half the compute. FSDP2 and TP together (8 ranks, 2.5 to 3.5
# minutes a run on 2 cores) are checked against the single-process reference in
# tests/exactness/test_compose.py, through torchtitan's parallelize_llama.
MESH_STEPS = 2
MESHES = {
    # name: (processes, degrees)
    "pp2-fsdp2": (4, {"dp_shard": 2, "tp": 1}),
    "pp2-tp2": (4, {"dp_shard": 1, "tp": 2}),
}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESHES))
def test_seq1f1b_logs_the_losses_of_1f1b_on_the_same_mesh(mesh, tmp_path):
    ngpu, degrees = MESHES[mesh]
    common = (
        *TINY,
        "--training.steps",
        str(MESH_STEPS),
        "--parallelism.data_parallel_shard_degree",
        str(degrees["dp_shard"]),
        "--parallelism.tensor_parallel_degree",
        str(degrees["tp"]),
    )
    env = {"NGPU": str(ngpu)}
    seq = run_train(*common, dump_folder=tmp_path / "seq", env=env, check=False)
    ref = run_train(
        *common, "--parallelism.pipeline_parallel_schedule", "1F1B", dump_folder=tmp_path / "ref", env=env, check=False
    )
    assert_trained(seq, MESH_STEPS)
    assert_trained(ref, MESH_STEPS)
    layout = f"pp=2, dp_replicate=1, dp_shard={degrees['dp_shard']}, cp=1, tp={degrees['tp']}"
    for run in (seq, ref):
        assert f"Building device mesh with parallelism: {layout}" in run.output, run.output[-3000:]
    assert "Sequence pipeline Seq1F1B: 4 microbatches x 4 subsequences" in seq.output
    assert_same_losses(seq, ref, TOL_SCHEDULES)


# ---------------------------------------------------------------------------
# 2 and 3 share one run: Seq1F1B on pp=2, no activation checkpointing, 10
# steps, TensorBoard on; the session's shared REFERENCE run, which
# tests/e2e/test_train.py compares with 1F1B.

CHECKPOINT = (
    "--checkpoint.enable",
    "--checkpoint.interval",
    "5",
    "--checkpoint.folder",
    "ckpt",
    "--metrics.enable_tensorboard",
)


@pytest.fixture(scope="module")
def uninterrupted(shared_run):
    assert REFERENCE == (*SMALL, "--training.steps", str(STEPS), "--metrics.enable_tensorboard"), REFERENCE
    run, dump = shared_run(*REFERENCE)
    assert_trained(run, STEPS)
    assert "activation checkpointing to the model" not in run.output  # the config's mode = "none"
    return run, dump


AC_MODES = {
    "selective-2": ("--activation_checkpoint.mode", "selective"),  # torchtitan's default option, every 2nd layer
    "selective-op": ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"),
    "full": ("--activation_checkpoint.mode", "full"),
}


@pytest.mark.slow
@pytest.mark.parametrize("ac", list(AC_MODES))
def test_activation_checkpointing_logs_the_losses_of_none(ac, uninterrupted, tmp_path):
    steps = 5
    ref = uninterrupted[0]
    run = run_train(*SMALL, *AC_MODES[ac], "--training.steps", str(steps), dump_folder=tmp_path, check=False)
    assert_trained(run, steps)
    mode = AC_MODES[ac][1]
    assert f"Applied {mode} activation checkpointing to the model" in run.output, run.output[-3000:]
    assert max_diff(run.losses, ref.losses[:steps]) <= TOL_SCHEDULES, (run.losses, ref.losses[:steps])


@pytest.mark.slow
def test_resuming_from_a_dcp_checkpoint_logs_the_uninterrupted_losses(uninterrupted, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    ref, ref_dump = uninterrupted
    # Stopped after step 5: that step's checkpoint is then the last one, which
    # torchtitan saves model-only unless told otherwise, and a model-only
    # checkpoint cannot resume training (DCP: "Missing key ... dataloader").
    first = run_train(
        *SMALL,
        *CHECKPOINT,
        "--training.steps",
        "5",
        "--checkpoint.no_last_save_model_only",
        dump_folder=tmp_path,
        check=False,
    )
    assert_trained(first, 5)
    saved = set(FileSystemReader(str(tmp_path / "ckpt" / "step-5")).read_metadata().state_dict_metadata)
    for state in ("dataloader.", "optimizer.", "lr_scheduler.", "train_state.step"):
        assert any(key.startswith(state) for key in saved), (state, sorted(saved)[:20])

    second = run_train(*SMALL, *CHECKPOINT, "--training.steps", str(STEPS), dump_folder=tmp_path, check=False)
    assert_trained(second, STEPS - 5)
    assert f"Loading the checkpoint from {tmp_path / 'ckpt' / 'step-5'}" in second.output, second.output[-3000:]
    assert "Training starts at step 6" in second.output

    # The log rounds to 5 decimals; TensorBoard below has the losses themselves.
    log_rounding = 1e-5
    assert max_diff(first.losses + second.losses, ref.losses) <= TOL_RESUME + log_rounding, (
        first.losses,
        second.losses,
        ref.losses,
    )
    expected, resumed = tensorboard_losses(ref_dump), tensorboard_losses(tmp_path)
    assert sorted(expected) == sorted(resumed) == list(range(1, STEPS + 1)), (expected, resumed)
    diffs = {step: abs(resumed[step] - expected[step]) for step in range(6, STEPS + 1)}
    assert max(diffs.values()) <= TOL_RESUME, diffs


# ---------------------------------------------------------------------------
# 4. Context parallelism inside units: pp=2 x cp=2 logs the losses of pp=2.
#
# Both runs start from one seed checkpoint (torchtitan's --checkpoint.create_seed_checkpoint, on one
# process): FSDP, which torchtitan applies over the CP ranks, would otherwise initialise the weights
# otherwise. float32 parameters, as the pp=2 run (FSDP casts them to bf16 by default).

CP_CONFIGS = {"causal": "train_configs/debug_model.toml", "block-causal": "train_configs/debug_block_causal.toml"}


@pytest.mark.slow
@pytest.mark.parametrize("config", list(CP_CONFIGS))
def test_context_parallel_logs_the_losses_of_the_pipeline_alone(config, tmp_path):
    env = {"CONFIG_FILE": CP_CONFIGS[config]}
    seed = (
        "--checkpoint.enable",
        "--checkpoint.create_seed_checkpoint",
        "--parallelism.pipeline_parallel_degree",
        "1",
        "--parallelism.pipeline_parallel_schedule",
        "1F1B",
        "--training.steps",
        "1",
    )
    made = run_train(*SMALL, *seed, dump_folder=tmp_path / "seed", env={**env, "NGPU": "1"}, check=False)
    assert made.returncode == 0 and "Created seed checkpoint" in made.output, made.output[-3000:]
    common = (
        *SMALL,
        "--training.steps",
        "2",
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(tmp_path / "seed" / "checkpoint" / "step-0"),
        "--checkpoint.load_only",
        "--training.mixed_precision_param",
        "float32",
    )
    ref = run_train(*common, dump_folder=tmp_path / "pp", env={**env, "NGPU": "2"}, check=False)
    cp = run_train(
        *common, "--parallelism.context_parallel_degree", "2", dump_folder=tmp_path / "cp", env={**env, "NGPU": "4"}
    )
    assert_trained(ref, 2)
    assert_trained(cp, 2)
    assert "Building device mesh with parallelism: pp=2, dp_replicate=1, dp_shard=1, cp=2, tp=1" in cp.output
    assert_same_losses(cp, ref, TOL_CP)
