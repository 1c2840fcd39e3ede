"""The prepared GPU check: what only a GPU can show about unit attention and the KV context.

On one CUDA device, in a few minutes: (1) unit attention (``SequenceAttention`` through a
``KVContext``, units forward in order and backward last unit first, as a pipeline stage
runs them) with ``CudaSdpaKernel``, ``CudnnSdpaKernel`` and, where flash_attn imports,
``FlashAttnKernel``, causal and block-causal (packed documents), for each attention kind of the
model families (full; a sliding window; attention chunks; sinks with values narrower than the
keys, :data:`KINDS`), one microbatch and, for each cut into units, four sharing arenas (every other
slab descending), against whole-sequence attention in float64 with the same mask: output and dq,
dk, dv (and the sinks' gradient) as max |error| / max |reference|; (2) the KV context's overhead
on a 1B-class Llama 3 stack (4 layers, dim 2048, 16 heads, 8 KV heads, bf16) at 8K-64K tokens:
forward+backward time (CUDA events, median after warm-up) and peak memory of k units against
torchtitan's own Llama 3 on the whole sequence. Goal: under 5% at 32K. Eager only; (3) a real
sequence-schedule step on the one device, two stages of one pipeline on one rank, against the whole-sequence loss and
gradients (:mod:`gpu_pipeline`); (4) the trainer end to end under torchrun with one process,
at 8K tokens (:mod:`gpu_train`); (5) the K/V offload (``kv_offload``): one stage of attention layers in
Seq1F1B's first-rank order at p = 8, bit for bit the same with offload as without, the K/V it holds, and the
share of the copies the compute hides (:mod:`gpu_kv_offload`). ``benchmarks/gpu_check.sh`` runs it with what the GPU
machine lacks installed from prepared wheels.

Writes into ``--out``: ``gpu_check.json`` (every figure, versions, date; rewritten after
each part, so a run cut short keeps what it measured) and per run a cost file of
``torchtitan_seq.simulate --cost`` (per-unit F and B seconds, as ``bench.py --calibrate``
writes them). ``--device cpu --tiny`` is the dry run: the same code at toy sizes in
seconds (tests/unit/test_gpu_check.py), so the script keeps working between GPU runs.
Exit status: 0 when every attention case, the sequence step and the training run pass, 1
when one does not (the figures are written anyway), 2 when the run cannot start (no CUDA
device, an option not supported yet).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_kv_offload import FULL_OFFLOAD, TINY_OFFLOAD, check_kv_offload
from gpu_pipeline import FULL_STEP, TINY_STEP, check_sequence_step
from gpu_train import check_training

from torchtitan_seq.attention import SequenceAttention
from torchtitan_seq.attention.kernels import (
    AttentionKernel,
    CpuSdpaKernel,
    CudaSdpaKernel,
    CudnnSdpaKernel,
    FlashAttnKernel,
    select_kernel,
)
from torchtitan_seq.plan import H200_UNIT_OVERHEAD_S
from torchtitan_seq.runtime.documents import Documents, document_mask
from torchtitan_seq.runtime.kv_context import KVContext, Unit
from torchtitan_seq.runtime.partition import partition_sequence
from torchtitan_seq.runtime.reach import Reach
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, ScheduleShape
from torchtitan_seq.schedules.ordering import stage_passes
from torchtitan_seq.simulate.costs import gpu_fixed_cost_per_layer
from torchtitan_seq.titan import cpu_compat

FP32_TOL = 1e-5
# Low precision: the kernel alone on the whole sequence must be this close to the
# float64 reference; cut into units, at most twice as far plus one epsilon of the dtype
# (units sum their blocks' dq, dk, dv in the dtype, a rounding per block). A wrong
# merge or a lost gradient block is off by far more.
LOW_PRECISION_TOL = 5e-2
GOAL_SEQ_LEN, GOAL_OVERHEAD = 32768, 0.05
# fp16 as well as bf16: with 8x bf16's precision it is the sharpest check the CUDA
# kernels allow (a 1% error in one gradient block fails it; it passes in bf16).
ATTN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# torch's CUDA flash kernel and flash-attn take fp16/bf16 only.
HALF_ONLY_KERNELS = ("CudaSdpaKernel", "CudnnSdpaKernel", "FlashAttnKernel")


def _packed_documents(seq_len: int) -> torch.Tensor:
    """(1, seq_len) document ids: one document ending at a quarter (a boundary of 4 even
    units), one spanning three units, a short one, one running to the end."""
    ends = [round(f * seq_len) for f in (0.171, 0.25, 0.518, 0.527, 0.894)]
    ids = torch.zeros(1, seq_len, dtype=torch.int32)
    for end in ends:
        ids[0, end:] += 1
    return ids


# Document ids of the reference and the units, by mask name; None: causal.
MASKS: dict[str, Callable[[int], torch.Tensor | None]] = {
    "causal": lambda seq_len: None,
    "block_causal": _packed_documents,
}


@dataclass(frozen=True)
class Kind:
    """A kind of attention layer the check runs: a sliding window and attention chunks (sizes as
    fractions of the sequence, so that they cross unit boundaries), sinks (gpt-oss's) and values
    narrower than queries and keys (MLA's 128 of 192)."""

    window: float | None = None
    chunk: float | None = None
    sinks: bool = False
    value_width: float = 1.0

    def reach(self, seq_len: int) -> Reach:
        """The layer's reach at ``seq_len``: odd sizes, which no cut's boundaries match."""
        size = lambda f: None if f is None else int(f * seq_len) | 1  # noqa: E731
        return Reach(size(self.window), size(self.chunk))


KINDS: dict[str, Kind] = {
    "full": Kind(),
    "window": Kind(window=0.23),
    "chunk": Kind(chunk=0.37),
    "sinks_narrow_values": Kind(window=0.23, sinks=True, value_width=2 / 3),
}
"""The attention kinds of the model families, by name."""


@dataclass(frozen=True)
class Sizes:
    """What one run measures: :data:`FULL` on a GPU, :data:`TINY` for the dry run."""

    attn_shape: tuple[int, int, int, int, int]  # batch, q heads, kv heads, seq, head dim
    attn_cuts: tuple[tuple[int, ...], ...]  # unit lengths; the first, one unit, is the kernel alone
    model: dict  # torchtitan TransformerModelArgs fields
    seq_lens: tuple[int, ...]
    ks: tuple[int, ...]
    dtype: torch.dtype
    warmup: int
    repeats: int


FULL = Sizes(
    attn_shape=(1, 16, 8, 4096, 128),
    # odd lengths too: kernels pad partial tiles, a classic place for bugs
    attn_cuts=((4096,), (1024,) * 4, (1500, 1200, 900, 496)),
    model=dict(
        dim=2048,
        n_layers=4,
        n_heads=16,
        n_kv_heads=8,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_theta=500000,
        vocab_size=2048,
    ),
    seq_lens=(8192, 16384, 32768, 65536),
    ks=(1, 2, 4, 8),
    dtype=torch.bfloat16,
    warmup=2,
    repeats=5,
)
TINY = Sizes(
    attn_shape=(1, 4, 2, 96, 16),
    attn_cuts=((96,), (24,) * 4, (40, 30, 16, 10)),
    model=dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16, vocab_size=256),
    seq_lens=(128, 256),
    ks=(1, 2, 4),
    dtype=torch.float32,
    warmup=1,
    repeats=2,
)


def _units(lengths: list[int] | tuple[int, ...]) -> list[Unit]:
    offsets = [sum(lengths[:j]) for j in range(len(lengths))]
    return [Unit(0, j, offsets[j], n, len(lengths)) for j, n in enumerate(lengths)]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------
# 1. Attention exactness


def _reference(q, k, v, dout, ids: torch.Tensor | None, reach: Reach, sinks) -> dict[str, torch.Tensor]:
    """Whole-sequence attention in float64 with an explicit mask (causal or document, within the window
    and the chunk), each head's sink an extra logit of value zero, and its gradients."""
    s = q.shape[2]
    mask = torch.ones(s, s, dtype=torch.bool).tril() if ids is None else document_mask(ids)[0, 0]
    distance = torch.arange(s).unsqueeze(1) - torch.arange(s)
    if reach.window is not None:
        mask &= distance < reach.window
    if reach.chunk is not None:
        mask &= torch.arange(s).unsqueeze(1) // reach.chunk == torch.arange(s) // reach.chunk
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks) if t is not None]
    q, k, v = leaves[:3]
    n_rep = q.shape[1] // k.shape[1]
    scores = (q @ k.repeat_interleave(n_rep, 1).transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask.to(q.device), float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, leaves[3].view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], -1)
    out = scores.softmax(-1)[..., :s] @ v.repeat_interleave(n_rep, 1)
    out.backward(dout.double())
    grads = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return grads if sinks is None else {**grads, "dsinks": leaves[3].grad}


