"""Each pipeline rank's stage of attention layers run unit by unit over its passes of a Seq1F1B step, as a
stage runs them, with the most K/V its KV context holds measured (what the memory model's ``kv_held``
predicts): the measured side of the K/V memory tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from torchtitan_seq.attention import SequenceAttention
from torchtitan_seq.attention.kernels import select_kernel
from torchtitan_seq.instrumentation.kv_memory import KVMemory
from torchtitan_seq.runtime.kv_context import KVContext, Unit
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, ScheduleShape
from torchtitan_seq.schedules.ordering import B, F, W, stage_passes
from torchtitan_seq.titan.flavors import chunk_split


def stage_kv_peaks(
    n_layers: int,
    lengths: Sequence[int],
    p: int,
    n: int,
    context: Callable[[], KVContext],
    layer: Callable[[int], SequenceAttention],
    forward: Callable[[list[SequenceAttention], int], list[torch.Tensor]],
    kinds: tuple = (F, B, W),
) -> list[int]:
    """Per rank, the most K/V (KVMemory: each storage once, at unit boundaries) its stage's context holds over
    one Seq1F1B step of ``n`` microbatches of units of ``lengths`` on ``p`` ranks.

    Args:
        n_layers: the model's layers, cut into stages as torchtitan cuts them.
        lengths: the units' lengths of every microbatch.
        p: pipeline ranks.
        n: microbatches.
        context: a new stage's KV context (its ``offload`` set, when it offloads).
        layer: the attention layer of a layer id, bound to the context here.
        forward: a unit's forward over the stage's layers at a unit length: one output per layer, whose sums
            the unit's backward runs.
        kinds: the passes the stage runs and announces (with I, every pass: what an offload follows).

    Returns:
        Each rank's peak bytes; its context holds nothing after the step (asserted).
    """
    k = len(lengths)
    order = SEQUENCE_SCHEDULES["Seq1F1B"].compute_order(ScheduleShape(p, n, k))
    kernel = select_kernel(torch.device("cpu"))
    peaks, first = [], 0
    for rank, (count, _, _) in enumerate(chunk_split(n_layers, p)):
        ctx = context()
        layers = [layer(i) for i in range(first, first + count)]
        first += count
        for attention in layers:
            attention.bind(ctx, kernel)
        ctx.expect(stage_passes(order[rank], rank, k)[1])
        passes = stage_passes(order[rank], rank, k, kinds)[1]
        if ctx.offload is not None:
            ctx.offload.expect(passes)
        memory, outs = KVMemory([ctx]), {}
        with memory.track():
            for runs_forward, m, j in passes:
                unit = Unit(m, j, sum(lengths[:j]), lengths[j], k)
                if runs_forward:
                    with ctx.running(unit):
                        outs[m, j] = forward(layers, lengths[j])
                else:
                    with ctx.backward(unit):
                        sum(out.sum() for out in outs.pop((m, j))).backward()
        assert len(ctx) == 0
        peaks.append(memory.peak)
    return peaks
