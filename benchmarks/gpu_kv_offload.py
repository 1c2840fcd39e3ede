"""K/V offload on one device (``sequence_pipeline.kv_offload``): exactness and overlap.

One pipeline stage of attention layers (``SequenceAttention`` through a ``KVContext``) runs, unit by unit,
the passes of Seq1F1B's first rank on p = 8 ranks (its arenas lie unread between a microbatch's forwards and
backwards), once with the K/V context on the device and once offloaded (pinned host memory, a side stream and
events on CUDA; copies as issued on the CPU). Measured:

* exactness: every unit's output and every input gradient bit for bit the same with offload as without;
* memory: the K/V the context holds at most (``KVMemory``: its storages) both ways, and on CUDA the peak
  allocated;
* overlap: the step's time (CUDA events, median of ``repeats`` after a warm-up) both ways, and the copy time
  the offload would add if nothing overlapped (the bytes copied over the host link's bandwidth, measured on
  one pinned copy): ``overlap`` = 1 - (time with - time without) / that copy time (1: fully hidden).

On the CPU (the dry run) only exactness and memory mean anything. ``check_kv_offload`` returns the record;
status ``ok`` when exact and the offloaded context holds less K/V.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from torchtitan_seq.attention import SequenceAttention
from torchtitan_seq.attention.kernels import select_kernel
from torchtitan_seq.instrumentation.kv_memory import KVMemory
from torchtitan_seq.runtime.kv_context import KVContext, Unit
from torchtitan_seq.runtime.kv_offload import KVOffload
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, ScheduleShape
from torchtitan_seq.schedules.ordering import B, F, I, W, stage_passes

__all__ = ["OffloadSizes", "FULL_OFFLOAD", "TINY_OFFLOAD", "check_kv_offload"]


@dataclass(frozen=True)
class OffloadSizes:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    lengths: tuple[int, ...]  # the units of a microbatch
    pp: int
    microbatches: int
    dtype: torch.dtype
    repeats: int


FULL_OFFLOAD = OffloadSizes(4, 16, 8, 128, (4096, 3072, 2560, 2304), 8, 16, torch.bfloat16, 5)
TINY_OFFLOAD = OffloadSizes(2, 4, 2, 16, (24, 16, 16, 8), 8, 16, torch.float32, 1)


def _step(sizes: OffloadSizes, device: torch.device, offload: bool, inputs: dict) -> tuple[dict, dict, int, float]:
    """One step of the stage; returns outputs, input gradients, K/V held at most, and milliseconds (CUDA)."""
    k = len(sizes.lengths)
    order = SEQUENCE_SCHEDULES["Seq1F1B"].compute_order(ScheduleShape(sizes.pp, sizes.microbatches, k))[0]
    context = KVContext(list(sizes.lengths))
    context.offload = KVOffload(context.arenas) if offload else None
    layers = [SequenceAttention(i) for i in range(sizes.layers)]
    for layer in layers:
        layer.bind(context, select_kernel(device))
    context.expect(stage_passes(order, 0, k)[1])
    passes = stage_passes(order, 0, k, (F, I, B, W))[1]
    if offload:
        context.offload.expect(passes)
    for x in inputs.values():
        for t in x:
            t.grad = None
    outs, kept, memory = {}, {}, KVMemory([context])
    timing = device.type == "cuda"
    if timing:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    with memory.track():
        for forward, m, j in passes:
            unit = Unit(m, j, sum(sizes.lengths[:j]), sizes.lengths[j], k)
            if forward:
                with context.running(unit):
                    outs[m, j] = sum(layer(*inputs[m, j]) for layer in layers)
                    kept[m, j] = outs[m, j].detach().clone()
            else:
                with context.backward(unit):
                    outs.pop((m, j)).float().pow(2).sum().backward()
    ms = 0.0
    if timing:
        end.record()
        torch.cuda.synchronize()  # once, after the step: the unit path never waits on the host
        ms = start.elapsed_time(end)
    grads = {key: [t.grad for t in x] for key, x in inputs.items()}
    return kept, grads, memory.peak, ms


def _link_gbps(device: torch.device, nbytes: int) -> float:
    """Host-to-device GB/s of one pinned copy of ``nbytes`` (inf off CUDA)."""
    if device.type != "cuda":
        return float("inf")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dev.copy_(host, non_blocking=True)
    end.record()
    torch.cuda.synchronize()
    return nbytes / (start.elapsed_time(end) / 1e3) / 1e9


def check_kv_offload(sizes: OffloadSizes, device: torch.device) -> dict:
    """The offload's exactness, memory and overlap on ``device`` (see the module's docstring)."""
    gen = torch.Generator(device=device).manual_seed(0)
    k = len(sizes.lengths)
    inputs = {
        (m, j): [
            torch.randn(1, h, sizes.lengths[j], sizes.head_dim, generator=gen, device=device, dtype=sizes.dtype)
            .mul_(0.5)
            .requires_grad_()
            for h in (sizes.heads, sizes.kv_heads, sizes.kv_heads)
        ]
        for m in range(sizes.microbatches)
        for j in range(k)
    }
    runs: dict[bool, list] = {False: [], True: []}
    peaks: dict[bool, int] = {}
    for _ in range(sizes.repeats + 1):  # the first of each a warm-up
        for offload in (False, True):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            runs[offload].append(_step(sizes, device, offload, inputs))
            if device.type == "cuda":
                peaks[offload] = torch.cuda.max_memory_allocated(device)
    (plain, plain_grads, plain_kv, _), (off, off_grads, off_kv, _) = runs[False][-1], runs[True][-1]
    exact = all(torch.equal(plain[u], off[u]) for u in plain) and all(
        torch.equal(a, b) for u in plain_grads for a, b in zip(plain_grads[u], off_grads[u])
    )
    record: dict = {
        "shape": {"pp": sizes.pp, "microbatches": sizes.microbatches, "lengths": list(sizes.lengths)},
        "exact": exact,
        "kv_held_bytes": {"device": plain_kv, "offloaded": off_kv},
    }
    if device.type == "cuda":
        ms = {o: statistics.median(r[3] for r in runs[o][1:]) for o in runs}
        position = 2 * sizes.kv_heads * sizes.head_dim * sizes.dtype.itemsize * sizes.layers
        copied = 2 * position * sum(sizes.lengths[:-1]) * sizes.microbatches  # each slab out and back, about
        gbps = _link_gbps(device, position * sum(sizes.lengths[:-1]))
        copy_ms = copied / (gbps * 1e9) * 1e3
        record |= {
            "step_ms": {"device": ms[False], "offloaded": ms[True]},
            "peak_allocated_bytes": {"device": peaks[False], "offloaded": peaks[True]},
            "host_link_gbps": gbps,
            "copy_ms_if_serial": copy_ms,
            "overlap": 1 - (ms[True] - ms[False]) / copy_ms,
        }
    record["status"] = "ok" if exact and off_kv < plain_kv else "failed"
    return record
