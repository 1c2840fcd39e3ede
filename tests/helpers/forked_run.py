"""A training run on ranks forked from the exactness harness's fork server, for jobs known to be valid.

``./run_train.sh`` pays, per run, a start-up check and a torchrun whose ranks each import torch and
torchtitan afresh: about 15 s of a 2-core machine's time before the first step, most of an end-to-end
test's run. :func:`run_forked` starts the same job on ranks forked from the server that imported them
once (:func:`harness._start_fork_server`, :mod:`rank_imports`) and runs what ``python -m
torchtitan_seq.train`` runs: torchtitan's ``main`` with the package registered, on the command line
run_train.sh builds (its ``CONFIG_FILE`` and ``NGPU``), each rank's console in ``rank<r>.log`` of the
dump folder. The tests of the entry point itself (the start-up check, torchrun, the exit code) keep
``./run_train.sh``: ``tests/helpers/titan.py``'s ``run_train(check=True)``.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import traceback
from pathlib import Path
from unittest import mock

import torch
import torch.multiprocessing as mp

from harness import _free_port, _start_fork_server
from torchtitan_seq.instrumentation.record import Run

__all__ = ["ROOT", "run_forked"]

ROOT = Path(__file__).resolve().parents[2]
"""The checkout: run_train.sh's folder, where the job runs."""


def _rank(rank: int, world: int, port: int, argv: list[str], env: dict[str, str], dump_folder: str) -> None:
    """One rank: torchtitan's main on ``argv``, its console into ``rank<rank>.log``; exits 1 on a crash."""
    log = os.open(os.path.join(dump_folder, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.chdir(ROOT)  # run_train.sh's working directory: the config files' paths are relative to it
    os.environ.update(
        env,
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # read by torch at start-up: the server's is set
    from torchtitan.config import ConfigManager

    from torchtitan_seq.train import register, resolve_args, titan_main

    register()
    # torchtitan 0.2.2's main parses the sys.argv its ConfigManager captured when it was imported (the
    # server's): it parses this job's instead.
    parse = functools.partialmethod(ConfigManager.parse_args, resolve_args(argv))
    code = 0
    try:
        with mock.patch.object(ConfigManager, "parse_args", parse):
            titan_main()
    except BaseException:  # noqa: BLE001 - the rank's failure is the run's exit status, its traceback the log's
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as the entry point exits: no interpreter teardown


def run_forked(*overrides: str, dump_folder: Path, env: dict | None = None, timeout: int = 600) -> Run:
    """run_train.sh's job (``env``: its ``CONFIG_FILE``, ``NGPU`` and the ranks' environment) on forked
    ranks; rank 0's console is the run's output, its exit status 1 when a rank failed, 124 on timeout."""
    env = dict(env or {})
    env.pop("TORCHTITAN_SEQ_SKIP_CHECK", None)  # there is no start-up check to skip
    config = env.pop("CONFIG_FILE", "./train_configs/debug_model.toml")
    world = int(env.pop("NGPU", "2"))
    env.setdefault("OMP_NUM_THREADS", "1")
    dump_folder = Path(dump_folder).resolve()
    dump_folder.mkdir(parents=True, exist_ok=True)
    argv = ["--job.config_file", config, "--job.dump_folder", str(dump_folder), *overrides]
    _start_fork_server()
    ranks = mp.start_processes(
        _rank,
        args=(world, _free_port(), argv, env, str(dump_folder)),
        nprocs=world,
        join=False,
        start_method="forkserver",
    )
    returncode, deadline = 0, time.monotonic() + timeout
    try:
        while not ranks.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                returncode = 124
                break
    except mp.ProcessExitedException:  # join stops the other ranks
        returncode = 1
    finally:
        for process in ranks.processes:
            if process.is_alive():
                process.kill()
    output = (dump_folder / "rank0.log").read_text(errors="replace")
    return Run.from_dump_folder(dump_folder, returncode, output)
