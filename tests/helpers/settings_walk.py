"""The settings walk: each case the job check refuses, in this process, or 2 ranks train it a step.

:func:`walk` takes cases (a name and torchtitan overrides on :data:`BASE` and the installed torchtitan's
debug job: 0.2.2's ``train_configs/debug_model.toml``, or 0.3's config function :data:`RECIPE` of
``torchtitan_seq.recipes``, which a case's own ``--module``/``--config`` replace). :func:`check` gives a
case's outcome under the job check alone (the installed version's ``check_job``): ``refused`` with the
message of the check or, under 0.3, of torchtitan, which refuses some settings when it builds the config,
else ``passed``. The walk trains each case that passes for one step on 2 gloo ranks forked from the
exactness harness's fork server (torch and torchtitan imported once, a process group of its own per case,
so no state of one case reaches the next): ``trained`` when both ranks ended the step with a finite loss,
else ``crashed`` with a rank's error. A check that raises anything but its ``ValueError`` is ``crashed``
too: the user would see a traceback, not the setting at fault.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import time
import traceback
from pathlib import Path

import torch.multiprocessing as mp

from harness import _free_port, _start_fork_server
from torchtitan_seq.instrumentation.record import Run
from torchtitan_seq.titan.version import TITAN_03

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "train_configs" / "debug_model.toml")
RECIPE = "llama3_debugmodel_seq1f1b"
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
"""What every case trains, under either torchtitan (0.3 takes 0.2.2's spelling too): one step at 256
tokens (4 units of 64, the debug job's length_multiple); a rank left waiting by a crashed peer gives up
after 5 minutes (a compiling peer on 2 cores that CI's other lane shares can take minutes)."""


def _titan():
    """The installed torchtitan's layer: its ``register``, ``check_job`` and ``SeqTrainer``."""
    if TITAN_03:
        from torchtitan_seq.titan.v03 import job_check, registration, trainer
    else:
        from torchtitan_seq.titan.v022 import job_check, registration, trainer
    return registration.register, job_check.check_job, trainer.SeqTrainer


def _config(overrides: list[str], dump_folder: Path):
    """A case's job config, parsed as the installed torchtitan parses its command line.

    Raises:
        ValueError: torchtitan 0.3 refuses the settings when it builds the config (tyro prints why in a
            frame and exits; the message is that frame's text, on one line).
    """
    from torchtitan.config import ConfigManager

    from torchtitan_seq import train  # the entry point's set-up, as a user's job has it (offline datasets)

    if not TITAN_03:
        args = ["--job.config_file", CONFIG, *BASE, *overrides, "--job.dump_folder", str(dump_folder)]
        return ConfigManager().parse_args(train.resolve_args(args))
    # the overrides last: an activation-checkpoint:<mode> subcommand takes no top-level option after it
    args = ["--module", "torchtitan_seq.recipes", "--config", RECIPE, *BASE, "--dump_folder", str(dump_folder)]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            return ConfigManager().parse_args([*args, *overrides])
    except SystemExit as e:
        raise ValueError(f"torchtitan refuses the config: {_framed_message(printed.getvalue())}") from e


def _framed_message(printed: str) -> str:
    """The message tyro prints, in a frame, for a command line it cannot build a config of, on one line:
    the frame's lines after its first rule (its title and what was printed before it left out) up to its
    pointer to ``--help``, without its rules."""
    lines = [line.strip(" │╭╮╰╯") for line in printed.splitlines()]
    rules = [i for i, line in enumerate(lines) if line and set(line) <= set("-─")]
    body = lines[rules[0] + 1 :] if rules else lines
    hint = next((i for i, line in enumerate(body) if line.startswith("For full helptext")), len(body))
    return " ".join(line for line in body[:hint] if line and not set(line) <= set("-─"))


def _rank(rank: int, port: int, overrides: list[str], dump_folder: str) -> None:
    """One rank of one case: train the step, write ``rank<r>.json`` into the dump folder."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # 2 ranks share 2 cores (the fork server's torch took them all)
    register, _, trainer_class = _titan()
    register()
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    folder, trainer, result = Path(dump_folder), None, {}
    try:
        trainer = trainer_class(_config(overrides, folder))
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


def check(cases: dict[str, tuple[str, ...]], tmp_path: Path, world: int = WORLD) -> dict[str, dict]:
    """Each case's outcome under the job check alone, for ``world`` processes, in this process.

    Args:
        cases: per name, the case's overrides.
        tmp_path: where each case's dump folder would be (``case<i>``).
        world: the job's process count.

    Returns:
        Per name, ``{"outcome": "refused", "message": ...}``, ``{"outcome": "passed"}``, or ``crashed`` with
        the check's exception.
    """
    register, check_job, _ = _titan()
    register()
    results = {}
    for i, (name, overrides) in enumerate(cases.items()):
        try:
            check_job(_config(list(overrides), tmp_path / f"case{i}"), world)
        except ValueError as e:
            results[name] = {"outcome": "refused", "message": str(e)}
        except Exception as e:  # noqa: BLE001 - a check that crashes is the case's outcome
            results[name] = {"outcome": "crashed", "message": f"the job check raised {type(e).__name__}: {e}"}
        else:
            results[name] = {"outcome": "passed"}
    return results


def walk(cases: dict[str, tuple[str, ...]], tmp_path: Path) -> dict[str, dict]:
    """Each case's outcome: ``refused`` (with the check's ``message``), or ``trained`` or ``crashed`` with the
    ``seconds`` its training took."""
    results = check(cases, tmp_path)
    for i, (name, overrides) in enumerate(cases.items()):
        if results[name]["outcome"] == "passed":
            start = time.monotonic()
            results[name] = _train(list(overrides), tmp_path / f"case{i}")
            results[name]["seconds"] = round(time.monotonic() - start, 1)
            print(f"{name}: {results[name]}", flush=True)
    return results


def forbidden(results: dict[str, dict]) -> dict[str, dict]:
    """The outcomes the walk forbids: a crash on a rank, or a refusal in more than one line."""
    return {
        name: r
        for name, r in results.items()
        if r["outcome"] == "crashed" or (r["outcome"] == "refused" and "\n" in r["message"])
    }


def assert_refused_in_one_line(cases: dict[str, tuple[str, ...]], name: str, needle: str, tmp_path: Path) -> None:
    """The check alone, in this process: case ``name`` of ``cases`` is refused in one line saying ``needle``."""
    results = check({name: cases[name]}, tmp_path)
    assert results[name]["outcome"] == "refused", results
    assert needle in results[name]["message"] and "\n" not in results[name]["message"], results[name]


def assert_the_walk_holds(cases: dict[str, tuple[str, ...]], tmp_path: Path) -> dict[str, dict]:
    """Walk ``cases`` (printing each outcome): none is forbidden; returns the outcomes."""
    results = walk(cases, tmp_path)
    print("\n".join(f"{name}: {r['outcome']} {r.get('message', '')}" for name, r in results.items()))
    assert not forbidden(results), json.dumps(forbidden(results), indent=1)
    return results
