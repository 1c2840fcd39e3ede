"""Packed documents: what block-causal attention saves in the KV context and in attention work.

Runs rank 0's share of a Seq1F1B step in one process: rank 0's action list of
Seq1F1B (``--pp`` ranks, ``--microbatches`` N, ``--subsequences`` k, even cut),
the whole debug model as its stage, each unit's backward driven by a stand-in
loss (rank 1's gradient does not change what attention reads or keeps). The
batch is N sequences of the shipped packed corpus (``seqpp_packed``) packed by
torchtitan's own text dataset. The same step runs with causal attention and
with block-causal attention (the documents of the batch), each without and with
full activation checkpointing (torchtitan's per-block checkpoint wrapper), and
reports per step:

* KV-context bytes: the peak and the mean, over the step's actions, of the K/V
  the stage's context keeps referenced (:meth:`~torchtitan_seq.runtime.kv_context.KVContext.held_bytes`);
* saved activations: the peak bytes autograd keeps for backward
  (:class:`~torchtitan_seq.instrumentation.memory.ActivationMemory`), and the largest of both together
  at the end of an action, each storage once (without checkpointing autograd saves the K/V the context
  refers to; under it the context's K/V are not saved activations);
* attention FLOPs: each kernel call's scored (query, key) pairs times
  4 heads x head_dim, and 2.5 times that in backward (flash backward recomputes
  the scores); the units' prefix calls apart.

Usage, from the source checkout::

    python benchmarks/documents.py [--seq-len 4096] [--out benchmarks/documents]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
from pathlib import Path

import torch

from torchtitan_seq.attention import bind_kv_context
from torchtitan_seq.attention.kernels import CpuSdpaKernel
from torchtitan_seq.instrumentation.memory import ActivationMemory
from torchtitan_seq.runtime.documents import Documents, document_ids
from torchtitan_seq.runtime.kv_context import KVContext, Unit
from torchtitan_seq.runtime.partition import partition_sequence
from torchtitan_seq.schedules import ScheduleShape, seq1f1b_actions
from torchtitan_seq.schedules.ordering import F, stage_passes


class CountingKernel(CpuSdpaKernel):
    """The CPU kernel, counting the attention FLOPs of its calls."""

    def __init__(self) -> None:
        self.flops = {"diagonal": 0.0, "prefix": 0.0}

    def _count(self, q: torch.Tensor, k: torch.Tensor, causal: bool, factor: float) -> None:
        b, h, lq, d = q.shape
        pairs = lq * (lq + 1) / 2 if causal else lq * k.shape[2]
        self.flops["diagonal" if causal else "prefix"] += factor * 4 * b * h * d * pairs

    def forward(self, q, k, v, causal, scale):
        self._count(q, k, causal, 1.0)
        return super().forward(q, k, v, causal, scale)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        self._count(q, k, causal, 2.5)
        return super().backward(dout, q, k, v, out, lse, causal, scale)


def packed_batch(seq_len: int, n: int) -> tuple[torch.Tensor, int]:
    """N sequences of the packed corpus as torchtitan's text dataset packs them, and the EOS id."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    from torchtitan_seq.titan.data import PACKED_DATASET_NAME, TOKENIZER_DIR
    from torchtitan_seq.titan.v022.registration import register

    register()
    tokenizer = HuggingFaceTokenizer(str(TOKENIZER_DIR))
    data = iter(HuggingFaceTextDataset(PACKED_DATASET_NAME, None, tokenizer, seq_len=seq_len))
    return torch.stack([next(data)[0]["input"] for _ in range(n)]), tokenizer.eos_id


