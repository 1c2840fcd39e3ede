"""The memory model against the BSIPipe paper's Table 3 and the CPU measurements: writes
benchmarks/memory_model.md.

    python benchmarks/memory_model.py

Predictions are :func:`torchtitan_seq.simulate.memory.predict_memory`'s (bytes by
arithmetic on the schedule's action lists); the measurements are the benchmark's recorded
``peak_activation_bytes`` (``bench.json`` under ``benchmarks/``: the debug model on 2 CPU
ranks, saved tensors as :class:`torchtitan_seq.instrumentation.memory.ActivationMemory` counts them).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from datetime import date
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the checkout's package

from projection import SHAPES  # noqa: E402  (benchmarks/, this script's folder)

from torchtitan_seq.runtime.shape import JobShape  # noqa: E402
from torchtitan_seq.simulate.flavors import flavor_shape  # noqa: E402
from torchtitan_seq.simulate.memory import MemoryConfig, MemoryEstimate, gib, predict_memory  # noqa: E402

HERE = Path(__file__).resolve().parent
OUT = HERE / "memory_model.md"
SEQ_LEN = 20480
MICROBATCHES = 64
K = 4
GPUS = 16
LENGTH_MULTIPLE = 64
"""Of the measured runs (``train_configs/debug_model.toml``), and taken for the paper's settings too."""
# BSIPipe's Table 3: per-device peak memory (GiB) on 16 GPUs at 20K tokens, by (w, tp).
PAPER = {
    "GPT-1.3B": {(16, 1): (49.8, 60.1), (8, 2): (28.3, 31.7), (4, 4): (17.1, 18.4)},
    "LLaMA3-1.3B-like": {(16, 1): (55.8, 67.8), (8, 2): (31.4, 35.5), (4, 4): (19.4, 19.7)},
}
# The CPU measurements: (bench.json, activation checkpointing of its runs).
MEASURED = [
    ("slab/arena/bench.json", "none"),  # the sequence schedules with the code's K/V arenas, first: it wins
    ("all_schedules/bench.json", "none"),
    ("acceptance/bench.json", "none"),
    ("memory/ac_full/bench.json", "full"),
    ("memory/chimera/bench.json", "none"),
    ("memory/chimera_ac_full/bench.json", "full"),
]


def paper_config(model: str, w: int, tp: int, k: int = K, **changes) -> MemoryConfig:
    """BSIPipe on ``GPUS`` GPUs: w pipeline ranks, TP tp, dp = GPUS / (w tp), k subsequences;
    Megatron-style mixed precision (bf16 compute and weights copy, fp32 master weights and
    gradients, Adam)."""
    shape = JobShape.of_model(
        SHAPES[model], SEQ_LEN, k, "compute", length_multiple=LENGTH_MULTIPLE, tp=tp, microbatches=MICROBATCHES
    )
    config = MemoryConfig(
        SHAPES[model],
        shape,
        "BSIPipe",
        pp=w,
        dp_shard=GPUS // (w * tp),
        compute_dtype="bfloat16",
        selective_ac_option="op",
    )
    return replace(config, **changes)


def _range(estimate: MemoryEstimate, buffers: bool = False) -> tuple[float, float]:
    totals = [gib(r.total - (0 if buffers else r.buffers)) for r in estimate.ranks]
    return min(totals), max(totals)


