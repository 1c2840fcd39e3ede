"""Attention with a reach, sinks and narrow values, unit by unit, against dense attention over the whole
sequence: a sliding window (gpt-oss), attention chunks (Llama 4), sinks (gpt-oss) and values narrower
than queries and keys (MLA's), alone and together with packed documents, over grids of unit cuts, both
mask alignments of the kernels, and the whole-sequence path.

The reference shares no code with what it checks: a dense float64 boolean mask built from positions
(document ids equal, key not after the query, within the window, in the query's chunk), softmax with
each head's sink as an extra logit column of value zero, and autograd for the gradients.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from bottom_right import BottomRightCpuKernel
from torchtitan_seq.attention import SequenceAttention
from torchtitan_seq.attention.kernels import select_kernel
from torchtitan_seq.instrumentation.kv_memory import KVMemory
from torchtitan_seq.runtime.documents import Documents
from torchtitan_seq.runtime.kv_context import KVContext, Unit
from torchtitan_seq.runtime.kv_reach import ReachViews
from torchtitan_seq.runtime.reach import Reach

KERNELS = {"top-left": lambda: select_kernel(torch.device("cpu")), "bottom-right": BottomRightCpuKernel}
HQ, HKV, D = 4, 2, 8
TOL = 1e-5


def _reference(q, k, v, ids, window, chunk, sinks):
    """Dense attention in float64: out (B, Hq, S, Dv) of queries reading the keys every rule allows."""
    q, k, v = (
        t.double().repeat_interleave(q.shape[1] // t.shape[1], 1) if t is not q else t.double() for t in (q, k, v)
    )
    s = q.shape[2]
    pos = torch.arange(s)
    allowed = pos.unsqueeze(1) >= pos.unsqueeze(0)  # (query, key)
    if window is not None:
        allowed &= pos.unsqueeze(1) - pos.unsqueeze(0) < window
    if chunk is not None:
        allowed &= pos.unsqueeze(1) // chunk == pos.unsqueeze(0) // chunk
    allowed = allowed.expand(q.shape[0], s, s)
    if ids is not None:
        allowed = allowed & (ids.unsqueeze(2) == ids.unsqueeze(1))
    scores = (q @ k.transpose(-2, -1)) * D**-0.5
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    if sinks is not None:
        column = sinks.double().view(1, -1, 1, 1).expand(q.shape[0], -1, s, 1)
        scores = torch.cat([scores, column], -1)
    probs = scores.softmax(-1)[..., :s]
    return probs @ v


def _ids(batch, s, seed):
    """Document ids of ``batch`` rows of ``s`` tokens, documents of random lengths."""
    g = torch.Generator().manual_seed(seed)
    new = torch.rand(batch, s, generator=g) < 0.15
    new[:, 0] = False
    return new.cumsum(1).int()


def _inputs(batch, s, dv, sinks, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, HQ, s, D, generator=g)
    k = torch.randn(batch, HKV, s, D, generator=g)
    v = torch.randn(batch, HKV, s, dv, generator=g)
    sink = torch.randn(HQ, generator=g) if sinks else None
    weight = torch.randn(batch, HQ, s, dv, generator=g)
    leaves = [t.requires_grad_() for t in (q, k, v, sink) if t is not None]
    return q, k, v, sink, weight, leaves


def _errors(out, grads, ref, ref_grads) -> float:
    """The largest error of the output and each gradient relative to its reference's largest value
    (absolute where the reference is zero: a window of 1 leaves q and k no gradient)."""
    pairs = zip((out, *grads), (ref, *ref_grads))
    return max(
        float((a.detach().double() - b.detach()).abs().max() / (b.detach().abs().max() or 1.0)) for a, b in pairs
    )


def _copying(mode: str):
    """Under mode "reach-copied", saved-tensor hooks that keep what they pack (as checkpointing's run a
    layer): a bounded layer's slab then copies its reach into arenas, where under "reach" it views the units'
    own K/V; the context's mode is "reach" either way."""
    if mode == "reach-copied":
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    return contextlib.nullcontext()


MODES = ("reach", "reach-copied", "full")


def _run_units(kernel, lengths, reach, ids, q, k, v, sinks, weight, mode="reach"):
    with _copying(mode):
        return _run_units_as(kernel, lengths, reach, ids, q, k, v, sinks, weight, mode.split("-")[0])