SHARED_MICROBATCHES = 4
"""Microbatches of a cut's shared-arena run (Seq1F1B's first stage of 2): enough for a microbatch in
backward to share an arena with the next in forward, from its top (its slab descending)."""


def _unit_attention(
    kernel: AttentionKernel, q, k, v, dout, lengths, ids, reach: Reach, sinks, shared: bool
) -> list[dict]:
    """The sequence cut into ``lengths`` units, run as a pipeline stage runs them: units forward in
    order, backward last unit first (unit j+1 sends gradient into the K/V of 0..j). ``shared``:
    :data:`SHARED_MICROBATCHES` microbatches of the same sequence in the order of Seq1F1B's first stage
    of 2, the KV context told it, so that microbatches share arenas and every other one's slab runs last
    position first (its indexed copies and adds; a bottom-right kernel's two calls there). The layer reads
    within ``reach``, with ``sinks`` (Hq,) where given. Per microbatch: out, dq, dk, dv (and dsinks)."""
    n, count = (SHARED_MICROBATCHES if shared else 1), len(lengths)
    context = KVContext(list(lengths))
    context.documents = None if ids is None else [Documents.from_ids(ids)] * n
    if shared:
        passes = stage_passes(SEQUENCE_SCHEDULES["Seq1F1B"].compute_order(ScheduleShape(2, n, count))[0], 0, count)[1]
        context.expect(passes)
    else:
        passes = [(True, 0, j) for j in range(count)] + [(False, 0, j) for j in reversed(range(count))]
    attention = SequenceAttention(layer_id=0, reach=reach)
    attention.bind(context, kernel)
    units = _units(lengths)
    leaves = [[t.detach().requires_grad_() for t in (q, k, v, sinks) if t is not None] for _ in range(n)]
    outs = {}
    for forward, m, j in passes:
        u = replace(units[j], microbatch=m)
        part = slice(u.offset, u.offset + u.length)
        if forward:
            with context.running(u):
                outs[m, j] = attention(*(t[:, :, part] for t in leaves[m][:3]), sinks=(leaves[m][3:] or [None])[0])
        else:
            with context.backward(u):
                outs[m, j].backward(dout[:, :, part])
    names = ("dq", "dk", "dv", "dsinks")
    return [
        {"out": torch.cat([outs[m, j] for j in range(count)], 2).detach(), **{n: t.grad for n, t in zip(names, ts)}}
        for m, ts in enumerate(leaves)
    ]


