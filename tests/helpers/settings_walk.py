"""The settings walk: each case the job check refuses, in this process, or 2 ranks train it a step.

:func:`walk` takes cases (a name and torchtitan overrides on :data:`BASE` and the debug model's
config). A case the job check (:func:`~torchtitan_seq.titan.v022.job_check.check_job`, for 2 processes)
refuses is ``refused`` with its message; any other is trained for one step by 2 gloo ranks forked
from the exactness harness's fork server (torch and torchtitan imported once, a process group of
its own per case, so no state of one case reaches the next), and is ``trained`` when both ranks
ended the step with a finite loss, else ``crashed`` with each rank's error.
"""

from __future__ import annotations

import json
import math
import os
import traceback
from pathlib import Path

import torch.multiprocessing as mp

from harness import _free_port, _start_fork_server
from torchtitan_seq.instrumentation.record import Run

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "train_configs" / "debug_model.toml")
WORLD = 2
BASE = (
    "--training.seq_len",
    "256",
    "--training.steps",
    "1",
    "--metrics.log_freq",
    "1",
    "--comm.init_timeout_seconds",
    "300",
    "--comm.train_timeout_seconds",
    "300",
)
"""What every case trains: one step at 256 tokens (4 units of 64, the config's length_multiple); a rank
left waiting by a crashed peer gives up after 5 minutes (a compiling peer on 2 cores that CI's other lane
shares can take minutes)."""


def _config(overrides: list[str], dump_folder: Path):
    from torchtitan.config import ConfigManager

    from torchtitan_seq.train import resolve_args

    args = ["--job.config_file", CONFIG, *BASE, *overrides, "--job.dump_folder", str(dump_folder)]
    return ConfigManager().parse_args(resolve_args(args))


def _rank(rank: int, port: int, overrides: list[str], dump_folder: str) -> None:
    """One rank of one case: train the step, write ``rank<r>.json`` into the dump folder."""
    import torch.distributed as dist

    from torchtitan_seq.titan.v022.registration import register
    from torchtitan_seq.titan.v022.trainer import SeqTrainer

    register()
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    folder, trainer, result = Path(dump_folder), None, {}
    try:
        trainer = SeqTrainer(_config(overrides, folder))
        trainer.train()
        result["steps"] = trainer.step
    except Exception as e:  # noqa: BLE001 - any crash is the case's outcome
        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {e}"[:2000]
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    (folder / f"rank{rank}.json").write_text(json.dumps(result))


def _train(overrides: list[str], dump_folder: Path) -> dict:
    """Train one step of a case on :data:`WORLD` forked ranks."""
    dump_folder.mkdir(parents=True)
    _start_fork_server()
    try:
        mp.start_processes(
            _rank, args=(_free_port(), overrides, str(dump_folder)), nprocs=WORLD, join=True, start_method="forkserver"
        )
    except mp.ProcessExitedException as e:
        return {"outcome": "crashed", "message": f"a rank exited: {e}"}
    ranks = [json.loads((dump_folder / f"rank{r}.json").read_text()) for r in range(WORLD)]
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return {"outcome": "crashed", "message": errors[0]}
    losses = Run.from_dump_folder(dump_folder).losses  # rank 0 keeps the metrics record
    trained = all(r["steps"] == 1 for r in ranks) and len(losses) == 1 and math.isfinite(losses[0])
    return {"outcome": "trained" if trained else "crashed", "losses": losses, "steps": [r["steps"] for r in ranks]}


def walk(cases: dict[str, tuple[str, ...]], tmp_path: Path) -> dict[str, dict]:
    """Each case's outcome: ``refused`` (with the check's ``message``), ``trained`` or ``crashed``."""
    from torchtitan_seq.titan.v022.job_check import check_job
    from torchtitan_seq.titan.v022.registration import register

    register()
    results = {}
    for i, (name, overrides) in enumerate(cases.items()):
        folder = tmp_path / f"case{i}"
        try:
            check_job(_config(list(overrides), folder), WORLD)
        except ValueError as e:
            results[name] = {"outcome": "refused", "message": str(e)}
            continue
        results[name] = _train(list(overrides), folder)
        print(f"{name}: {results[name]}", flush=True)
    return results