def _run_units_as(kernel, lengths, reach, ids, q, k, v, sinks, weight, mode):
    context = KVContext(lengths, mode=mode)
    context.documents = [Documents.from_ids(ids)] if ids is not None else None
    layer = SequenceAttention(0, reach)
    layer.bind(context, kernel)
    units = [Unit(0, j, sum(lengths[:j]), n, len(lengths)) for j, n in enumerate(lengths)]
    outs = {}
    for u in units:
        part = slice(u.offset, u.offset + u.length)
        with context.running(u):
            outs[u.index] = layer(q[:, :, part], k[:, :, part], v[:, :, part], sinks=sinks)
    for u in reversed(units):
        with context.backward(u):
            (outs[u.index] * weight[:, :, u.offset : u.offset + u.length]).sum().backward()
    assert len(context) == 0
    return torch.cat([outs[u.index] for u in units], 2)


def _check(kernel, lengths, window, chunk, packed, sinks, dv, mode):
    s = sum(lengths)
    q, k, v, sink, weight, leaves = _inputs(2, s, dv, sinks)
    ids = _ids(2, s, seed=len(lengths)) if packed else None
    ref = _reference(q, k, v, ids, window, chunk, sink)
    ref_grads = torch.autograd.grad((ref * weight.double()).sum(), leaves)
    out = _run_units(kernel, lengths, Reach(window, chunk), ids, q, k, v, sink, weight, mode)
    return _errors(out, [t.grad for t in leaves], ref, ref_grads)


CUTS = [[24], [8, 8, 8], [11, 7, 9, 5], [3, 13, 1, 7]]
REACHES = [(None, None), (1, None), (5, None), (9, None), (30, None), (None, 4), (None, 7), (None, 10), (6, 5)]


@pytest.mark.slow
@pytest.mark.parametrize("aligned", list(KERNELS))
@pytest.mark.parametrize("window,chunk", REACHES, ids=[f"w{w}-c{c}" for w, c in REACHES])
def test_units_with_a_reach_equal_dense_attention(aligned, window, chunk):
    """Every unit cut, causal and packed, with and without sinks, values as wide and narrower, the K/V
    context holding only the reach (as views, and copied) and every earlier position."""
    grid = itertools.product(CUTS, (False, True), (False, True), (D, 5), MODES)
    for lengths, packed, sinks, dv, mode in grid:
        error = _check(KERNELS[aligned](), lengths, window, chunk, packed, sinks, dv, mode)
        assert error < TOL, (lengths, packed, sinks, dv, mode, error)


@pytest.mark.parametrize("window,chunk", REACHES, ids=[f"w{w}-c{c}" for w, c in REACHES])
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
def test_whole_sequence_path_equals_dense_attention(window, chunk, packed):
    """An unbound layer (no pipeline) attends as the reference does."""
    s = 24
    q, k, v, sink, weight, leaves = _inputs(2, s, 5, True)
    ids = _ids(2, s, seed=3) if packed else None
    ref = _reference(q, k, v, ids, window, chunk, sink)
    ref_grads = torch.autograd.grad((ref * weight.double()).sum(), leaves)
    out = SequenceAttention(0, Reach(window, chunk))(q, k, v, documents=ids, sinks=sink)
    (out * weight).sum().backward()
    assert _errors(out, [t.grad for t in leaves], ref, ref_grads) < TOL


def _mutated(monkeypatch, name):
    """The core with one mechanism broken."""
    from torchtitan_seq.attention import calls

    if name == "window_off_by_one":
        build = calls._build_calls.__wrapped__ if hasattr(calls._build_calls, "__wrapped__") else calls._build_calls

        def build_wide(documents, segments, bottom_right, reach):
            if reach.window is not None:
                reach = Reach(reach.window + 1, reach.chunk)
            return build(documents, segments, bottom_right, reach)

        monkeypatch.setattr(calls, "_build_calls", build_wide)
        calls._causal_calls.cache_clear()
    elif name == "chunk_boundary_at_unit_start":
        # a unit's queries read no key before the unit: as if a chunk began where each unit begins
        def no_prefix(documents, segments, bottom_right, reach):
            causal, _ = build(documents, segments, False, reach)
            return causal, ()

        build = calls._build_calls
        monkeypatch.setattr(calls, "_build_calls", no_prefix)
        calls._causal_calls.cache_clear()
    elif name == "sink_per_call":
        merge = calls._merge_into

        def merge_and_sink(out, lse, out_i, lse_i):
            merge(out, lse, out_i, lse_i)
            calls.merge_sinks(out, lse, _SINKS[0])

        monkeypatch.setattr(calls, "_merge_into", merge_and_sink)