def _rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).abs().max() / ref.abs().max())


def _within_tolerance(dtype: torch.dtype, errors: dict[str, dict[str, float]]) -> bool:
    if dtype == torch.float32:
        return all(e < FP32_TOL for cut in errors.values() for e in cut.values())
    alone, *cuts = errors.values()
    return all(alone[t] < LOW_PRECISION_TOL for t in alone) and all(
        cut[t] <= 2 * alone[t] + torch.finfo(dtype).eps for cut in cuts for t in cut
    )


def _kernels(device: torch.device) -> dict[str, AttentionKernel | str]:
    """The kernels to check on ``device``; a string says why one is absent."""
    if device.type == "cpu":
        return {"CpuSdpaKernel": CpuSdpaKernel()}
    kernels: dict[str, AttentionKernel | str] = {
        "CudaSdpaKernel": CudaSdpaKernel(),
        "CudnnSdpaKernel": CudnnSdpaKernel(),
    }
    try:
        kernels["FlashAttnKernel"] = FlashAttnKernel()
    except ImportError as e:
        kernels["FlashAttnKernel"] = f"skipped: flash_attn does not import ({e})"
    return kernels


def probe_kernel_dtypes(device: torch.device) -> dict[str, dict[str, str]]:
    """Per kernel and dtype, whether one causal block (forward and backward) runs: "ok", or the first
    line of the kernel's refusal. The job check's CUDA precision rule rests on what this finds
    (tests/unit/test_job_check_table.py reads the newest committed answer)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, h, 128, 64, generator=gen) for h in (4, 2, 2, 4))
    probes: dict[str, dict[str, str]] = {}
    for name, kernel in _kernels(device).items():
        if isinstance(kernel, str):
            continue
        probes[name] = {}
        for dtype in ATTN_DTYPES:
            qd, kd, vd, dd = (t.to(device, dtype) for t in (q, k, v, dout))
            try:
                out, lse = kernel.forward(qd, kd, vd, True, 0.125)
                kernel.backward(dd, qd, kd, vd, out, lse, True, 0.125)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                probes[name][_dtype_name(dtype)] = "ok"
            except Exception as e:  # noqa: BLE001 (a refusal is the finding)
                probes[name][_dtype_name(dtype)] = f"refused: {type(e).__name__}: {e}".splitlines()[0][:300]
    return probes


def check_attention(sizes: Sizes, device: torch.device) -> list[dict]:
    """One record per (attention kind, mask, kernel, dtype): relative errors per cut and tensor, or why not."""
    b, hq, hkv, s, d = sizes.attn_shape
    records = []
    for (kind_name, kind), (mask_name, documents) in itertools.product(KINDS.items(), MASKS.items()):
        ids, reach, dv = documents(s), kind.reach(s), int(d * kind.value_width)
        gen = torch.Generator().manual_seed(0)
        # (batch, seq, heads, dim) transposed, as the model lays out q, k, v after RoPE
        q, k = (torch.randn(b, s, h, d, generator=gen).transpose(1, 2) for h in (hq, hkv))
        v, dout = (torch.randn(b, s, h, dv, generator=gen).transpose(1, 2) for h in (hkv, hq))
        sinks = torch.randn(hq, generator=gen) if kind.sinks else None
        for name, kernel in _kernels(device).items():
            for dtype in ATTN_DTYPES:
                record = {"attention": kind_name, "mask": mask_name, "kernel": name, "dtype": _dtype_name(dtype)}
                records.append(record)
                if isinstance(kernel, str):
                    record["status"] = kernel
                    continue
                if name in HALF_ONLY_KERNELS and dtype == torch.float32:
                    record["status"] = "skipped: the kernel takes fp16/bf16 only"
                    continue
                # Inputs rounded to the dtype first, so the reference sees the same values.
                qd, kd, vd, dd = (t.to(device, dtype) for t in (q, k, v, dout))
                sd = None if sinks is None else sinks.to(device)
                ref = _reference(qd, kd, vd, dd, ids, reach, sd)
                try:
                    errors = {}
                    for cut, shared in ((c, s) for c in sizes.attn_cuts for s in (False, True)[: len(c)]):
                        got = _unit_attention(kernel, qd, kd, vd, dd, cut, ids, reach, sd, shared)
                        label = "-".join(map(str, cut)) + (" shared" if shared else "")
                        errors[label] = {t: max(_rel_error(g[t], ref[t]) for g in got) for t in ref}
                except Exception as e:  # noqa: BLE001 -- a failing kernel is a result; GPU runs are scarce
                    record["status"] = f"error: {type(e).__name__}: {e}".splitlines()[0]
                    continue
                record["errors"] = errors
                record["status"] = "ok" if _within_tolerance(dtype, errors) else "failed"
    return records


# --------------------------------------------------------------------------
# 2. KV-context overhead


class _Marks:
    """Time stamps between passes: CUDA events on a GPU (no synchronisation between
    passes, so the timing does not change the run), the clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks."""
        pairs = zip(self.marks, self.marks[1:])
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in pairs]
        return [b - a for a, b in pairs]


def _one_step(model, context: KVContext | None, tokens, targets, lengths) -> tuple[list[float], list[float], float]:
    """Forward and backward of one sequence as ``lengths`` units (the whole, plain,
    without a context): per-unit forward and backward seconds, and the loss."""
    seq_len = tokens.shape[1]
    marks = _Marks(tokens.device)
    marks.mark()
    losses = []
    for u in _units(lengths):
        part = slice(u.offset, u.offset + u.length)
        with context.running(u) if context is not None else contextlib.nullcontext():
            logits = model(tokens[:, part])
        # the last stage's loss, as the trainer computes it: token sum over the step's tokens
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets[:, part].flatten(), reduction="sum")
        losses.append(loss / seq_len)
        marks.mark()
    for u in reversed(_units(lengths)):
        with context.backward(u) if context is not None else contextlib.nullcontext():
            losses[u.index].backward()
        marks.mark()
    times = marks.intervals()
    k = len(lengths)
    return times[:k], times[k:][::-1], float(sum(loss.detach() for loss in losses))


def measure_candidate(model, context, tokens, targets, lengths, sizes: Sizes) -> dict:
    cuda = tokens.device.type == "cuda"
    first = time.perf_counter()
    for i in range(sizes.warmup):  # compilation, allocator, kernel selection, cuDNN plans
        _one_step(model, context, tokens, targets, lengths)
        model.zero_grad(set_to_none=True)
        if i == 0:
            if cuda:
                torch.cuda.synchronize()
            first = time.perf_counter() - first
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    steps = []
    for _ in range(sizes.repeats):
        steps.append(_one_step(model, context, tokens, targets, lengths))
        model.zero_grad(set_to_none=True)
    k = len(lengths)
    return {
        "time_s": statistics.median(sum(f) + sum(b) for f, b, _ in steps),
        "F": [statistics.median(s[0][j] for s in steps) for j in range(k)],
        "B": [statistics.median(s[1][j] for s in steps) for j in range(k)],
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "loss": steps[-1][2],
        "first_step_s": first,  # compiles when compiled: its excess over time_s is compile time
    }


def _models(sizes: Sizes, device: torch.device):
    """torchtitan's Llama 3 and the sequence model, same weights, in ``sizes.dtype``."""
    # Imported here: torchtitan takes seconds to import, and the error path needs none of it.
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs

    from torchtitan_seq.titan.v022.models.llama3_seq import SeqTransformer

    args = TransformerModelArgs(**sizes.model, max_seq_len=max(sizes.seq_lens))
    torch.manual_seed(0)
    with torch.device(device), torch.no_grad():
        seq = SeqTransformer(args)
        seq.init_weights()
        plain = Transformer(args)
    plain.load_state_dict(seq.state_dict())
    for model in (seq, plain):
        # Children only: the model's own buffer is the complex RoPE table, whose
        # imaginary part a cast to a real dtype would drop.
        for child in model.children():
            child.to(sizes.dtype)
    return plain, seq, args


