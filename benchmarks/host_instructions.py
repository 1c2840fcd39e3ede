"""The unit path's own host cost per unit and layer in instructions, counted by valgrind: a measure without a clock.

    python benchmarks/host_instructions.py --trees OLD NEW [--kernels cpu CudnnSdpaKernel CudaSdpaKernel descending]
                                            [--out DIR]

``unit_host.py``'s own measure (attention layers of the tiny Llama 3's shape bound to a KV context, K units
of one sequence forward and backward against one unit through the same op, 4 layers minus 2, over the
K - 1 units added) with callgrind's count of the instructions the process executes instead of its CPU
time: the same code gives the same count to a tenth of a percent, where on a shared VM the time of one
change moves by a fifth from run to run (benchmarks/README.md). ``cpu``: torch's CPU kernel (its compute
counted too, as on the CPU it is host work); the CUDA adapters' names: their op sequences against fakes
of their aten ops that compute nothing (``unit_host._fake_cuda_ops(compute=False)``), the host's work
where a GPU computes. Each (tree, kernel) runs in its own process under valgrind, about 2 minutes, two
at a time; callgrind counts only inside ``operator.call``, through which the measured steps run (a C
function it can name; Python's own functions it cannot). ``descending`` (not a kernel, not run unless
asked for): what a descending slab costs per unit-layer over an ascending one, from ``unit_host``'s
shared-arena steps (the KV context told the stage's passes, minus not told; the CPU kernel). Needs valgrind.
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEPS = 2  # steps counted per (units, layers): what is counted is the least noisy of measures already
KERNELS = ("cpu", "CudnnSdpaKernel", "CudaSdpaKernel")
DESCENDING = "descending"  # not a kernel: a descending slab's instructions per unit-layer over an ascending one's


def _count_steps(kernel: str) -> None:
    """Inside valgrind: warm every step up, then run each STEPS times inside ``operator.call``, one
    callgrind dump each, in the order of :func:`_regions`."""
    import contextlib

    import torch
    import unit_host as uh

    torch.set_num_threads(1)
    fakes = uh._fake_cuda_ops(compute=False) if kernel not in ("cpu", DESCENDING) else contextlib.nullcontext()
    with fakes:
        if kernel == DESCENDING:
            *steps, descending = uh.arena_steps()  # told the passes (shared arenas), not told (ascending)
            print(f"descending unit-layers: {descending}", flush=True)
        else:
            steps = [uh.attention_steps(uh.CPU, k, None if kernel == "cpu" else kernel, n)[0] for k, n in _regions()]
        for step in steps:
            for _ in range(3):
                step()
        for step in steps:
            operator.call(_repeat, step)


def _repeat(step) -> None:
    for _ in range(STEPS):
        step()


def _regions() -> list[tuple[int, int]]:
    """(units, layers) of the counted regions, in order."""
    import unit_host as uh

    return [(k, n) for k in (1, uh.K) for n in uh.ATTENTION_LAYERS]


def count(tree: Path, kernel: str) -> float:
    """Instructions per unit-layer added, the unit path of ``tree`` with ``kernel``; ``descending``: per
    unit-layer of a descending slab over an ascending one's (``unit_host.arena_steps``, the CPU kernel)."""
    import unit_host as uh

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        command = [
            "valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=_operator_call",
            "--dump-after=_operator_call", f"--callgrind-out-file={out}", sys.executable, __file__, "--inner", kernel,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1"}
        run = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
        dumps = sorted(Path(tmp).glob("callgrind.out.*"), key=lambda p: int(p.suffix[1:]))
        regions = _regions()
        expected = 2 if kernel == DESCENDING else len(regions)
        if len(dumps) < expected:
            raise RuntimeError(f"callgrind wrote {len(dumps)} dumps, not {expected}: no _operator_call symbol?")
        if kernel == DESCENDING:
            told, untold = (_summary(dump) for dump in dumps[-2:])
            return (told - untold) / STEPS / int(run.stdout.rsplit(":", 1)[1])
        counts = {}  # named as unit_host names its runs: k<units>_<layers>
        for (units, layers), dump in zip(regions, dumps[-len(regions) :]):
            counts[f"k{units}_{layers}"] = _summary(dump) / STEPS
    return uh._own(counts, f"k{uh.K}", "k1")


def _summary(dump: Path) -> int:
    """The instructions a callgrind dump counts."""
    return int(next(line for line in dump.read_text().splitlines() if line.startswith("summary:")).split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", type=Path, default=[HERE.parent])
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=(*KERNELS, DESCENDING))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--inner", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        return _count_steps(args.inner)
    if shutil.which("valgrind") is None:
        raise SystemExit("host_instructions.py needs valgrind (apt install valgrind)")
    jobs = [(tree.resolve(), kernel) for kernel in args.kernels for tree in args.trees]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda job: count(*job), jobs))
    record = [
        {"tree": str(tree), "kernel": kernel, "instructions_per_unit_layer": n}
        for (tree, kernel), n in zip(jobs, results)
    ]
    for kernel in args.kernels:
        row = [r["instructions_per_unit_layer"] for r in record if r["kernel"] == kernel]
        figures = ", ".join(f"{n / 1e3:,.0f}K" for n in row)
        print(f"{kernel:>16}: {figures}  (last / first {row[-1] / row[0]:.3f})")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_instructions.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