_SINKS: list[torch.Tensor] = []


@pytest.mark.parametrize(
    "mutation,window,chunk,sinks",
    [
        ("window_off_by_one", 5, None, False),
        ("chunk_boundary_at_unit_start", None, 10, False),
        ("sink_per_call", None, None, True),
    ],
)
def test_each_mechanism_broken_fails_by_a_wide_margin(monkeypatch, mutation, window, chunk, sinks):
    from torchtitan_seq.attention import calls

    _mutated(monkeypatch, mutation)
    try:
        s = 24
        q, k, v, sink, weight, leaves = _inputs(2, s, D, sinks)
        _SINKS[:] = [sink] if sinks else []
        ref = _reference(q, k, v, None, window, chunk, sink)
        ref_grads = torch.autograd.grad((ref * weight.double()).sum(), leaves)
        reach = Reach(window, chunk)
        out = _run_units(KERNELS["top-left"](), [11, 7, 6], reach, None, q, k, v, sink, weight, mode="full")
        assert _errors(out, [t.grad for t in leaves], ref, ref_grads) > 1e3 * TOL
    finally:
        calls._causal_calls.cache_clear()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("aligned", list(KERNELS))
@pytest.mark.parametrize("window,chunk", [(5, None), (9, None), (None, 7), (6, 5)], ids=["w5", "w9", "c7", "w6-c5"])
def test_microbatches_sharing_arenas_read_within_the_reach(aligned, window, chunk, mode):
    """Four microbatches in the order of Seq1F1B's first stage of 2, the KV context told it. Holding every
    earlier position, or a copy of the reach, they share arenas, every other one's slab laid out last
    position first, which a window's mask must read in position order; holding the reach as views of the
    units' K/V, no arena."""
    with _copying(mode):
        context = _sharing_arenas(aligned, window, chunk, mode.split("-")[0])
    planned = context.arenas.plans
    if mode == "reach":
        assert not planned  # no arena placed
    else:
        (plan, _), *_ = planned.values()
        assert sum(placed.descending for placed in plan.slabs.values()) > 0  # shared from both ends


def _sharing_arenas(aligned, window, chunk, mode) -> KVContext:
    from dataclasses import replace

    from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, ScheduleShape
    from torchtitan_seq.schedules.ordering import stage_passes

    lengths, n = [11, 7, 9, 5], 4
    context = KVContext(lengths, mode=mode)
    passes = stage_passes(SEQUENCE_SCHEDULES["Seq1F1B"].compute_order(ScheduleShape(2, n, len(lengths)))[0], 0, 4)[1]
    context.expect(passes)
    layer = SequenceAttention(0, Reach(window, chunk))
    layer.bind(context, KERNELS[aligned]())
    units = [Unit(0, j, sum(lengths[:j]), length, len(lengths)) for j, length in enumerate(lengths)]
    inputs = [_inputs(2, sum(lengths), 5, True, seed=m) for m in range(n)]
    outs = {}
    for forward, m, j in passes:
        u = replace(units[j], microbatch=m)
        q, k, v, sink, weight, _ = inputs[m]
        part = slice(u.offset, u.offset + u.length)
        if forward:
            with context.running(u):
                outs[m, j] = layer(q[:, :, part], k[:, :, part], v[:, :, part], sinks=sink)
        else:
            with context.backward(u):
                (outs[m, j] * weight[:, :, part]).sum().backward()
    for m in range(n):
        q, k, v, sink, weight, leaves = inputs[m]
        ref = _reference(q, k, v, None, window, chunk, sink)
        ref_grads = torch.autograd.grad((ref * weight.double()).sum(), leaves)
        out = torch.cat([outs[m, j] for j in range(len(lengths))], 2)
        assert _errors(out, [t.grad for t in leaves], ref, ref_grads) < TOL, m
    return context


@pytest.mark.parametrize("window,chunk", [(5, None), (None, 6), (None, None)], ids=["w5", "c6", "full"])
def test_quick_units_with_a_reach_equal_dense_attention(window, chunk):
    """One cut of the grid above per mode and kernel, packed, with sinks and narrow values."""
    for aligned, mode in itertools.product(KERNELS, MODES):
        error = _check(KERNELS[aligned](), [11, 7, 9, 5], window, chunk, True, True, 5, mode)
        assert error < TOL, (aligned, mode, error)