def time_kernels(sizes: Sizes, device: torch.device, kernel: AttentionKernel) -> list[dict]:
    """Causal attention alone, forward + backward, at the overhead runs' lengths: torch's
    SDPA as torchtitan calls it (default backend choice, ``enable_gqa``), SDPA forced to
    each backend, and one unit through the KV context with ``kernel``. Median seconds."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, hq, hkv, _, d = sizes.attn_shape
    n_rep = hq // hkv

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                if backend is None:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                return F.scaled_dot_product_attention(
                    q, k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1), is_causal=True
                )

        return run

    context = KVContext()
    attention = SequenceAttention(layer_id=0)  # bound as long as its graphs run backward
    attention.bind(context, kernel)

    def unit(q, k, v):
        context.clear()
        with context.running(Unit(0, 0, 0, q.shape[2], 1)):
            return attention(q, k, v)

    paths = {"sdpa (torchtitan's call)": sdpa(None), "unit": unit}
    if device.type == "cuda":
        paths |= {
            f"sdpa {b.name.lower()}": sdpa(b)
            for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
        }
    records = []
    for seq_len in sizes.seq_lens:
        gen = torch.Generator().manual_seed(seq_len)
        q, k, v = (
            torch.randn(b, seq_len, h, d, generator=gen).to(device, sizes.dtype).transpose(1, 2).requires_grad_()
            for h in (hq, hkv, hkv)
        )
        for name, fn in paths.items():
            times = []
            try:
                for i in range(sizes.warmup + sizes.repeats):
                    marks = _Marks(device)
                    marks.mark()
                    fn(q, k, v).sum().backward()
                    marks.mark()
                    if i >= sizes.warmup:
                        times += marks.intervals()
            except RuntimeError as e:  # a backend that does not take these inputs
                records.append({"seq_len": seq_len, "path": name, "status": f"error: {str(e).splitlines()[0]}"})
                continue
            records.append({"seq_len": seq_len, "path": name, "status": "ok", "time_s": statistics.median(times)})
            print(f"  {seq_len:>6} {name:26} {records[-1]['time_s'] * 1e3:9.2f} ms", flush=True)
    return records


def _compile_blocks(model: torch.nn.Module) -> None:
    """torchtitan's ``apply_compile``: each TransformerBlock alone, ``fullgraph=True``."""
    for layer_id, block in model.layers.named_children():
        model.layers.register_module(layer_id, torch.compile(block, fullgraph=True))


