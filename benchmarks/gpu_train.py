"""The trainer end to end on one device, as a user launches it: ``python -m torchtitan_seq.train`` under
torchrun with one process, the llama3_seq debug model at 8K tokens (``--tiny``: 256) for a few steps, torch's
1F1B selected with pp = 1 (so no pipeline: the path on which the metrics processor times steps no stage
starts), TensorBoard on. Checks the trainer's record (``metrics.jsonl``: the start record and a step
record per step, finite losses) and that TensorBoard wrote its event file.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torchtitan_seq.instrumentation.record import RECORD_FILE, Run, read_record

__all__ = ["check_training"]

ROOT = Path(__file__).resolve().parents[1]

STEPS = 4
TINY_STEPS = 2


def _overrides(dump: Path, seq_len: int, steps: int) -> list[str]:
    return [
        "--job.config_file",
        str(ROOT / "train_configs" / "debug_model.toml"),
        "--job.dump_folder",
        str(dump),
        "--parallelism.pipeline_parallel_degree",
        "1",
        "--parallelism.pipeline_parallel_schedule",
        "1F1B",
        "--training.seq_len",
        str(seq_len),
        "--training.local_batch_size",
        "2",
        "--training.steps",
        str(steps),
        "--lr_scheduler.warmup_steps",
        "1",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
    ]


def check_training(tiny: bool, cuda: bool, timeout: int = 600) -> dict:
    """Train, read what the run wrote, and say whether it is all there."""
    seq_len, steps = (256, TINY_STEPS) if tiny else (8192, STEPS)
    env = {**os.environ, **({} if cuda else {"OMP_NUM_THREADS": "1"})}
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu_train_") as folder:
        dump = Path(folder)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "1",
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            "localhost:0",
            "-m",
            "torchtitan_seq.train",
            *_overrides(dump, seq_len, steps),
        ]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            returncode, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            returncode, output = None, f"timed out after {timeout} s: {e}"
        records = read_record(dump / RECORD_FILE)
        events = sorted(p.name for p in (dump / "tb").rglob("events.out.tfevents.*") if p.stat().st_size > 0)
    run = Run.from_record(returncode if returncode is not None else -1, output, records)
    start = next((r for r in records if r["event"] == "start"), None)
    record = {
        "command": "torchrun --nproc_per_node 1 -m torchtitan_seq.train "
        + " ".join(_overrides(Path("DUMP"), seq_len, steps)),
        "flavor": "debugmodel",
        "seq_len": seq_len,
        "steps": steps,
        "returncode": returncode,
        "elapsed_s": round(time.monotonic() - began, 1),
        "start_record": start is not None,
        "step_records": len(run.losses),
        "losses": run.losses,
        "tps": run.tps,
        "memory_gib": run.memory_gib,
        "tensorboard_event_files": events,
    }
    ok = (
        returncode == 0
        and start is not None
        and start["schedule"] == "1F1B"
        and len(run.losses) == steps
        and all(math.isfinite(loss) for loss in run.losses)
        and bool(events)
    )
    record["status"] = "ok" if ok else "failed"
    if not ok:
        record["output_tail"] = output[-4000:]
    return record