def _held_bytes(seq_len: int, reach: Reach, mode: str, hooked: bool = True, trains: bool = True) -> int:
    """Bytes of K/V the context holds once every unit of a microbatch of 4 has run forward, under saved-tensor
    hooks (as checkpointing runs a layer: a bounded layer's slab copies its reach) where ``hooked``, in ``eval``
    (nothing saved: copies too) unless ``trains``."""
    lengths = [seq_len // 4] * 4
    q, k, v, *_ = _inputs(1, seq_len, D, False)
    context = KVContext(lengths, mode=mode)
    context.trains = trains
    layer = SequenceAttention(0, reach)
    layer.bind(context, KERNELS["top-left"]())
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t) if hooked else contextlib.nullcontext()
    with torch.no_grad(), hooks:
        for j, length in enumerate(lengths):
            part = slice(j * length, (j + 1) * length)
            with context.running(Unit(0, j, j * length, length, 4)):
                layer(q[:, :, part], k[:, :, part], v[:, :, part])
    return KVMemory([context]).held()


@pytest.mark.parametrize("window,chunk", [(5, None), (None, 6), (7, 20)])
def test_a_bounded_layer_holds_its_reach_whatever_the_sequence_length(window, chunk):
    """Held K/V of a windowed or chunked layer: copied, at most three later units' reach under ``reach`` (a
    window's the same at 64 and 256 tokens), in eval too; as views of the units' own K/V, none; the prefix of
    every later unit under ``full``; a layer of full attention holds its prefix either way."""
    reach = Reach(window, chunk)
    per_position = 2 * HKV * D * 4  # K and V, float32
    if chunk is None:
        assert _held_bytes(64, reach, "reach") == _held_bytes(256, reach, "reach")
    bound = 3 * (min(window or chunk, chunk or window) - 1) * per_position  # three later units' reach
    assert 0 < _held_bytes(256, reach, "reach") <= bound
    assert _held_bytes(256, reach, "reach", hooked=False) == 0
    assert _held_bytes(256, reach, "reach", hooked=False, trains=False) == _held_bytes(256, reach, "reach")
    assert _held_bytes(256, reach, "full") == 192 * per_position  # every unit's but the last one's
    assert _held_bytes(256, Reach(), "reach") == _held_bytes(256, Reach(), "full")


@pytest.mark.parametrize("window,chunk", [(5, None), (9, None), (30, None), (None, 4), (None, 10), (6, 5)])
def test_views_of_a_unit_go_once_every_unit_that_reads_them_has_run_backward(window, chunk):
    """Over the grid's cuts, a bounded layer's slab of views (no saved-tensor hooks): once unit j's backward
    ends it keeps views of units before j - 1 only (unit j - 1's are read by units j and later alone, and
    autograd frees a unit's own K/V with its backward); what it keeps then is exactly what units before j
    read, so no unit's views outlive their readers nor go before them."""
    for lengths in CUTS:
        s = sum(lengths)
        q, k, v, sink, weight, _ = _inputs(1, s, D, False)
        context = KVContext(lengths)
        layer = SequenceAttention(0, Reach(window, chunk))
        layer.bind(context, KERNELS["top-left"]())
        units = [Unit(0, j, sum(lengths[:j]), n, len(lengths)) for j, n in enumerate(lengths)]
        outs = {}
        for u in units:
            part = slice(u.offset, u.offset + u.length)
            with context.running(u):
                outs[u.index] = layer(q[:, :, part], k[:, :, part], v[:, :, part])
        slab = context._slabs[0][0]
        assert isinstance(slab, ReachViews)
        for u in reversed(units):
            with context.backward(u):
                (outs.pop(u.index) * weight[:, :, u.offset : u.offset + u.length]).sum().backward()
            read = {
                p
                for w in units[1 : u.index]
                for a, b in slab.rows.within(*_prefix(w, window, chunk))
                for p in range(a, b)
            }
            kept = {p for a, b, *_ in slab.pieces for p in range(a, b)}
            owners = {next(w.index for w in units if w.offset <= a < w.offset + w.length) for a, *_ in slab.pieces}
            assert all(i < u.index - 1 for i in owners), (lengths, u.index, owners)
            assert read <= kept, (lengths, u.index)


def _prefix(unit: Unit, window: int | None, chunk: int | None) -> tuple[int, int]:
    """Positions [first, offset) of the prefix ``unit`` reads within a window and a chunk."""
    first = 0 if chunk is None else unit.offset - unit.offset % chunk
    if window is not None:
        first = max(first, unit.offset - window + 1)
    return first, unit.offset