def measure_overhead(
    sizes: Sizes, device: torch.device, kernel: AttentionKernel, out: Path, compiled: bool = False
) -> dict:
    """Plain Llama 3 and k units through the KV context at each length; writes cost files.
    ``compiled``: both models' blocks compiled, as torchtitan compiles them."""
    from torchtitan_seq.attention import bind_kv_context

    plain, seq, args = _models(sizes, device)
    if compiled:
        torch._dynamo.config.recompile_limit = 64  # every length and cut of this sweep
        _compile_blocks(plain)
        _compile_blocks(seq)
    context = KVContext()
    bind_kv_context(seq, context, kernel)
    runs = []
    for seq_len in sizes.seq_lens:
        gen = torch.Generator().manual_seed(seq_len)
        tokens = torch.randint(args.vocab_size, (1, seq_len), generator=gen).to(device)
        targets = torch.randint(args.vocab_size, (1, seq_len), generator=gen).to(device)
        configs = [("whole", plain, None, [seq_len])]
        configs += [("units", seq, context, partition_sequence(seq_len, k, "even")) for k in sizes.ks]
        base = None
        for path, model, ctx, lengths in configs:
            context.lengths = lengths  # they size the K/V slabs
            run = {"seq_len": seq_len, "path": path, "k": len(lengths), "lengths": lengths}
            runs.append(run)
            try:
                run.update(measure_candidate(model, ctx, tokens, targets, lengths, sizes))
            except torch.cuda.OutOfMemoryError:
                run["status"] = "OOM"
            else:
                run["status"] = "ok"
            # after the except block, so the failed step's tensors are already unreferenced
            context.clear()
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if run["status"] != "ok":
                print(f"  {seq_len:>6} {path:5} k={len(lengths)}: OOM", flush=True)
                continue
            name = f"cost_s{seq_len}_{path}_{'-'.join(map(str, lengths))}.json"
            cost = {
                "F": run["F"],
                "B": run["B"],
                "unit": "s",
                "seq_len": seq_len,
                "lengths": lengths,
                "model": "llama3 " + json.dumps(sizes.model),
                "dtype": _dtype_name(sizes.dtype),
                "repeats": sizes.repeats,
                "device": _device_name(device),
            }
            (out / name).write_text(json.dumps(cost, indent=1) + "\n")
            run["cost_file"] = name
            if path == "whole":
                base = run
            elif base is not None:
                run["overhead"] = run["time_s"] / base["time_s"] - 1
                run["loss_rel_diff"] = abs(run["loss"] / base["loss"] - 1)
                if run["peak_bytes"] is not None:
                    run["memory_ratio"] = run["peak_bytes"] / base["peak_bytes"]
            print(
                f"  {seq_len:>6} {path:5} k={len(lengths)}: {run['time_s'] * 1e3:9.2f} ms"
                + (f"  overhead {run['overhead']:+.3f}" if "overhead" in run else "")
                + f"  first step {run['first_step_s']:.1f} s",
                flush=True,
            )
    at_goal = [r for r in runs if r["seq_len"] == GOAL_SEQ_LEN and r["path"] == "units" and r["k"] > 1]
    try:  # what the planner's fixed cost per unit becomes once these files are committed
        fixed = gpu_fixed_cost_per_layer(out)
    except ValueError as e:  # too short a sweep (--tiny)
        fixed = None
        print(f"  no fixed cost per unit fitted: {e}", flush=True)
    else:
        print(
            f"  fixed cost per unit and layer: {fixed * 1e3:.3f} ms (the planner's H200_UNIT_OVERHEAD_S: "
            f"{H200_UNIT_OVERHEAD_S * 1e3:.3f} ms; refit it from these files when they are committed)",
            flush=True,
        )
    return {
        "fixed_per_unit_layer_s": fixed,
        "model": {
            **sizes.model,
            "ffn_hidden": seq.layers["0"].feed_forward.w1.out_features,
            "parameters": sum(p.numel() for p in seq.parameters()),
        },
        "dtype": _dtype_name(sizes.dtype),
        "batch": 1,
        "kernel": type(kernel).__name__,
        "baseline": "torchtitan's Llama 3 Transformer on the whole sequence (its SDPA wrapper)",
        "compiled": compiled,
        "warmup": sizes.warmup,
        "repeats": sizes.repeats,
        "runs": runs,
        "goal": {
            "line": f"KV-context overhead under {GOAL_OVERHEAD:.0%} at {GOAL_SEQ_LEN} tokens, k > 1",
            "met": all(r.get("overhead", 1) < GOAL_OVERHEAD for r in at_goal) if at_goal else None,
        },
    }


