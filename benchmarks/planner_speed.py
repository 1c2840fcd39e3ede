"""The planner's speed: importing it and planning, apart, for the shapes of #28.

    python benchmarks/planner_speed.py [--rounds 3] [TREE ...]
    python benchmarks/planner_speed.py --plans BEFORE AFTER

Each TREE (a checkout; default: this one) runs every shape of :data:`SHAPES` once per round in a
fresh interpreter, trees and shapes alternating: the seconds to import ``torchtitan_seq.plan``
(torch and ``torch.distributed.pipelining`` with it), the seconds of ``plan.main([..., "--json"])``
(the search and its JSON), and the whole process's wall time (``python -m torchtitan_seq.plan``
as a user runs it, startup and exit included) and CPU time (user + system: on a machine other jobs
share, what the process itself spent, which their load moves less than its wall time). Prints a
markdown table of the medians.

``--plans``: instead, the planner's answer (stdout, stderr, exit code) to every argument set of
:data:`PLAN_SETS` in each tree, and which sets two trees answer differently: a change meant to make
the planner faster must give the same plans.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["SHAPES", "PLAN_SETS", "measure", "answers", "main"]

SHAPES = {
    "8B, 32K, 64 GPUs (README)": ["--flavor", "8B", "--seq-len", "32768", "--gpus", "64"],
    "8B, 64K, 64 GPUs": ["--flavor", "8B", "--seq-len", "65536", "--gpus", "64"],
    "70B, 128K, 1024 GPUs": ["--flavor", "70B", "--seq-len", "131072", "--gpus", "1024"],
}
COMMON = ["--gpu-memory-gib", "80", "--local-batch-size", "16", "--json"]

_DEBUG = "--flavor debugmodel --seq-len 2048 --gpus 4 --local-batch-size 8"
_COSTS = str(Path(__file__).resolve().parent / "planner")
PLAN_SETS = [
    args.split()
    for args in (
        "--flavor 8B --seq-len 32768 --gpus 64 --gpu-memory-gib 80 --local-batch-size 16 --json",
        "--flavor 8B --seq-len 65536 --gpus 64 --gpu-memory-gib 80 --local-batch-size 16 --json",
        "--flavor 70B --seq-len 131072 --gpus 1024 --gpu-memory-gib 80 --local-batch-size 16 --json",
        "--flavor 70B --seq-len 131072 --gpus 1024 --gpu-memory-gib 80 --local-batch-size 16 --json --top 100",
        "--flavor 8B --seq-len 32768 --gpus 64 --gpu-memory-gib 80 --local-batch-size 16 --json --top 200",
        f"{_DEBUG} --gpu-memory-gib 4 --json",
        f"{_DEBUG} --unit-overhead-ms 0 --tp 1 --gpu-memory-gib 64 --top 200 --json",
        f"{_DEBUG} --unit-overhead-ms 0 --tp 1 --gpu-memory-gib 0.3 --json",
        f"{_DEBUG} --unit-overhead-ms 0 --tp 1 --gpu-memory-gib 0.05 --json",
        "--flavor 8B --seq-len 32768 --gpus 64 --gpu-memory-gib 80 --local-batch-size 16 --tp 2 --top 50 --json",
        "--flavor 8B --seq-len 32768 --gpus 4 --gpu-memory-gib 1 --local-batch-size 4",
        f"--flavor debugmodel --seq-len 2048 --gpus 2 --gpu-memory-gib 80 --local-batch-size 8 --cost {_COSTS} "
        "--length-multiple 64 --json",
        f"--flavor debugmodel --seq-len 2048 --gpus 8 --gpu-memory-gib 80 --local-batch-size 8 --cost {_COSTS} "
        "--length-multiple 64 --json",
        "--flavor 8B --seq-len 65536 --gpus 64 --gpu-memory-gib 40 --local-batch-size 16 --json",
        "--flavor 70B --seq-len 32768 --gpus 256 --gpu-memory-gib 80 --local-batch-size 16 --json",
        "--flavor debugmodel --seq-len 2048 --gpus 8 --gpu-memory-gib 80 --local-batch-size 8 "
        "--length-multiple 64 --json",
        "--flavor 8B --seq-len 16384 --gpus 16 --gpu-memory-gib 20 --local-batch-size 16 --json",
        "--flavor 8B --seq-len 65536 --gpus 64 --gpu-memory-gib 80 --local-batch-size 16 --tp 2 --top 3 --json",
        "--flavor 8B --seq-len 65536 --gpus 64 --gpu-memory-gib 80 --local-batch-size 16 --tp 2 --top 3 --cp 1 --json",
        "--flavor 70B --seq-len 131072 --gpus 1024 --gpu-memory-gib 80 --local-batch-size 16 --cp 1 --json",
        "--flavor debugmodel --seq-len 512 --gpus 2 --local-batch-size 4 --gpu-memory-gib 80 --unit-overhead-ms 0 "
        "--length-multiple 16 --json",
        "--flavor 70B --seq-len 131072 --gpus 1024 --gpu-memory-gib 30 --local-batch-size 16 --json",
        "--flavor 8B --seq-len 65536 --gpus 64 --gpu-memory-gib 22 --local-batch-size 16 --json",
        "--flavor 8B --seq-len 131072 --gpus 64 --gpu-memory-gib 80 --local-batch-size 8 --json --top 30",
        "--flavor 70B --seq-len 65536 --gpus 512 --gpu-memory-gib 141 --local-batch-size 32 --json",
        f"{_DEBUG} --unit-overhead-ms 0 --tp 1 --gpu-memory-gib 0.065 --json",
        f"{_DEBUG} --unit-overhead-ms 0 --tp 1 --gpu-memory-gib 0.075 --json",
        f"{_DEBUG} --gpu-memory-gib 0.08 --json",
    )
]
"""What the planner is asked, to check that it answers the same: the README's and #28's shapes, the
planner tests' (refusals, tight budgets where fewer fit than asked, calibrated costs, ``--cp 1``)."""

