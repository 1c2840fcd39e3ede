"""Each unit's forward + backward against its share of the whole sequence, two checkouts alternating.

    python benchmarks/unit_cost_ab.py --trees OLD NEW [--seq-lens 2048,4096] [--cuts 4:compute,8:even]
        [--rounds 3] [--repeats 3] --out DIR

For every length, each tree (a checkout; its ``torchtitan_seq`` and ``benchmarks/calibration.py``)
calibrates, in a fresh interpreter of its own, the debug model's units as one pipeline rank holding
the whole model runs them (:func:`calibration.calibrate`: forward in order, backward last unit first,
one thread, the activation meter on, median of ``--repeats``), every cut and the whole sequence
(plain attention, as torch's schedules run it); the trees alternate, their order reversed every
round, so drift in the machine's speed falls on both. A unit's *share* is its part of the whole
sequence's forward + backward compute under the transformer cost model
(:class:`torchtitan_seq.runtime.partition.UnitCost`: linear work per token, attention per causal pair), and
its ratio is its measured F + B over that share of the whole sequence's measured F + B: 1 is a unit
that costs no more than its share. Writes ``unit_cost.json`` (every round's times) and
``unit_cost.md`` (medians over the rounds, with the load average).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(ROOT))  # this checkout's package, for the cuts and the cost model

from torchtitan_seq.runtime.partition import UnitCost, partition_sequence  # noqa: E402
from torchtitan_seq.titan.v022.models.llama3_seq import seq_llama3_flavors  # noqa: E402

# Run in the measured tree's interpreter: argv = seq_len, repeats, lengths (JSON list of lists).
_PROBE = """
import json, sys
from calibration import calibrate
seq_len, repeats, cuts = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
times = {}
for lengths in cuts:
    units = len(lengths) > 1
    cost = calibrate(seq_len, lengths, 1, units=units, repeats=repeats)
    times[json.dumps(lengths)] = [f + b for f, b in zip(cost["F"], cost["B"])]
print(json.dumps(times))
"""


def shares(lengths: list[int]) -> list[float]:
    """Each unit's part of the whole sequence's forward + backward under the cost model."""
    cost = UnitCost.from_model_args(seq_llama3_flavors["debugmodel"])
    offsets = [sum(lengths[:j]) for j in range(len(lengths))]
    whole = cost(sum(lengths), 0)
    return [cost(n, o) / whole for n, o in zip(lengths, offsets)]


def cut(seq_len: int, spec: str) -> list[int]:
    k, method = spec.split(":")
    cost = UnitCost.from_model_args(seq_llama3_flavors["debugmodel"])
    return partition_sequence(seq_len, int(k), method, multiple=64, cost=cost)


def measure(tree: Path, seq_len: int, cuts: list[list[int]], repeats: int) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{tree / 'benchmarks'}"}
    argv = [sys.executable, "-c", _PROBE, str(seq_len), str(repeats), json.dumps(cuts)]
    out = subprocess.run(argv, env=env, cwd=tree, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", type=Path, nargs=2, required=True, help="the two checkouts, before and after")
    ap.add_argument("--seq-lens", default="2048,4096")
    ap.add_argument("--cuts", default="4:compute,8:even", help="K:PARTITION, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    specs = args.cuts.split(",")
    runs = []
    for r in range(args.rounds):
        for seq_len in seq_lens:
            cuts = [cut(seq_len, s) for s in specs] + [[seq_len]]
            for tree in args.trees if r % 2 == 0 else reversed(args.trees):
                load = os.getloadavg()[0]
                runs.append({"round": r, "tree": str(tree), "seq_len": seq_len, "load": load,
                             "times": measure(tree, seq_len, cuts, args.repeats)})  # fmt: skip
                print(json.dumps(runs[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "unit_cost.json").write_text(json.dumps(runs, indent=1))
    (args.out / "unit_cost.md").write_text(table(runs, specs, seq_lens, args.trees))


def table(runs: list[dict], specs: list[str], seq_lens: list[int], trees: list[Path]) -> str:
    """Per length and cut: each unit's ratio to its share (median over the rounds), per tree, and the
    sum of the units against the whole sequence."""
    lines = [
        "| seq | cut | tree | unit F+B / share of whole F+B, per unit | units / whole | whole F+B (s) |",
        "|---|---|---|---|---|---|",
    ]
    for seq_len in seq_lens:
        for spec in specs:
            lengths = cut(seq_len, spec)
            for tree in trees:
                mine = [x["times"] for x in runs if x["seq_len"] == seq_len and x["tree"] == str(tree)]
                whole = statistics.median(t[json.dumps([seq_len])][0] for t in mine)
                units = [statistics.median(t[json.dumps(lengths)][j] for t in mine) for j in range(len(lengths))]
                ratios = ", ".join(f"{u / (s * whole):.2f}" for u, s in zip(units, shares(lengths)))
                lines.append(
                    f"| {seq_len} | {spec} {lengths} | {tree} | {ratios} | {sum(units) / whole:.3f} | {whole:.3f} |"
                )
    loads = [x["load"] for x in runs]
    lines.append(f"\nLoad average (1 min) at each calibration: {min(loads):.2f} to {max(loads):.2f}.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