# --------------------------------------------------------------------------
# Driver


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _flash_attn_version() -> str | None:
    try:
        import flash_attn
    except ImportError:
        return None
    return flash_attn.__version__


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and the cost files")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument(
        "--tiny", action="store_true", help="toy sizes: the dry run with --device cpu, a smoke run with cuda"
    )
    ap.add_argument("--seq-lens", help="comma-separated lengths instead of the default ones")
    ap.add_argument(
        "--attention-backend",
        choices=("auto", "flash", "sdpa"),
        default="auto",
        help="the unit kernel of the overhead runs",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="overhead runs with every block compiled (torchtitan's per-block compile)",
    )
    ap.add_argument("--skip-attention", action="store_true", help="no attention check")
    ap.add_argument("--skip-overhead", action="store_true", help="no kernel timing and overhead runs")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device: run on a GPU, or use --device cpu --tiny for the dry run", file=sys.stderr)
        return 2
    if args.device == "cpu" and not args.tiny:
        print("error: --device cpu runs only the dry run: add --tiny", file=sys.stderr)
        return 2
    cpu_compat.apply()  # an entry point: torchtitan (imported later) reads the device type at import
    device = torch.device(args.device)
    try:
        kernel = select_kernel(device, args.attention_backend)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sizes = TINY if args.tiny else FULL
    if args.tiny and device.type == "cuda":
        sizes = replace(sizes, dtype=torch.bfloat16)  # the CUDA kernels take no fp32
    if args.seq_lens:
        sizes = replace(sizes, seq_lens=tuple(int(s) for s in args.seq_lens.split(",")))
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    results: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": "tiny" if args.tiny else "full",
        "device": _device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "flash_attn": _flash_attn_version(),
    }

    def write() -> None:
        results["elapsed_s"] = round(time.monotonic() - began, 1)
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=1) + "\n")

    print("the kernels' dtypes (one causal block forward and backward)", flush=True)
    results["kernel_dtypes"] = probe_kernel_dtypes(device)
    for name, dtypes in results["kernel_dtypes"].items():
        print(f"  {name:15} " + "  ".join(f"{dtype} {status}" for dtype, status in dtypes.items()), flush=True)
    write()
    cases: list[dict] = []
    if not args.skip_attention:
        cases = _attention_part(sizes, device, results)
        write()
    broken = {c.get("kernel") for c in cases if c["status"].startswith("error")}
    if args.attention_backend == "auto" and type(kernel).__name__ in broken:
        # One GPU run should still measure the overhead: with torch's own kernel, then.
        print(f"{type(kernel).__name__} failed above: overhead runs use CudaSdpaKernel", flush=True)
        kernel = CudaSdpaKernel()
    if not args.skip_overhead:
        print(f"attention alone, forward + backward ({type(kernel).__name__} for units)", flush=True)
        results["kernels"] = time_kernels(sizes, device, kernel)
        write()
        print(f"KV-context overhead ({type(kernel).__name__}{', compiled' if args.compile else ''})", flush=True)
        results["overhead"] = measure_overhead(sizes, device, kernel, args.out, args.compile)
        write()
        print(f"goal: {results['overhead']['goal']['line']}: met = {results['overhead']['goal']['met']}")
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the training run is another process
    print(f"sequence-schedule step on one {device.type} device", flush=True)
    results["sequence_step"] = _part(lambda: check_sequence_step(TINY_STEP if args.tiny else FULL_STEP, device))
    write()
    print(f"  {_summary(results['sequence_step'])}", flush=True)
    print(f"K/V offload on one {device.type} device", flush=True)
    results["kv_offload"] = _part(lambda: check_kv_offload(TINY_OFFLOAD if args.tiny else FULL_OFFLOAD, device))
    write()
    print(f"  {_summary(results['kv_offload'])}", flush=True)
    print("the trainer end to end (torchrun, one process)", flush=True)
    results["training"] = _part(lambda: check_training(args.tiny, device.type == "cuda"))
    write()
    print(f"  {_summary(results['training'])}", flush=True)
    print(f"wrote {args.out / 'gpu_check.json'} ({results['elapsed_s']:.0f} s)", flush=True)
    failed = [c for c in cases if c["status"] == "failed" or c["status"].startswith("error")]
    failed += [part for part in ("sequence_step", "kv_offload", "training") if results[part]["status"] != "ok"]
    return 1 if failed else 0