def run_step(tokens: torch.Tensor, documents: list[Documents] | None, ac: bool, args) -> dict:
    """Rank 0's actions of one Seq1F1B step; the figures of the module docstring."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from torchtitan_seq.titan.v022.models.llama3_seq import SeqTransformer, seq_llama3_flavors

    model_args = dataclasses.replace(seq_llama3_flavors["debugmodel_flex_attn"], max_seq_len=args.seq_len)
    torch.manual_seed(0)
    model = SeqTransformer(model_args)
    with torch.no_grad():
        model.init_weights()
    if ac:
        for name, layer in model.layers.named_children():
            model.layers.register_module(name, checkpoint_wrapper(layer, preserve_rng_state=False))
    lengths = partition_sequence(args.seq_len, args.subsequences, "even")
    actions = seq1f1b_actions(ScheduleShape(args.pp, args.microbatches, args.subsequences))[0]
    context, kernel = KVContext(lengths), CountingKernel()
    context.expect(stage_passes(actions, 0, args.subsequences)[1])  # as the schedule tells its stages
    bind_kv_context(model, context, kernel)
    context.documents = documents
    offsets = [sum(lengths[:j]) for j in range(len(lengths))]
    memory = ActivationMemory()
    outputs, kv_held, total_peak = {}, [], 0
    with memory.track():
        for action in actions:
            m, j = divmod(action.microbatch_index, args.subsequences)
            unit = Unit(m, j, offsets[j], lengths[j], args.subsequences)
            if action.computation_type == F:
                with context.running(unit):
                    outputs[unit] = model(tokens[m : m + 1, offsets[j] : offsets[j] + lengths[j]])
            else:
                with context.backward(unit):
                    outputs.pop(unit).float().square().mean().backward()
            held = context.held_storages()
            kv_held.append(sum(held.values()))
            total_peak = max(total_peak, memory.current + sum(n for p, n in held.items() if not memory.saves(p)))
    return {
        "kv_context_peak_bytes": max(kv_held),
        "kv_context_mean_bytes": statistics.mean(kv_held),
        "activation_peak_bytes": memory.peak,
        "activations_plus_kv_peak_bytes": total_peak,
        "attention_gflops": {part: f / 1e9 for part, f in kernel.flops.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--subsequences", type=int, default=4)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/documents"))
    args = ap.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    torch.set_num_threads(1)
    tokens, eos = packed_batch(args.seq_len, args.microbatches)
    ids = document_ids(tokens, eos)
    documents = [Documents.from_ids(ids[m : m + 1]) for m in range(args.microbatches)]
    doc_lengths = [b - a for d in documents for a, b in zip(d.starts[0], d.starts[0][1:] + (args.seq_len,))]
    results = {
        "seq_len": args.seq_len,
        "microbatches": args.microbatches,
        "subsequences": args.subsequences,
        "pp": args.pp,
        "documents": len(doc_lengths),
        "document_length_mean": statistics.mean(doc_lengths),
        "document_length_median": statistics.median(doc_lengths),
        "runs": {},
    }
    for ac in (False, True):
        for mask, docs in (("causal", None), ("block_causal", documents)):
            name = f"{mask}{'-ac_full' if ac else ''}"
            results["runs"][name] = run_step(tokens, docs, ac, args)
            print(name, json.dumps(results["runs"][name]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "documents.json").write_text(json.dumps(results, indent=1))
    (args.out / "documents.md").write_text(table(results))
    print(table(results))


def table(results: dict) -> str:
    runs = results["runs"]
    mib = 2**20
    lines = [
        f"Rank 0 of Seq1F1B, pp={results['pp']}, N={results['microbatches']}, k={results['subsequences']} even, "
        f"seq {results['seq_len']}, debug model; {results['documents']} documents "
        f"(mean {results['document_length_mean']:.0f}, median {results['document_length_median']:.0f} tokens).",
        "",
        "| run | KV context peak (MiB) | KV context mean (MiB) | saved activations peak (MiB) "
        "| activations + KV at action ends, peak (MiB) | attention GFLOP diagonal | attention GFLOP prefix "
        "| attention GFLOP total |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        g = r["attention_gflops"]
        lines.append(
            f"| {name} | {r['kv_context_peak_bytes'] / mib:.2f} | {r['kv_context_mean_bytes'] / mib:.2f} "
            f"| {r['activation_peak_bytes'] / mib:.2f} "
            f"| {r['activations_plus_kv_peak_bytes'] / mib:.2f} | {g['diagonal']:.3f} | {g['prefix']:.3f} "
            f"| {g['diagonal'] + g['prefix']:.3f} |"
        )
    for ac in ("", "-ac_full"):
        c, b = runs[f"causal{ac}"], runs[f"block_causal{ac}"]
        flops = [sum(r["attention_gflops"].values()) for r in (c, b)]
        lines.append("")
        lines.append(
            f"block-causal / causal{ac or ' (no AC)'}: KV context peak "
            f"{b['kv_context_peak_bytes'] / c['kv_context_peak_bytes']:.3f}, mean "
            f"{b['kv_context_mean_bytes'] / c['kv_context_mean_bytes']:.3f}, activations + KV peak "
            f"{b['activations_plus_kv_peak_bytes'] / c['activations_plus_kv_peak_bytes']:.3f}, "
            f"attention FLOPs {flops[1] / flops[0]:.3f}"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
