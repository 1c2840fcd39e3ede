"""What the schedule benchmark (benchmarks/bench.py) runs and refuses, through its command line without
training: its ``--dry-run`` leaves out, with the job check's one line, what the job check refuses, and it
refuses bad schedule specs. Its measurement runs in tests/e2e/test_bench.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench.py"


def _bench(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_dry_run_lists_each_run_and_leaves_out_what_the_job_check_refuses(tmp_path):
    """Variants with their default k and partition, each instrumented then not (``--instrumentation both``),
    as ./run_train.sh overrides; a (schedule, length) the job check refuses is left out with its one line."""
    proc = _bench(
        "--schedules",
        "1F1B, Seq1F1B,Seq1F1B:8,TeraPipe:2:even,DualPipeV",
        "--seq-lens",
        "256,250",
        "--instrumentation",
        "both",
        "--dry-run",
        "--out",
        "out",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [line.split(": ", 1) for line in proc.stdout.splitlines()[1:]]
    labels = ["1F1B", "Seq1F1B k=4 compute", "TeraPipe k=2 even"]  # Seq1F1B k=8: 256 tokens cut in 4 at most
    both = [label + arm for label in labels for arm in ("", " uninstrumented")]
    assert [what for what, _ in runs] == [f"seq 256, {label}" for label in both] + [
        "seq 250, 1F1B",  # 250 is no multiple of 64: torch's schedule alone runs
        "seq 250, 1F1B uninstrumented",
    ]
    commands = dict(runs)
    on, off = commands["seq 256, Seq1F1B k=4 compute"], commands["seq 256, Seq1F1B k=4 compute uninstrumented"]
    assert on.startswith("NGPU=2 ") and " ./run_train.sh --parallelism.pipeline_parallel_schedule Seq1F1B " in on
    assert "--sequence_pipeline.num_subsequences 4 --sequence_pipeline.partition compute" in on
    assert "--sequence_pipeline.activation_memory_freq 1 " in on and "no-pipeline-timeline" not in on
    assert "--sequence_pipeline.activation_memory_freq 0 --sequence_pipeline.no-pipeline-timeline" in off
    assert "--training.seq_len 256 --training.local_batch_size 4" in on
    assert "num_subsequences" not in commands["seq 256, 1F1B"]
    skipped = [line for line in proc.stderr.splitlines() if line.startswith("skipped: ")]
    refused = {line.split(", refused by the job check: ")[0] for line in skipped}
    assert refused == {
        f"skipped: {label} at seq {n}"
        for n, names in {
            256: ("Seq1F1B k=8 compute", "DualPipeV"),
            250: ("Seq1F1B k=4 compute", "Seq1F1B k=8 compute", "TeraPipe k=2 even", "DualPipeV"),
        }.items()
        for name in names
        for label in (name, name + " uninstrumented")
    }
    assert any("pipeline_parallel_expert_parallel_overlap = false" in line for line in skipped)
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_bad_schedule_specs_are_named_in_one_error(tmp_path):
    proc = _bench("--schedules", "1F1B:4,Seq1F1B:4:bogus,Seq1F1B:4:even:x,Seq1F1B:x,Seq1F1B:2", cwd=tmp_path)
    assert proc.returncode == 2
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("python benchmarks/bench.py: error: "), proc.stderr
    for bad in (
        "'1F1B:4': 1F1B is torch's",
        "'Seq1F1B:4:bogus': partition 'bogus'",
        "'Seq1F1B:4:even:x'",
        "'Seq1F1B:x'",
    ):
        assert bad in error, error
    assert "Seq1F1B:2'" not in error and not list(tmp_path.iterdir())