def _part(run: Callable[[], dict]) -> dict:
    """``run()``'s record, or the error it raised as one: a failing part is a result; GPU runs are scarce."""
    try:
        return run()
    except Exception as e:  # noqa: BLE001
        return {"status": f"error: {type(e).__name__}: {e}".splitlines()[0], "traceback": traceback.format_exc()}


def _summary(record: dict) -> str:
    keys = ("units", "whole", "losses", "exact", "kv_held_bytes", "step_ms", "overlap", "elapsed_s")
    figures = {key: record[key] for key in keys if key in record}
    return f"{record['status']} {figures}"


def _attention_part(sizes: Sizes, device: torch.device, results: dict) -> list[dict]:
    """The attention check into ``results["attention"]``, printed; returns its cases."""
    print(f"attention check on {results['device']}", flush=True)
    b, hq, hkv, s, d = sizes.attn_shape
    results["attention"] = {
        "shape": {"batch": b, "q_heads": hq, "kv_heads": hkv, "seq_len": s, "head_dim": d},
        "reference": "whole-sequence attention in float64, explicit mask (window, chunk), sinks as a logit column",
        "error": "max |unit - reference| / max |reference|, per tensor",
        "tolerance": {
            "float32": FP32_TOL,
            "low_precision": f"one unit < {LOW_PRECISION_TOL}; cuts <= 2 x one unit + dtype epsilon",
        },
        "cases": check_attention(sizes, device),
    }
    cases = results["attention"]["cases"]
    for case in cases:
        worst = max((e for cut in case.get("errors", {}).values() for e in cut.values()), default=None)
        print(
            f"  {case['attention']:19} {case['mask']:12} {case.get('kernel', ''):15} {case.get('dtype', ''):9} "
            f"{case['status']}" + (f" (largest error {worst:.2e})" if worst is not None else ""),
            flush=True,
        )
    return cases


if __name__ == "__main__":
    sys.exit(main())