def paper_table() -> tuple[list[str], dict]:
    """The table's rows, and what the paragraph below it says: per setting, the fullest rank's
    distance from the paper's range (0 inside), and the AC and k variants' fullest ranks."""
    findings = {"off": [], "op": [], "full": [], "paper_low": [], "k2": [], "k8": []}
    rows = [
        (
            "| model | (w, tp) | paper | predicted, no AC: ranks min-max | fullest rank off the paper's range "
            "| fullest rank, op-level selective AC | full AC | no AC, k = 2 / 8 | no AC + torch's receive buffers |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    detail = [
        (
            "| model | (w, tp) | rank | parameters | gradients | optimizer | activations | KV context | workspace "
            "| total | receive buffers |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, settings in PAPER.items():
        for (w, tp), (low, high) in settings.items():
            base = predict_memory(paper_config(model, w, tp))
            variants = {
                name: _range(predict_memory(paper_config(model, w, tp, **changes)))[1]
                for name, changes in (
                    ("op", {"activation_checkpoint": "selective"}),
                    ("full", {"activation_checkpoint": "full"}),
                    ("k2", {"k": 2}),
                    ("k8", {"k": 8}),
                )
            }
            lo, hi = _range(base)
            off = hi / low - 1 if hi < low else max(hi / high - 1, 0)
            for name, value in (
                ("off", off),
                ("op", variants["op"]),
                ("full", variants["full"]),
                ("paper_low", low),
                ("k2", variants["k2"]),
                ("k8", variants["k8"]),
            ):
                findings[name].append(value)
            rows.append(
                f"| {model} | ({w}, {tp}) | {low}-{high} | {lo:.1f}-{hi:.1f} | {100 * off:+.0f}% "
                f"| {variants['op']:.1f} "
                f"| {variants['full']:.1f} | {variants['k2']:.1f} / {variants['k8']:.1f} "
                f"| {_range(base, buffers=True)[1]:.1f} |"
            )
            g = base.gib()
            detail.append(
                f"| {model} | ({w}, {tp}) | {base.rank} | {g['parameters']:.2f} | {g['gradients']:.2f} "
                f"| {g['optimizer']:.2f} | {g['activations']:.2f} | {g['kv_context']:.2f} | {g['workspace']:.2f} "
                f"| {g['total'] - g['buffers']:.2f} | {g['buffers']:.2f} |"
            )
    return rows + ["", "The fullest rank without activation checkpointing (GiB, k = 4):", ""] + detail, findings


def cpu_rows() -> list[str]:
    rows = [
        "| schedule | seq | AC | rank 0 measured (MiB) | predicted | error | rank 1 measured | predicted | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    seen = set()
    for name, mode in MEASURED:
        path = HERE / name
        if not path.is_file():
            continue
        for r in json.loads(path.read_text()):
            key = (r["label"], r["seq_len"], mode)
            if r.get("compiled") or key in seen:
                continue
            seen.add(key)
            shape = JobShape.of_model(
                flavor_shape("debugmodel"),
                r["seq_len"],
                r["num_subsequences"],
                r["partition"] or "even",
                length_multiple=LENGTH_MULTIPLE,
                microbatches=r["microbatches"],
            )
            config = MemoryConfig(
                "debugmodel", shape, r["schedule"], pp=r["pp"], device="cpu", activation_checkpoint=mode
            )
            estimate = predict_memory(config)
            cells = []
            for rank, measured in enumerate(r["peak_activation_bytes"]):
                predicted = estimate.ranks[rank].activations
                cells.append(
                    f"{measured / 2**20:.1f} | {predicted / 2**20:.1f} | {100 * (predicted / measured - 1):+.2f}%"
                )
            rows.append(f"| {r['label']} | {r['seq_len']} | {mode} | " + " | ".join(cells) + " |")
    return rows


def main() -> None:
    table, found = paper_table()
    off = found["off"]
    under, over = [-x for x in off if x < 0], [x for x in off if x > 0]
    op_below = sum(v < low for v, low in zip(found["op"], found["paper_low"]))
    full_below = sum(v < low for v, low in zip(found["full"], found["paper_low"]))
    text = [
        "# The memory model: predicted against measured and against BSIPipe's Table 3",
        "",
        f"Generated by `python benchmarks/memory_model.py` on {date.today()}; do not edit.",
        "The model: `torchtitan_seq/simulate/memory/` (`predict_memory`; its modules' docstrings give every term's",
        "formula).",
        "",
        "## CPU: predicted against measured activation peaks",
        "",
        "The benchmark's recorded runs (`bench.json` under `benchmarks/`): the Llama 3 debug model, pp = 2,",
        "4 microbatches of one sequence, float32 on the CPU; measured: the bytes autograd saves for backward",
        "(`torchtitan_seq.instrumentation.memory.ActivationMemory`), the largest over a run's steps; predicted: the "
        "model's",
        '`activations` for the same job (`device = "cpu"`). Under full AC the KV context\'s K/V are not',
        "saved tensors, so they are not in either figure (the model's `kv_context` term holds them).",
        "",
        *cpu_rows(),
        "",
        "## BSIPipe's Table 3: 16 GPUs, 20K tokens",
        "",
        f"BSIPipe on {GPUS} GPUs: w pipeline ranks, tensor parallelism tp (with sequence parallel, as torchtitan",
        f"applies it), data parallelism {GPUS} / (w tp) = 1 in all three settings, so no ZeRO/FSDP sharding;",
        f"{SEQ_LEN} tokens, {MICROBATCHES} microbatches of one sequence, k = {K} units cut by the `compute`",
        "partition; bf16 compute with a bf16 copy of the weights, fp32 master weights and gradients and",
        "Adam's two fp32 states (18 bytes a parameter, Megatron's mixed precision; BSIPipe's mirrored",
        "copies double weights and gradients, not the optimizer's states); CUDA (fused RMSNorm). Models as",
        "`benchmarks/projection.py` shapes them in torchtitan's Llama 3 (SwiGLU MLP, RMSNorm, RoPE): GPT-1.3B",
        "(24 layers, dim 2048, 16 heads, vocab 50257) and LLaMA3-1.3B-like (16 layers, dim 2048, 32 heads,",
        "8 KV heads, MLP 8192, vocab 128256). BSIPipe cuts the model into 2w chunks; at w = 16 that is more",
        "chunks than layers, so each chunk gets an even real-valued share of the layers (embeddings on the",
        "first chunk, the output on the last). Predicted totals (GiB) leave out torch's per-microbatch",
        "receive buffers (last column adds them): they belong to torch's pipeline runtime, not to the",
        "schedule, and the paper's Megatron-based implementation has none. The paper's figures are a range",
        "whose meaning (spread over devices or over runs) is not known here; the predicted range is the",
        "spread over pipeline ranks.",
        "",
        *table,
        "",
        "**Where prediction and paper differ, and why.** Without activation recomputation, at k = 4, the",
        f"fullest rank's prediction lies within {100 * max(map(abs, off)):.0f}% of the paper's range in all "
        "six settings",
        f"({len(off) - len(under) - len(over)} inside, {len(under)} under its low end"
        + (f" by {100 * min(under):.0f}-{100 * max(under):.0f}%" if under else "")
        + f", {len(over)} over its high end"
        + (f" by {100 * min(over):.0f}-{100 * max(over):.0f}%" if over else "")
        + f"); with full recomputation {full_below} of 6 fall below the paper's low end (GPT at (16, 1):",
        f"{found['full'][0]:.1f} against {found['paper_low'][0]} GiB), and with op-level selective recomputation",
        f"{op_below} of 6. So the paper's runs most likely kept all activations, as Seq1F1B and BSIPipe",
        "advertise. The number of units matters as much as anything here (k = 2 / 8 move GPT at (16, 1) to",
        f"{found['k2'][0]:.0f} / {found['k8'][0]:.0f} GiB) and the paper's k is not known here; k = 4 is the",
        "projection's. The gaps that remain have known causes:",
        "",
        "* The model is torchtitan's block, not Megatron's GPT. Its SwiGLU MLP saves four F-wide tensors",
        "  (F = 5632 for GPT-1.3B here) where GPT's GELU MLP saves two 4h-wide ones (Megatron's 34 s b h",
        "  bytes per layer), and under tensor parallelism torchtitan's projections save their all-gathered",
        "  whole-sequence inputs (2 x dim per token and layer, not divided by tp), where Megatron's sequence",
        "  parallelism saves the shard and gathers again in backward. Hence for GPT the prediction runs",
        "  above the paper at (4, 4), where that undivided term weighs most.",
        "* The loss: torchtitan's cross-entropy keeps a float32 log-softmax of the logits, 4 x vocab bytes",
        "  per token, on the ranks holding the output chunk (BSIPipe puts chain A's on rank 0 and chain B's",
        "  on rank w - 1). With LLaMA3's 128K vocabulary that is 0.5 MB a token, more than six layers' worth,",
        "  which is why the LLaMA3 spread over ranks is wide and its fullest rank exceeds the paper at",
        "  w = 16. If Table 3's ranges are spreads over devices, the paper's are far narrower than these",
        "  (embeddings and loss weigh on two ranks here), so it keeps less for the loss or balances the",
        "  chunks around it.",
        "* At w = 16 the 2w = 32 chunks outnumber the layers (24 and 16); the paper must place layers",
        "  differently (how is not public), and the even real-valued share here is an approximation.",
        "* The workspace term (logits and their float32 copy and gradient, the layers' input gradients) is",
        "  an upper-bound estimate added to the held peak, and gradients are counted whole at the",
        "  activation peak; the CUDA-side terms (fused RMSNorm, cuDNN's log-sum-exp, op-level selective",
        "  AC's cache) are derived from the code, not measured here.",
        "* The paper's figure is what the device's allocator reported; NCCL's and the CUDA context's",
        "  memory, communication buffers and the caching allocator's fragmentation come on top of the bytes",
        "  modelled here (typically a few GiB), which would explain a prediction under the paper's range.",
        "* torch's pipeline stage allocates a receive buffer per microbatch and stage for activations and",
        "  for gradients (64 microbatches x 20480 tokens x 2048 x 2 bytes / tp each), held for the whole",
        "  step: 5-15 GiB here. A run of this project holds them on top of the schedule's memory.",
        "",
    ]
    OUT.write_text("\n".join(text))
    print(OUT)


if __name__ == "__main__":
    main()
