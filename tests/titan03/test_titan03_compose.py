"""Sequence schedules composed with torchtitan 0.3's FSDP2, TP, activation checkpointing and
torch.compile, run as a user runs them: ``TORCHTITAN=0.3 ./run_train.sh`` on CPU ranks (gloo).

From one seed checkpoint (torchtitan seeds each pipeline rank differently), Seq1F1B logs the losses of
torch's 1F1B on the same mesh, as under 0.2.2 (tests/e2e/test_compose_titan.py). To keep the wall time
low, each Seq1F1B run composes more than its mesh: activation checkpointing (which recomputes, and so
must leave the losses as they are) rides on the mesh runs, whose 1F1B runs, without it, are the
reference; the TP runs train on packed documents (the block-causal config: document ids pass through
0.3's TP plan for attention); the FSDP2 run also writes the metrics record (``metrics.jsonl``,
TensorBoard, the pipeline timeline), read by its own test. Context parallelism inside units (pp 2 x cp 2)
logs the losses of the pipeline alone (pp 2), causal and on packed documents. HSDP (2 replicas) logs
1F1B's losses on the same mesh, and the validator (on packed documents under TP) 1F1B's validation losses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from titan03_run import Run, run_train
from torchtitan_seq.instrumentation import timeline
from torchtitan_seq.titan.version import TITAN_03

pytestmark = pytest.mark.skipif(not TITAN_03, reason="runs ./run_train.sh with torchtitan 0.3")

SMALL = ("--training.seq-len", "256", "--training.local-batch-size", "4", "--sequence-pipeline.length-multiple", "16")
STEPS = 2
TOL = 1e-3  # Seq1F1B against 1F1B: same maths, different summation order (0.2.2's tolerance)

# name: (processes, degrees as overrides, the mesh line 0.3 logs, the config function, its data set)
MESHES = {
    "pp2-fsdp2": (
        4,
        ("--parallelism.data-parallel-shard-degree", "2"),
        "dp_shard=2, cp=1, tp=1",
        "llama3_debugmodel_seq1f1b",
        "seqpp_text",
    ),
    "pp2-tp2-packed": (
        4,
        ("--parallelism.tensor-parallel-degree", "2"),
        "dp_shard=1, cp=1, tp=2",
        "llama3_debugmodel_block_causal_seq1f1b",
        "seqpp_packed",
    ),
}
# The activation checkpointing each mesh's Seq1F1B run applies (0.3's subcommand, last on the line),
# and the class 0.3 logs for it.
AC = {
    "pp2-fsdp2": ("activation-checkpoint:selective", "SelectiveAC"),
    "pp2-tp2-packed": ("activation-checkpoint:full", "FullAC"),
}
# The FSDP2 run's record: TensorBoard on, the timeline exported at step 2 without the profiler.
RECORD_ARGS = ("--metrics.enable-tensorboard",)
RECORD_ENV = {timeline.FREQ_ENV: "2"}


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> str:
    """The seed checkpoint's folder (0.3's ``--checkpoint.create-seed-checkpoint``, on one process)."""
    folder = tmp_path_factory.mktemp("seed")
    made = run_train(
        *SMALL,
        "--checkpoint.enable",
        "--checkpoint.create-seed-checkpoint",
        "--parallelism.pipeline-parallel-degree",
        "1",
        dump_folder=folder,
        env={"NGPU": "1", "TORCHTITAN_SEQ_SKIP_CHECK": "1"},
    )
    assert made.returncode == 0, made.output[-3000:]
    return str(folder / "checkpoint" / "step-0")


def _from_seed(
    seed: str,
    *overrides: str,
    dump_folder: Path,
    ngpu: int,
    check: bool = False,
    env: dict | None = None,
    config: str | None = None,
) -> Run:
    """``STEPS`` steps of the job ``config`` (run_train.sh's default when None) from the seed checkpoint
    (the debug model's: the block-causal flavor has the same weights); ``check``: run run_train.sh's
    start-up check too."""
    run = run_train(
        *SMALL,
        "--training.steps",
        str(STEPS),
        "--checkpoint.enable",
        "--checkpoint.initial-load-path",
        seed,
        "--checkpoint.load-only",
        *overrides,
        dump_folder=dump_folder,
        config=config,
        env={"NGPU": str(ngpu), **({} if check else {"TORCHTITAN_SEQ_SKIP_CHECK": "1"}), **(env or {})},
    )
    assert run.returncode == 0, run.output[-4000:]
    assert len(run.losses) == STEPS, run.output[-4000:]
    return run


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def mesh_runs(seed, tmp_path_factory):
    """mesh -> (Seq1F1B run with its AC, 1F1B run, the Seq1F1B run's dump folder), run once per mesh."""
    runs: dict[str, tuple[Run, Run, Path]] = {}

    def get(mesh: str) -> tuple[Run, Run, Path]:
        if mesh not in runs:
            ngpu, degrees, _, config, _ = MESHES[mesh]
            folder = tmp_path_factory.mktemp(mesh)
            record = mesh == "pp2-fsdp2"
            # the job check on: what it lets through here is what these tests prove
            seq = _from_seed(
                seed,
                *degrees,
                *(RECORD_ARGS if record else ()),
                AC[mesh][0],
                dump_folder=folder / "seq",
                ngpu=ngpu,
                check=True,
                env=RECORD_ENV if record else None,
                config=config,
            )
            schedule = ("--parallelism.pipeline-parallel-schedule", "1F1B")
            ref = _from_seed(seed, *degrees, *schedule, dump_folder=folder / "ref", ngpu=ngpu, config=config)
            runs[mesh] = seq, ref, folder / "seq"
        return runs[mesh]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESHES))
def test_seq1f1b_with_activation_checkpointing_logs_the_losses_of_1f1b_on_the_same_mesh(mesh, mesh_runs):
    seq, ref, _ = mesh_runs(mesh)
    layout, dataset = MESHES[mesh][2], MESHES[mesh][4]
    for run in (seq, ref):
        mesh_line = f"Building device mesh with parallelism: pp=2, dp_replicate=1, {layout}"
        assert mesh_line in run.output and f"Preparing {dataset} dataset" in run.output, run.output[-3000:]
    assert "Sequence pipeline Seq1F1B: 4 microbatches x 4 subsequences" in seq.output
    assert f"Applied {AC[mesh][1]} activation checkpointing to the model" in seq.output, seq.output[-3000:]
    print(f"{mesh}: Seq1F1B {seq.losses}, 1F1B {ref.losses}")
    assert _max_diff(seq.losses, ref.losses) < TOL, (seq.losses, ref.losses)


@pytest.mark.slow
def test_the_metrics_record_tensorboard_and_timeline_as_under_0_2_2(mesh_runs):
    """The FSDP2 run's ``metrics.jsonl`` (docs/metrics.md), its TensorBoard scalars and its timeline."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    seq, _, dump = mesh_runs("pp2-fsdp2")
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    start, steps = records[0], [r for r in records if r["event"] == "step"]
    assert start["event"] == "start" and start["schedule"] == "Seq1F1B" and sum(start["lengths"]) == 256, start
    assert [r["step"] for r in steps] == [1, 2], records
    assert _max_diff([r["loss"] for r in steps], seq.losses) <= 1e-5, (steps, seq.losses)  # the log's 5 decimals
    world = 4
    assert all(len(r["bubble_ratio"]) == world and all(0 <= x < 1 for x in r["bubble_ratio"]) for r in steps)
    assert all(r["pipeline_s"] > 0 for r in steps), steps
    # metered: step 1 (and every 10th logged step: sequence_pipeline.activation_memory_freq's default)
    assert len(steps[0]["peak_activation_bytes"]) == world and min(steps[0]["peak_activation_bytes"]) > 0, steps[0]
    assert steps[1]["peak_activation_bytes"] is None, steps[1]
    assert "peak activations (MiB): rank0" in seq.output and "bubble ratio: rank0" in seq.output
    trace = json.loads((dump / "profiling" / "traces" / "iteration_2" / timeline.TRACE_FILE).read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == set(range(world)), trace["traceEvents"][:3]
    events = list(dump.glob("tb/**/events.out.tfevents.*"))
    assert events, seq.output[-3000:]
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    tags = {"loss_metrics/global_avg_loss", "pipeline/makespan(s)", "memory/peak_activation_bytes/rank3"}
    assert tags | {f"pipeline/bubble_ratio/rank{r}" for r in range(world)} <= set(acc.Tags()["scalars"])


@pytest.mark.slow
@pytest.mark.parametrize("ac", [(), ("activation-checkpoint:memory-budget",)], ids=["no-ac", "memory-budget"])
def test_compiled_seq1f1b_logs_the_losses_of_eager_1f1b(seed, ac, tmp_path):
    """torch.compile of each block, per chunk (0.3's parallelize_fn), on the pipeline alone, without AC and
    with memory-budget AC (a compile pass: the partitioner recomputes what the budget leaves out); float32
    parameters, so that compiled and eager kernels differ by round-off only."""
    fp32 = ("--training.mixed-precision-param", "float32")
    compiled = _from_seed(seed, *fp32, "--compile.enable", *ac, dump_folder=tmp_path / "seq", ngpu=2, check=True)
    ref = _from_seed(
        seed, *fp32, "--parallelism.pipeline-parallel-schedule", "1F1B", dump_folder=tmp_path / "ref", ngpu=2
    )
    assert "Compiling each TransformerBlock with torch.compile" in compiled.output, compiled.output[-3000:]
    print(f"compiled Seq1F1B {compiled.losses}, eager 1F1B {ref.losses}")
    assert _max_diff(compiled.losses, ref.losses) < TOL, (compiled.losses, ref.losses)


TOL_CP = 2e-5  # pp 2 x cp 2 against pp 2 from the same weights: fp32 round-off, and the log's 5 decimals
CP_CONFIGS = {"causal": "llama3_debugmodel_seq1f1b", "block-causal": "llama3_debugmodel_block_causal_seq1f1b"}


@pytest.mark.slow
@pytest.mark.parametrize("config", list(CP_CONFIGS))
def test_context_parallel_logs_the_losses_of_the_pipeline_alone(seed, config, tmp_path):
    """Context parallelism inside units (each CP rank a share of every unit, the CP ranks as FSDP's) from the
    seed checkpoint, as tests/e2e/test_compose_titan.py runs it under 0.2.2; float32 parameters, which 0.3's
    FSDP otherwise casts to bf16."""
    fp32 = ("--training.mixed-precision-param", "float32")
    ref = _from_seed(seed, *fp32, dump_folder=tmp_path / "pp", ngpu=2, config=CP_CONFIGS[config])
    cp = _from_seed(
        seed,
        *fp32,
        "--parallelism.context-parallel-degree",
        "2",
        dump_folder=tmp_path / "cp",
        ngpu=4,
        check=True,
        config=CP_CONFIGS[config],
    )
    assert "Building device mesh with parallelism: pp=2, dp_replicate=1, dp_shard=1, cp=2, tp=1" in cp.output
    print(f"{config}: pp 2 x cp 2 {cp.losses}, pp 2 {ref.losses}")
    assert _max_diff(cp.losses, ref.losses) <= TOL_CP, (cp.losses, ref.losses)


@pytest.mark.slow
def test_seq1f1b_with_hsdp_logs_the_losses_of_1f1b_on_the_same_mesh(seed, tmp_path):
    """Replicated data parallelism (HSDP: 0.3's FSDP over a (dp_replicate, fsdp) mesh; here 2 replicas of
    unsharded chunks, each reading its own batches), from the seed checkpoint."""
    hsdp = ("--parallelism.data-parallel-replicate-degree", "2")
    seq = _from_seed(seed, *hsdp, dump_folder=tmp_path / "seq", ngpu=4, check=True)
    schedule = ("--parallelism.pipeline-parallel-schedule", "1F1B")
    ref = _from_seed(seed, *hsdp, *schedule, dump_folder=tmp_path / "ref", ngpu=4)
    for run in (seq, ref):
        mesh_line = "Building device mesh with parallelism: pp=2, dp_replicate=2, dp_shard=1, cp=1, tp=1"
        assert mesh_line in run.output and "Applied HSDP to the model" in run.output, run.output[-3000:]
    print(f"HSDP: Seq1F1B {seq.losses}, 1F1B {ref.losses}")
    assert _max_diff(seq.losses, ref.losses) < TOL, (seq.losses, ref.losses)


# 0.3's validator: one step of the shipped packed validation set, at step 1 and at the last step
VALIDATE = (
    "--validator.enable",
    "--validator.steps",
    "1",
    "--validator.freq",
    str(STEPS),
    "--validator.dataloader.dataset",
    "seqpp_packed_validation",
)


def _validation_losses(dump: Path) -> list[float]:
    """A run's validation losses from its record (``metrics.jsonl``), in step order, unrounded (the console
    shows 4 decimals)."""
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["event"] == "validation"]


@pytest.mark.slow
def test_seq1f1b_validates_with_the_losses_of_1f1b(seed, tmp_path):
    """The validator runs the schedule forward only (its ``eval``), here on packed documents under TP
    (pp 2 x tp 2), with the batches the trainer's steps get (:class:`~torchtitan_seq.titan.v03.validate.SeqValidator`):
    from the seed checkpoint Seq1F1B's validation losses, and its training losses, are 1F1B's."""
    config, tp = "llama3_debugmodel_block_causal_seq1f1b", ("--parallelism.tensor-parallel-degree", "2")
    seq = _from_seed(seed, *tp, *VALIDATE, dump_folder=tmp_path / "seq", ngpu=4, check=True, config=config)
    schedule = ("--parallelism.pipeline-parallel-schedule", "1F1B")
    ref = _from_seed(seed, *tp, *VALIDATE, *schedule, dump_folder=tmp_path / "ref", ngpu=4, config=config)
    seq_val, ref_val = _validation_losses(tmp_path / "seq"), _validation_losses(tmp_path / "ref")
    assert "Preparing seqpp_packed_validation dataset" in seq.output, seq.output[-3000:]
    assert len(seq_val) == STEPS and seq.output.count("validate step:") == STEPS, seq.output[-3000:]
    print(f"validation: Seq1F1B {seq_val}, 1F1B {ref_val}; training: Seq1F1B {seq.losses}, 1F1B {ref.losses}")
    assert _max_diff(seq_val, ref_val) < TOL, (seq_val, ref_val)
    assert _max_diff(seq.losses, ref.losses) < TOL, (seq.losses, ref.losses)
