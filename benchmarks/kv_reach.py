"""The longest sequence that fits, by the memory model, per schedule and K/V context mode.

    python benchmarks/kv_reach.py [--gpu-memory-gib 141] [--gpus 8,16,32,64] [--models gpt-oss,deepseek,llama]

For each model (gpt-oss-120B, DeepSeek-V3 671B, Llama 3 70B; ``--models`` picks some by the short names of
:data:`MODELS`), GPU count, schedule (the planner's sequence schedules, those of
:data:`~torchtitan_seq.plan.CHOICES`, and torch's 1F1B as the baseline) and K/V mode (:data:`MODES`), the
largest sequence length S (a multiple of :data:`STEP` tokens) for which some split of the GPUs fits
``--gpu-memory-gib`` per GPU, as :func:`~torchtitan_seq.simulate.memory.predict_memory` sizes it: pipeline
degree pp (2 up, as the planner searches it; at most a layer a stage) x TP (1 to 8) x FSDP over the rest,
full activation checkpointing (the least memory), N = pp microbatches of one sequence, each schedule's k and
partitions as the planner tries them, no context parallelism (under CP every layer keeps its whole K/V).
The planner's defaults otherwise: bf16 compute under FSDP, fp32 master weights, gradients and Adam's two
states.

The modes: ``kv_context = "reach"`` (the default), ``"full"``, ``"latent"`` (only for a model with MLA,
DeepSeek-V3) and "reach + offload", ``"reach"`` with ``kv_offload`` wherever the planner may propose it
(:func:`~torchtitan_seq.plan.memory_check.may_offload`: a sequence schedule's choices of k > 1). 1F1B has no
KV context: one S, under "reach".

DeepSeek-V3 671B fits at no length on up to 64 GPUs (its weights, gradients and optimizer states alone exceed
141 GiB a GPU), so the default GPU counts show it nowhere; ask for more GPUs for it alone with
``--models deepseek --gpus 128,256``.

Prints one markdown table per model: a row per GPU count and schedule, S under each mode that applies, and
the split that reaches S under "reach" (pp, TP, k, partition).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

from torchtitan_seq.plan import CHOICES
from torchtitan_seq.plan.bounds import cut_lengths
from torchtitan_seq.plan.choices import TP_DEGREES, ScheduleChoice
from torchtitan_seq.plan.job import Cluster, Job
from torchtitan_seq.plan.memory_check import KVOption, may_offload, memory_config
from torchtitan_seq.runtime.reach import KVContextMode
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES
from torchtitan_seq.simulate.flavors import flavor_shape
from torchtitan_seq.simulate.memory import gib, memory_floor, predict_memory

MODELS = {
    "gpt-oss": ("gpt-oss-120B", "gpt_oss:120b"),
    "deepseek": ("DeepSeek-V3 671B", "deepseek_v3:671B"),
    "llama": ("Llama 3 70B", "llama3:70B"),
}
"""Per short name (``--models``), the model's name and flavor."""
SCHEDULES = [*dict.fromkeys(c.schedule for c in CHOICES if c.schedule in SEQUENCE_SCHEDULES), "1F1B"]
"""The planner's sequence schedules, then torch's 1F1B."""
MODES: dict[str, tuple[KVContextMode, bool]] = {
    "reach": ("reach", False),
    "full": ("full", False),
    "latent": ("latent", False),
    "reach + offload": ("reach", True),
}
"""Per column, ``kv_context`` and whether ``kv_offload`` may be on."""
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
    model: str, seq_len: int, gpus: int, budget: float, mode: KVContextMode, offload: bool, tried: list[Split]
) -> Iterator[Split]:
    """The splits of ``tried`` under which ``seq_len`` tokens fit ``budget`` GiB, in order (the memory
    model's floor first, its estimate where the floor fits); ``offload``: with ``kv_offload`` where the
    planner may propose it."""
    cluster = Cluster(gpus, budget)
    for choice, pp, tp in tried:
        job = Job(model, seq_len, pp, kv_context=mode, kv_offload=offload)
        if cut_lengths(job, choice, tp) is None:
            continue
        config = memory_config(job, cluster, choice, pp, tp, "full", 1, KVOption(mode, may_offload(job, choice)))
        if gib(memory_floor(config)) <= budget and gib(predict_memory(config).total) <= budget:
            yield choice, pp, tp


def longest(
    model: str, gpus: int, schedule: str, budget: float, mode: KVContextMode, offload: bool = False
) -> tuple[int, Split | None]:
    """The longest multiple of :data:`STEP` up to :data:`LONGEST` that some split fits, and that split
    (0, None: none fits)."""
    tried = splits(model, gpus, schedule)
    best: Split | None = None

    def fits(steps: int) -> bool:
        # Memory grows with S: a split that does not fit S fits no longer one, so each fit drops those before.
        nonlocal best, tried
        found = next(fitting(model, steps * STEP, gpus, budget, mode, offload, tried), None)
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


def modes(model: str) -> list[str]:
    """The columns of :data:`MODES` that apply to ``model``: "latent" only where its attention is MLA."""
    mla = getattr(flavor_shape(model), "mla", None) is not None
    return [m for m in MODES if m != "latent" or mla]


def _tokens(seq_len: int) -> str:
    return f"{seq_len // 1024}K" if seq_len else "does not fit"


def row(model: str, gpus: int, schedule: str, columns: list[str], budget: float) -> str:
    """A table row: S under each of ``columns`` (1F1B: "reach" alone, it has no KV context; "–" elsewhere)
    and the split that reaches S under "reach"."""
    found = {
        c: longest(model, gpus, schedule, budget, *MODES[c]) for c in columns if schedule != "1F1B" or c == "reach"
    }
    cells = [_tokens(found[c][0]) if c in found else "–" for c in columns]
    split = found["reach"][1]
    where = f"{split[1]}, {split[2]}, {split[0].num_subsequences}, {split[0].partition}" if split else ""
    return f"| {gpus} | {schedule} | {' | '.join(cells)} | {where} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-memory-gib", type=float, default=141.0)
    parser.add_argument(
        "--gpus", default="8,16,32,64", help="comma-separated GPU counts (DeepSeek-V3 671B needs more than 64)"
    )
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    a = parser.parse_args()
    started = time.perf_counter()
    tables = []
    for short in a.models.split(","):
        name, model = MODELS[short]
        columns = modes(model)
        rows = [
            f"### {name}",
            "",
            f"| GPUs | schedule | {' | '.join(columns)} | reach's split: pp, TP, k, partition |",
            "|---|---|" + "---|" * (len(columns) + 1),
        ]
        print("\n".join(rows), flush=True)
        for gpus in (int(g) for g in a.gpus.split(",")):
            for schedule in SCHEDULES:
                rows.append(row(model, gpus, schedule, columns, a.gpu_memory_gib))
                print(rows[-1], flush=True)
        tables.append("\n".join(rows))
    print(f"\n{a.gpu_memory_gib:g} GiB per GPU; {time.perf_counter() - started:.0f} s\n")
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
