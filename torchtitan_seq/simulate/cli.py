"""The command line, ``python -m torchtitan_seq.simulate``.

It exits with 1 on a deadlock and 2 on a schedule or shape it rejects (an
ordering violation, an unsupported N, an unknown name).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from ..partition import PARTITIONS
from ..render import chrome_trace, compute_csv, render_svg
from ..schedules import SEQUENCE_SCHEDULES, TORCH_SCHEDULES
from .build import SimConfig
from .engine import simulate
from .regenerate import regenerate

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m torchtitan_seq.simulate",
        description="Timing simulation of pipeline schedules on torch's lowered action lists.",
    )
    ap.add_argument("--schedule", help=f"one of {sorted(SEQUENCE_SCHEDULES) + list(TORCH_SCHEDULES)}")
    ap.add_argument("--pp", type=int, help="p, pipeline ranks")
    ap.add_argument("--microbatches", type=int, help="N, microbatches per step")
    ap.add_argument("--subsequences", type=int, default=1, help="k, subsequences per microbatch")
    ap.add_argument("--stages-per-rank", type=int, help="V (default: the schedule's own)")
    ap.add_argument("--split-backward", action="store_true", help="sequence schedules: I and W instead of B")
    ap.add_argument("--cost", default="uniform", help="uniform, transformer, or a JSON file of measured times")
    ap.add_argument("--flavor", default="debugmodel", help="model flavor (transformer cost, compute partition)")
    ap.add_argument("--seq-len", type=int, default=2048, help="S, tokens per sequence")
    ap.add_argument("--partition", default="even", choices=PARTITIONS)
    ap.add_argument("--document-length", type=float, default=0.0,
                    help="packed documents: expected tokens per document (block-causal attention); 0: causal")
    ap.add_argument("--comm-latency", type=float, default=0.0, help="SEND to usable data, in time units")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    ap.add_argument("--csv", type=Path, help="write the compute-only action table (torch's CSV format)")
    ap.add_argument("--svg", type=Path, help="write the timeline as SVG")
    ap.add_argument("--trace", type=Path, help="write a Chrome/Perfetto trace")
    ap.add_argument("--regenerate", type=Path, metavar="DIR", help="write the standard set into DIR and exit")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the command line on ``argv``; returns the exit status."""
    ap = _parser()
    args = ap.parse_args(argv)
    if args.regenerate is not None:
        for path in regenerate(args.regenerate):
            print(path)
        return 0
    if args.schedule is None or args.pp is None or args.microbatches is None:
        ap.error("--schedule, --pp and --microbatches are required (or --regenerate DIR)")
    config = SimConfig(**{f.name: getattr(args, f.name) for f in fields(SimConfig)})  # a flag per field
    try:
        result = simulate(config)
    except ValueError as e:  # includes ScheduleOrderError
        print(f"error: {e}", file=sys.stderr)
        return 2
    outputs = (
        (args.csv, lambda: compute_csv(result)),
        (args.svg, lambda: render_svg(result)),
        (args.trace, lambda: json.dumps(chrome_trace(result))),
    )
    for path, text in outputs:
        if path is not None:
            path.write_text(text(), newline="")
    if args.json:
        print(json.dumps(result.summary()))
    else:
        print(result.title())
        print("peak activations per rank (M):", ", ".join(f"{a:.4g}" for a in result.peak_activations))
        if result.deadlock:
            print("DEADLOCK:", result.deadlock.describe())
    return 1 if result.deadlock else 0
