"""Choosing a configuration: the best schedule and settings for a model, a cluster and a memory budget.

    python -m torchtitan_seq.plan --model qwen3:235B-A22B --seq-len 65536 --gpus 256 --gpu-memory-gib 141 \\
        --local-batch-size 16 [--tp 8] [--gpus-per-node 8] [--cost FILE] [--processes 4] [--json]

``--model FAMILY:FLAVOR`` names a flavor of any family by its torchtitan model name (``llama3``, ``qwen3``,
``deepseek_v3``, ``llama4``, ``gpt_oss``); ``--flavor 8B`` is ``--model llama3:8B``.

The planner's command line: the search's (:func:`~torchtitan_seq.plan.search.plan`) plans as a
markdown table with the best as ``./run_train.sh`` overrides, TOML (torchtitan 0.2.2) and a config function
(torchtitan 0.3), or every plan and the
overrides as one JSON object (``--json``); a setting the search refuses is an error, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from torchtitan_seq.plan.job import Cluster, Job
from torchtitan_seq.plan.record import Plan
from torchtitan_seq.plan.search import plan
from torchtitan_seq.runtime.shape import LENGTH_MULTIPLE
from torchtitan_seq.simulate.flavors import model_flavor
from torchtitan_seq.simulate.network import Link


def plan_table(plans: list[Plan]) -> str:
    head = "| # | schedule | pp | tp | cp | dp_shard | k | partition | v | AC | tokens/s | peak GiB | bubble | fits |"
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, p in enumerate(plans, 1):
        kv = (" +kv_offload" if p.kv_offload else "") + (" +latent" if p.kv_context == "latent" else "")
        rows.append(
            f"| {i} | {p.schedule}{kv} | {p.pp} | {p.tp} | {p.cp} | {p.dp_shard} | "
            f"{p.num_subsequences} | {p.partition} | "
            f"{p.stages_per_rank} | {p.activation_checkpoint} | {p.tokens_per_s:,.0f} | {p.peak_memory_gib:.1f} | "
            f"{p.bubble_ratio:.3f} | {'yes' if p.fits else 'no'} |"
        )
    return "\n".join(rows)


def command_line() -> argparse.ArgumentParser:
    """The command's arguments."""
    parser = argparse.ArgumentParser(prog="python -m torchtitan_seq.plan", description=__doc__.split("\n\n")[0])
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument(
        "--model",
        help="FAMILY:FLAVOR, a torchtitan model name and one of its flavors, e.g. qwen3:235B-A22B, deepseek_v3:671B, "
        "gpt_oss:120b, llama4:17bx128e, llama3:70B",
    )
    model.add_argument("--flavor", help="a llama3_seq flavor, e.g. 8B, 70B, debugmodel (--model llama3:FLAVOR)")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--gpu-memory-gib", type=float, required=True)
    parser.add_argument(
        "--local-batch-size",
        type=int,
        required=True,
        help="sequences per data-parallel rank and step (one per microbatch)",
    )
    parser.add_argument("--tp", type=int, help="fix the TP degree (default: search 1, 2, 4, 8)")
    parser.add_argument("--cp", type=int, help="fix the CP degree of sequence schedules (default: search 1, 2, 4, 8)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument(
        "--length-multiple",
        type=int,
        default=LENGTH_MULTIPLE,
        help="sequence_pipeline.length_multiple: every subsequence length a multiple of it and of "
        "the TP degree (default %(default)s)",
    )
    parser.add_argument(
        "--tflops",
        type=float,
        default=Cluster.flops_per_gpu / 1e12,
        help="achieved TFLOP/s per GPU of the cost model (default %(default)g)",
    )
    parser.add_argument(
        "--unit-overhead-ms",
        type=float,
        default=Cluster.unit_overhead_s * 1e3,
        help="fixed ms per unit (forward + backward) and layer on top of the cost model "
        "(default %(default)g: measured on an H200)",
    )
    parser.add_argument(
        "--cost",
        type=Path,
        action="append",
        default=[],
        help="a calibration file (benchmarks/bench.py --calibrate), repeatable, or a folder of them",
    )
    parser.add_argument(
        "--kv-context",
        choices=("reach", "full", "latent"),
        default="reach",
        help="sequence_pipeline.kv_context: what windowed or chunked layers keep of earlier units, what later "
        "units read or all; 'latent': MLA's latent, proposed where it alone fits (default %(default)s)",
    )
    parser.add_argument("--no-latent", action="store_true", help="never propose kv_context = 'latent'")
    parser.add_argument(
        "--kv-offload",
        action="store_true",
        help="propose sequence_pipeline.kv_offload where a configuration fits only with it (the K/V context "
        "copied to host memory while unread), its copies timed over --host-link-gbps",
    )
    parser.add_argument(
        "--host-link-gbps",
        type=float,
        default=Cluster.host_link.bandwidth / 1e9,
        help="GB/s per GPU and direction between a GPU and host memory (default %(default)g: PCIe 5.0 x16)",
    )
    parser.add_argument("--top", type=int, default=10, help="rows of the table (default %(default)s)")
    parser.add_argument(
        "--processes",
        type=int,
        default=4,
        help="search in up to this many processes, one per CPU at most; the same plans (default %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object: plans and overrides")
    return parser


def main(argv: list[str] | None = None) -> int:
    a = command_line().parse_args(argv)
    costs = tuple(f for path in a.cost for f in (sorted(path.glob("cost_*.json")) if path.is_dir() else [path]))
    try:
        flavor = a.flavor or model_flavor(a.model)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    job = Job(flavor, a.seq_len, a.local_batch_size, a.tp, costs, a.length_multiple, a.cp, a.kv_context)
    job = replace(job, kv_offload=a.kv_offload, latent=not a.no_latent)
    cluster = Cluster(
        a.gpus,
        a.gpu_memory_gib,
        a.gpus_per_node,
        a.tflops * 1e12,
        unit_overhead_s=a.unit_overhead_ms / 1e3,
        host_link=Link(a.host_link_gbps * 1e9, Cluster.host_link.latency),
    )
    try:
        plans = plan(job, cluster, a.top, a.processes)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    best = plans[0]
    overrides = best.overrides(job.flavor, job.seq_len, job.local_batch_size)
    if a.json:
        print(json.dumps({"plans": [asdict(p) for p in plans], "overrides": overrides}, indent=1))
        return 0
    print(
        f"{job.flavor}, seq {job.seq_len}, {cluster.gpus} GPUs of {cluster.gpu_memory_gib:g} GiB, "
        f"local batch {job.local_batch_size}; "
        + ("measured costs\n" if costs else f"transformer-model costs, {a.unit_overhead_ms:g} ms per unit and layer\n")
    )
    print(plan_table(plans))
    print(f"\nBest, as ./run_train.sh overrides:\n  ./run_train.sh {overrides}\n")
    print("As TOML (torchtitan 0.2.2):\n\n" + best.toml(job.flavor, job.seq_len, job.local_batch_size))
    print(
        "\nAs a config function (torchtitan 0.3: save it as plan_job.py, then TORCHTITAN=0.3 MODULE=plan_job "
        "CONFIG=plan ./run_train.sh):\n\n" + best.config_function(job.flavor, job.seq_len, job.local_batch_size)
    )
    return 0