# Run in the measured interpreter: import, then plan, timed apart.
_PROBE = """
import contextlib, io, json, sys, time
start = time.perf_counter()
from torchtitan_seq import plan
imported = time.perf_counter()
with contextlib.redirect_stdout(io.StringIO()):
    plan.main(sys.argv[1:])
print(json.dumps({"import": imported - start, "plan": time.perf_counter() - imported}))
"""


def _cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(tree: Path, argv: list[str]) -> dict[str, float]:
    """Import and plan seconds (measured inside) and the process's wall and CPU seconds of one run in ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start, cpu = time.perf_counter(), _cpu_of_children()
    subprocess.run(
        [sys.executable, "-m", "torchtitan_seq.plan", *argv], cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL
    )
    wall, cpu = time.perf_counter() - start, _cpu_of_children() - cpu
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv], cwd=tree, env=env, check=True, capture_output=True, text=True
    ).stdout
    return {**json.loads(out.splitlines()[-1]), "wall": wall, "cpu": cpu}


def answers(tree: Path, argv: list[str]) -> tuple[str, str, int]:
    """The planner's stdout, stderr and exit code for ``argv`` in ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-m", "torchtitan_seq.plan", *argv], cwd=tree, env=env, capture_output=True, text=True
    )
    return done.stdout, done.stderr, done.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="*", type=Path, default=[Path(__file__).resolve().parents[1]])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plans", action="store_true", help="compare the answers of two trees on PLAN_SETS")
    a = parser.parse_args(argv)
    if a.plans:
        if len(a.trees) != 2:
            parser.error("--plans compares two trees: BEFORE AFTER")
        differ = [i for i, args in enumerate(PLAN_SETS) if len({answers(t.resolve(), args) for t in a.trees}) > 1]
        print(f"{len(PLAN_SETS) - len(differ)} of {len(PLAN_SETS)} argument sets answered alike")
        for i in differ:
            print("differs:", " ".join(PLAN_SETS[i]))
        return 1 if differ else 0
    runs: dict[tuple[Path, str], list[dict[str, float]]] = {}
    for _ in range(a.rounds):
        for name, shape in SHAPES.items():
            for tree in a.trees:
                runs.setdefault((tree, name), []).append(measure(tree.resolve(), shape + COMMON))
    print(f"load average {os.getloadavg()[0]:.1f} at the end; medians of {a.rounds} runs, seconds\n")
    print(
        "| tree | shape | import | plan() | `python -m torchtitan_seq.plan`, wall | its CPU time |\n"
        "|---|---|---|---|---|---|"
    )
    for (tree, name), got in runs.items():
        med = {key: statistics.median(r[key] for r in got) for key in ("import", "plan", "wall", "cpu")}
        print(f"| {tree} | {name} | {med['import']:.2f} | {med['plan']:.2f} | {med['wall']:.2f} | {med['cpu']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
