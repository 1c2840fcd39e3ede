"""The command line, ``python -m torchtitan_seq.simulate``.

It exits with 1 on a deadlock and 2 on a schedule or shape it rejects (an
ordering violation, an unsupported N, an unknown name).

Communication (:mod:`.network`): links are free unless a bandwidth or latency
is given, e.g. BSIPipe on 2 nodes of 8 GPUs with NVLink and one InfiniBand
NIC per GPU, the GPUs achieving 150 TFLOP/s::

    python -m torchtitan_seq.simulate --schedule BSIPipe --pp 16 --microbatches 64 \
        --subsequences 4 --cost transformer --flavor 8B --seq-len 20480 \
        --intra-node-bandwidth 200e9 --intra-node-latency 5e-6 \
        --inter-node-bandwidth 25e9 --inter-node-latency 1e-5 --gpus-per-node 8 \
        --flops-per-gpu 150e12 --bidirectional-placement linear
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import fields
from pathlib import Path

from torchtitan_seq.instrumentation.render import chrome_trace, compute_csv, render_svg
from torchtitan_seq.runtime.partition import PARTITIONS
from torchtitan_seq.runtime.shape import LENGTH_MULTIPLE
from torchtitan_seq.schedules import PLACEMENTS, SEQUENCE_SCHEDULES, TORCH_SCHEDULES
from torchtitan_seq.simulate.build import SimConfig
from torchtitan_seq.simulate.engine import simulate
from torchtitan_seq.simulate.network import Link, Network
from torchtitan_seq.simulate.regenerate import regenerate

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
    ap.add_argument(
        "--flavor",
        default="debugmodel",
        help="model flavor (transformer cost, compute partition): a Llama 3 flavor, or FAMILY:FLAVOR of any family "
        "(qwen3:235B-A22B, deepseek_v3:671B, gpt_oss:120b, ...)",
    )
    ap.add_argument("--seq-len", type=int, default=2048, help="S, tokens per sequence")
    ap.add_argument("--partition", default="even", choices=PARTITIONS)
    ap.add_argument(
        "--length-multiple",
        type=int,
        default=LENGTH_MULTIPLE,
        help="every length a multiple of this and of --tensor-parallel (default %(default)s)",
    )
    ap.add_argument(
        "--document-length",
        type=float,
        default=0.0,
        help="packed documents: expected tokens per document (block-causal attention); 0: causal",
    )
    ap.add_argument(
        "--recompute",
        type=float,
        default=0.0,
        help="forwards recomputed per backward (activation checkpointing: full 1, selective 1/n)",
    )
    ap.add_argument(
        "--unit-overhead",
        type=float,
        default=0.0,
        help="'transformer' cost: fixed seconds per unit (forward + backward) and layer on top of "
        "its FLOPs (needs --flops-per-gpu; the planner's H200 default: 1.393e-3)",
    )
    ap.add_argument(
        "--comm-latency", type=float, default=0.0, help="SEND to usable data, in time units, on top of the links'"
    )
    ap.add_argument(
        "--no-torch-lowering",
        dest="torch_lowering",
        action="store_false",
        help="time the compute-only lists with their sends (the same timeline, faster)",
    )
    ap.add_argument(
        "--bidirectional-placement",
        default="paired",
        choices=PLACEMENTS,
        help="BSIPipe and Chimera: mirrored pairs on neighbouring ranks, or position q on rank q",
    )
    _add_network_arguments(ap)
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    ap.add_argument("--csv", type=Path, help="write the compute-only action table (torch's CSV format)")
    ap.add_argument("--svg", type=Path, help="write the timeline as SVG")
    ap.add_argument("--trace", type=Path, help="write a Chrome/Perfetto trace")
    ap.add_argument("--regenerate", type=Path, metavar="DIR", help="write the standard set into DIR and exit")
    return ap


def _add_network_arguments(ap: argparse.ArgumentParser) -> None:
    """The links and the :class:`~torchtitan_seq.simulate.network.Network` fields, as options."""
    links = ap.add_argument_group("network (free links unless given; see torchtitan_seq.simulate.network)")
    for where in ("intra", "inter"):
        links.add_argument(
            f"--{where}-node-bandwidth",
            type=float,
            default=math.inf,
            help=f"{where}-node link, bytes/s per GPU and direction (e.g. 200e9, 25e9)",
        )
        links.add_argument(f"--{where}-node-latency", type=float, default=0.0, help=f"{where}-node link, seconds")
    default = Network()
    for name, kind, text in (
        ("gpus_per_node", int, "GPUs per node"),
        ("gpus_per_rank", int, "GPUs per pipeline rank: tp x dp x cp"),
        ("tensor_parallel", int, "TP degree: compute and transfers split this many ways"),
        ("context_parallel", int, "CP degree: compute and transfers split this many ways, plus K/V collectives"),
        ("microbatch_size", int, "sequences per microbatch"),
        ("activation_bytes", int, "bytes per activation element sent"),
        ("parameter_bytes", int, "bytes per parameter in the copies' all-reduces"),
        ("flops_per_gpu", float, "achieved FLOP/s per GPU, converting the cost model's unit into seconds"),
    ):
        links.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=getattr(default, name),
            help=f"{text} (default {getattr(default, name)})",
        )


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
    try:
        network = Network(
            intra_node=Link(args.intra_node_bandwidth, args.intra_node_latency),
            inter_node=Link(args.inter_node_bandwidth, args.inter_node_latency),
            **{f.name: getattr(args, f.name) for f in fields(Network) if f.name not in ("intra_node", "inter_node")},
        )
        # A flag per field.
        config = SimConfig(
            network=network, **{f.name: getattr(args, f.name) for f in fields(SimConfig) if f.name != "network"}
        )
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
        if result.copies_synced:
            print("parameter copies in sync per rank at:", ", ".join(f"{t:.4g}" for t in result.copies_synced))
        if result.deadlock:
            print("DEADLOCK:", result.deadlock.describe())
    return 1 if result.deadlock else 0
