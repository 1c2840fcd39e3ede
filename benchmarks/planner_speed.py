"""The planner's speed: importing it and planning, apart, for the shapes of #28.

    python benchmarks/planner_speed.py [--rounds 3] [TREE ...]

Each TREE (a checkout; default: this one) runs every shape of :data:`SHAPES` once per round in a
fresh interpreter, trees and shapes alternating: the seconds to import ``torchtitan_seq.plan``
(torch and ``torch.distributed.pipelining`` with it), the seconds of ``plan.main([..., "--json"])``
(the search and its JSON), and the whole process's wall time (``python -m torchtitan_seq.plan``
as a user runs it, startup and exit included) and CPU time (user + system: on a machine other jobs
share, what the process itself spent, which their load moves less than its wall time). Prints a
markdown table of the medians.
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

__all__ = ["SHAPES", "measure", "main"]

SHAPES = {
    "8B, 32K, 64 GPUs (README)": ["--flavor", "8B", "--seq-len", "32768", "--gpus", "64"],
    "8B, 64K, 64 GPUs": ["--flavor", "8B", "--seq-len", "65536", "--gpus", "64"],
    "70B, 128K, 1024 GPUs": ["--flavor", "70B", "--seq-len", "131072", "--gpus", "1024"],
}
COMMON = ["--gpu-memory-gib", "80", "--local-batch-size", "16", "--json"]

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="*", type=Path, default=[Path(__file__).resolve().parents[1]])
    parser.add_argument("--rounds", type=int, default=3)
    a = parser.parse_args(argv)
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
