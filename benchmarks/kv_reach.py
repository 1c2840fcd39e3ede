"""The longest sequence that fits, by the memory model, under ``kv_context = "reach"`` and ``"full"``.

    python benchmarks/kv_reach.py [--gpu-memory-gib 141] [--gpus 8,16,32,64]

For each model (gpt-oss-120B, DeepSeek-V3 671B, Llama 3 70B), GPU count and schedule (Seq1F1B, 1F1B),
the largest sequence length S (a multiple of :data:`STEP` tokens) for which some split of the GPUs fits
``--gpu-memory-gib`` per GPU, as :func:`~torchtitan_seq.simulate.memory.predict_memory` sizes it: pipeline
degree pp (2 up, as the planner searches it; at most a layer a stage) x TP (1 to 8) x FSDP over the rest,
full activation checkpointing (the least memory), N = pp microbatches of one sequence, Seq1F1B's k and
partitions as the planner tries them (:data:`~torchtitan_seq.plan.CHOICES`), no context parallelism (under
CP every layer keeps its whole K/V). The planner's defaults otherwise: bf16 compute under FSDP, fp32
master weights, gradients and Adam's two states. 1F1B has no KV context: its S is the same in either mode.

Prints a markdown table: per model and GPU count, S under each schedule and mode, and the split that
reaches Seq1F1B's S under "reach" (pp, TP, k, partition).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

from torchtitan_seq.plan import CHOICES
from torchtitan_seq.plan.bounds import cut_lengths
from torchtitan_seq.plan.choices import TP_DEGREES, ScheduleChoice
from torchtitan_seq.plan.job import Cluster, Job
from torchtitan_seq.plan.memory_check import memory_config
from torchtitan_seq.runtime.reach import KVContextMode
from torchtitan_seq.simulate.flavors import flavor_shape
from torchtitan_seq.simulate.memory import gib, memory_floor, predict_memory

MODELS = {"gpt-oss-120B": "gpt_oss:120b", "DeepSeek-V3 671B": "deepseek_v3:671B", "Llama 3 70B": "llama3:70B"}
STEP = 8192
"""Sequence lengths searched: multiples of it."""
LONGEST = 2**24
"""The longest sequence searched."""

Split = tuple[ScheduleChoice, int, int]
"""(choice, pp, tp)."""


def splits(model: str, gpus: int, schedule: str) -> list[Split]:
    """The splits of ``gpus`` GPUs tried for ``schedule``, fewest pipeline ranks first."""
    layers = flavor_shape(model).n_layers
    choices = [c for c in CHOICES if c.schedule == schedule]
    return [
        (choice, pp, tp)
        for pp in (p for p in range(2, gpus + 1) if gpus % p == 0 and p <= layers)
        for tp in TP_DEGREES
        if gpus % (pp * tp) == 0
        for choice in choices
    ]


def fitting(
    model: str, seq_len: int, gpus: int, budget: float, mode: KVContextMode, tried: list[Split]
) -> Iterator[Split]:
    """The splits of ``tried`` under which ``seq_len`` tokens fit ``budget`` GiB, in order (the memory
    model's floor first, its estimate where the floor fits)."""
    cluster = Cluster(gpus, budget)
    for choice, pp, tp in tried:
        job = Job(model, seq_len, pp, kv_context=mode)
        if cut_lengths(job, choice, tp) is None:
            continue
        config = memory_config(job, cluster, choice, pp, tp, "full", 1)
        if gib(memory_floor(config)) <= budget and gib(predict_memory(config).total) <= budget:
            yield choice, pp, tp


def longest(model: str, gpus: int, schedule: str, budget: float, mode: KVContextMode) -> tuple[int, Split | None]:
    """The longest multiple of :data:`STEP` up to :data:`LONGEST` that some split fits, and that split
    (0, None: none fits)."""
    tried = splits(model, gpus, schedule)
    best: Split | None = None

    def fits(steps: int) -> bool:
        # Memory grows with S: a split that does not fit S fits no longer one, so each fit drops those before.
        nonlocal best, tried
        found = next(fitting(model, steps * STEP, gpus, budget, mode, tried), None)
        if found is not None:
            best, tried = found, tried[tried.index(found) :]
        return found is not None

    low, high = 0, 1  # in STEPs: low fits (or is 0), high is to be tried, then does not fit
    while high <= LONGEST // STEP and fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low * STEP, best


def _tokens(seq_len: int) -> str:
    return f"{seq_len // 1024}K" if seq_len else "does not fit"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-memory-gib", type=float, default=141.0)
    parser.add_argument("--gpus", default="8,16,32,64", help="comma-separated GPU counts")
    a = parser.parse_args()
    started = time.perf_counter()
    rows = [
        "| model | GPUs | Seq1F1B, reach | Seq1F1B, full | reach / full | 1F1B (either) "
        "| Seq1F1B reach's split: pp, TP, k, partition |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, model in MODELS.items():
        for gpus in (int(g) for g in a.gpus.split(",")):
            reach, split = longest(model, gpus, "Seq1F1B", a.gpu_memory_gib, "reach")
            full, _ = longest(model, gpus, "Seq1F1B", a.gpu_memory_gib, "full")
            plain, _ = longest(model, gpus, "1F1B", a.gpu_memory_gib, "reach")
            ratio = f"{reach / full:.2f}" if full else ""
            where = f"{split[1]}, {split[2]}, {split[0].num_subsequences}, {split[0].partition}" if split else ""
            rows.append(
                f"| {name} | {gpus} | {_tokens(reach)} | {_tokens(full)} | {ratio} | {_tokens(plain)} | {where} |"
            )
            print(rows[-1], flush=True)
    print(f"\n{a.gpu_memory_gib:g} GiB per GPU; {time.perf_counter() - started:.0f} s\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
