"""K/V offload: which arena goes to host memory when and comes back when (properties of
:func:`~torchtitan_seq.runtime.kv_offload.offload_spans` over a grid of schedules, p, N, k), the KV context
running it on the CPU (the same outputs and gradients, bit for bit, with less K/V held), and its CUDA path
(side stream, events, no host synchronisation) against fakes of what needs a GPU."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from kv_stages import stage_kv_peaks
from torchtitan_seq.attention import SequenceAttention
from torchtitan_seq.attention.kernels import select_kernel
from torchtitan_seq.instrumentation.kv_memory import KVMemory
from torchtitan_seq.runtime.kv_context import KVContext, Unit
from torchtitan_seq.runtime.kv_offload import MIN_GAP, KVOffload, StreamCopies, arena_of, offload_spans
from torchtitan_seq.runtime.kv_placement import plan_arenas
from torchtitan_seq.runtime.shape import JobShape
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, ScheduleShape
from torchtitan_seq.schedules.ordering import B, F, I, W, stage_passes
from torchtitan_seq.simulate import memory as mm
from torchtitan_seq.simulate.flavors import flavor_shape

pytestmark = pytest.mark.usefixtures("one_thread")  # small kernels: see conftest.py

SHAPES = [
    (name, p, n, k, split)
    for name in SEQUENCE_SCHEDULES
    for p, n, k, split in itertools.product((2, 4), (4, 8), (1, 2, 4), (False, True))
    if not (split and SEQUENCE_SCHEDULES[name].parameter_copies > 1)
]


def _stages(name, p, n, k, split):
    """Per stage: its passes as the arenas are planned by them, and every pass it announces (F, I, B, W)."""
    order = SEQUENCE_SCHEDULES[name].compute_order(ScheduleShape(p, n, k, split))
    for actions in order.values():
        for stage in sorted({a.stage_index for a in actions if a is not None}):
            yield stage_passes(actions, stage, k)[1], stage_passes(actions, stage, k, (F, I, B, W))[1]


@pytest.mark.parametrize("name,p,n,k,split", SHAPES, ids=lambda x: str(x))
def test_an_arena_is_away_only_while_no_pass_reads_it_and_back_before_the_next(name, p, n, k, split):
    """Every span: no pass between its ends touches the arena, at least MIN_GAP passes lie between, a
    microbatch of the arena is in flight across it, its copies come in order (out, drop, back, next), and
    spans of one arena do not overlap; every gap that could be offloaded is."""
    lengths = [3 + j for j in range(k)]
    spans_seen = 0
    for passes, touches in _stages(name, p, n, k, split):
        plan = plan_arenas(passes, lengths, sum(lengths[:-1]))
        arena = arena_of(plan)
        mbs = [m for _, m, _ in touches]
        spans = offload_spans(mbs, arena)
        spans_seen += len(spans)
        first = {m: mbs.index(m) for m in set(mbs)}
        last = {m: len(mbs) - 1 - mbs[::-1].index(m) for m in set(mbs)}
        for s in spans:
            assert arena(mbs[s.last]) == s.arena == arena(mbs[s.next])
            assert all(arena(m) != s.arena for m in mbs[s.last + 1 : s.next])
            assert s.next - s.last - 1 >= MIN_GAP
            assert s.last < s.out < s.drop <= s.back < s.next
            assert any(first[m] <= s.last and last[m] >= s.next for m in first if arena(m) == s.arena)
        for a in {arena(m) for m in mbs}:
            mine = sorted((s for s in spans if s.arena == a), key=lambda s: s.last)
            assert all(x.next <= y.last for x, y in zip(mine, mine[1:]))
            ts = [t for t, m in enumerate(mbs) if arena(m) == a]
            inside = [m for m in first if arena(m) == a]
            held = [(t1, t2) for t1, t2 in zip(ts, ts[1:]) if any(first[m] <= t1 and last[m] >= t2 for m in inside)]
            wide = {(t1, t2) for t1, t2 in held if t2 - t1 - 1 >= MIN_GAP}
            assert wide == {(s.last, s.next) for s in mine}
    if p == 4 and n == 8 and k >= 2:  # deep enough that some arena lies unread for a while
        assert spans_seen > 0


def test_a_longer_gap_is_asked_for():
    mbs = [0, 0, 1, 1, 1, 1, 0, 0]
    assert [tuple(s) for s in offload_spans(mbs, lambda m: m)] == [(0, 1, 6)]
    assert offload_spans(mbs, lambda m: m, min_gap=5) == []
    assert offload_spans([0, 1, 1, 1, 1, 2], lambda m: 0) == []  # one arena, always touched


# --------------------------------------------------------------------------
# The KV context running it: a stage of attention layers, unit by unit in a rank's order

P, N, K, HEADS, WIDTH = 4, 8, 4, 2, 8
LENGTHS = [8, 6, 6, 4]


def _run(offload: bool, schedule: str = "Seq1F1B", copies: Any = None, steps: int = 1):
    """Rank 0's first stage of three attention layers run over its passes, ``steps`` times on one context (as
    a stage runs its steps: the context cleared after each); returns the last step's outputs and the inputs'
    gradients, the K/V held at most (KVMemory) and the context."""
    order = SEQUENCE_SCHEDULES[schedule].compute_order(ScheduleShape(P, N, K))[0]
    stage = min(a.stage_index for a in order if a is not None)
    context = KVContext(list(LENGTHS))
    if offload:
        context.offload = KVOffload(context.arenas, copies)
    layers = [SequenceAttention(i) for i in range(3)]
    for layer in layers:
        layer.bind(context, select_kernel(torch.device("cpu")))
    context.expect(stage_passes(order, stage, K)[1])
    passes = stage_passes(order, stage, K, (F, I, B, W))[1]
    if offload:
        context.offload.expect(passes)
    gen = torch.Generator().manual_seed(0)
    inputs = {
        (m, j): [torch.randn(1, HEADS, LENGTHS[j], WIDTH, generator=gen, requires_grad=True) for _ in range(3)]
        for m in range(N)
        for j in range(K)
    }
    memory = KVMemory([context])
    for _ in range(steps):
        outs, kept = {}, {}
        for x in inputs.values():
            for t in x:
                t.grad = None
        with memory.track():
            for forward, m, j in passes:
                unit = Unit(m, j, sum(LENGTHS[:j]), LENGTHS[j], K)
                if forward:
                    with context.running(unit):
                        outs[m, j] = sum(layer(*inputs[m, j]) for layer in layers)
                        kept[m, j] = outs[m, j].detach().clone()
                else:
                    with context.backward(unit):
                        outs.pop((m, j)).pow(2).sum().backward()
        assert len(context) == 0
        context.clear()
    grads = {key: [t.grad for t in x] for key, x in inputs.items()}
    return kept, grads, memory.peak, context


@pytest.mark.parametrize("schedule", ["Seq1F1B", "InterleavedSeq1F1B", "BSIPipe"])
def test_offloaded_context_gives_the_same_outputs_and_gradients_bit_for_bit_with_less_kv(schedule):
    kept, grads, peak, _ = _run(offload=False, schedule=schedule)
    kept_off, grads_off, peak_off, context = _run(offload=True, schedule=schedule, steps=2)
    assert context.offload.spans()
    for key in kept:
        assert torch.equal(kept[key], kept_off[key])
        assert all(torch.equal(a, b) for a, b in zip(grads[key], grads_off[key]))
    assert peak_off < peak
    assert context.offload.host_bytes() > 0


def test_a_pass_out_of_the_announced_order_brings_every_arena_back_and_pauses_the_step():
    """Where the stage announces a pass other than the one expected, every arena comes back, byte for byte,
    and nothing more goes this step; the next step offloads again."""
    order = SEQUENCE_SCHEDULES["Seq1F1B"].compute_order(ScheduleShape(P, N, K))[0]
    passes = stage_passes(order, 0, K, (F, I, B, W))[1]
    context = KVContext(list(LENGTHS))
    context.offload = KVOffload(context.arenas)
    layer = SequenceAttention(0)
    layer.bind(context, select_kernel(torch.device("cpu")))
    context.expect(stage_passes(order, 0, K)[1])
    context.offload.expect(passes)
    plan = plan_arenas(stage_passes(order, 0, K)[1], LENGTHS, sum(LENGTHS[:-1]))  # as the arenas will plan
    span = min(offload_spans([m for _, m, _ in passes], arena_of(plan)), key=lambda s: s.drop)
    first = span.drop
    snapshot, outs = {}, {}
    for t, (forward, m, j) in enumerate(passes):
        unit = Unit(m, j, sum(LENGTHS[:j]), LENGTHS[j], K)
        if t == first + 1:
            break
        if forward:
            with context.running(unit):
                outs[m, j] = layer(*(torch.randn(1, HEADS, LENGTHS[j], WIDTH, requires_grad=True) for _ in range(3)))
        else:
            with context.backward(unit):
                outs.pop((m, j)).sum().backward()
        if t == first - 1:  # the arena goes as the next pass starts, unread until span.next
            snapshot = [x.clone() for _, *kv in context.arenas.buffers_of(span.arena) for x in kv]
    assert span in context.offload.spans()
    away = [x for _, *kv in context.arenas.buffers_of(span.arena) for x in kv]
    assert all(x.untyped_storage().nbytes() == 0 for x in away)
    context.offload.before(*passes[first + 2])  # not the pass expected
    assert all(torch.equal(x, y) for x, y in zip(away, snapshot, strict=True))
    context.offload.before(*passes[first + 1])  # paused: nothing more goes this step
    assert all(x.untyped_storage().nbytes() > 0 for x in context.arenas.tensors())


# --------------------------------------------------------------------------
# The CUDA path against fakes: what the side stream and the compute stream do, in order


class FakeStream:
    log: list = []

    def __init__(self, name: Any = "side") -> None:
        self.name = name if isinstance(name, str) else "side"

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: FakeEvent) -> None:
        assert event.recorded_on is not None, "waited for an event never recorded"
        self.log.append(("wait_event", self.name, event.id))

    def synchronize(self) -> None:
        raise AssertionError("the host synchronised with a stream")


class FakeEvent:
    count = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        FakeEvent.count += 1
        self.id, self.recorded_on = FakeEvent.count, None

    def record(self, stream: FakeStream) -> None:
        self.recorded_on = stream.name
        FakeStream.log.append(("record", stream.name, self.id))

    def synchronize(self) -> None:
        raise AssertionError("the host synchronised with an event")


class _StreamContext:
    current = None

    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream

    def __enter__(self) -> None:
        self.before, _StreamContext.current = _StreamContext.current, self.stream

    def __exit__(self, *exc: Any) -> None:
        _StreamContext.current = self.before


@pytest.fixture
def fake_cuda(monkeypatch):
    compute = FakeStream("compute")
    FakeStream.log = []
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", _StreamContext)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _StreamContext.current or compute)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("the host synchronised"))
    monkeypatch.setattr(
        StreamCopies, "host", lambda self, nbytes: torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
    )
    copied = []
    copy = torch.UntypedStorage.copy_

    def logged_copy(self, source, non_blocking=None):
        stream = _StreamContext.current.name if _StreamContext.current else "compute"
        copied.append((stream, non_blocking))
        FakeStream.log.append(("copy", stream))
        return copy(self, source)

    monkeypatch.setattr(torch.UntypedStorage, "copy_", logged_copy)
    return copied


def test_cuda_copies_run_on_a_side_stream_ordered_by_events_without_host_syncs(fake_cuda):
    kept, grads, _, _ = _run(offload=False)
    kept_off, grads_off, _, context = _run(offload=True, copies=StreamCopies(torch.device("cuda", 0)))
    for key in kept:
        assert torch.equal(kept[key], kept_off[key])
        assert all(torch.equal(a, b) for a, b in zip(grads[key], grads_off[key]))
    assert fake_cuda and all(c == ("side", True) for c in fake_cuda)  # every copy on the side stream, async
    log = FakeStream.log
    copies = [i for i, e in enumerate(log) if e[0] == "copy"]
    # each copy after the side stream waited for the compute stream (the writes, the allocation)
    assert all(any(e[0] == "wait_stream" and e[1:] == ("side", "compute") for e in log[:i]) for i in copies)
    recorded = {e[2] for e in log if e[0] == "record"}
    waited = [e[2] for e in log if e[0] == "wait_event"]
    assert all(e[1] == "compute" for e in log if e[0] == "wait_event")  # the compute stream waits, never the host
    assert set(waited) == recorded  # every copy's event is waited for, out before the drop, back before the read


# --------------------------------------------------------------------------
# The memory model's K/V held against what the offloading contexts hold, measured


def _measured_kv(offload: bool, p: int, n: int, k: int, seq_len: int) -> list[int]:
    """Per rank, the most K/V its stage's context holds over a Seq1F1B step of the Llama 3 debug model's
    attention layers (each rank's share), run unit by unit in the rank's order (KVMemory: storages)."""
    args = flavor_shape("debugmodel")
    lengths = JobShape.of_model(args, seq_len, k, "compute", microbatches=n).lengths
    heads, width = args.n_kv_heads or args.n_heads, args.dim // args.n_heads

    def context() -> KVContext:
        ctx = KVContext(list(lengths))
        ctx.offload = KVOffload(ctx.arenas) if offload else None
        return ctx

    def forward(layers: list[SequenceAttention], length: int) -> list[torch.Tensor]:
        qkv = [torch.randn(1, heads, length, width, requires_grad=True) for _ in range(3)]
        return [layer(*qkv) for layer in layers]

    return stage_kv_peaks(args.n_layers, lengths, p, n, context, SequenceAttention, forward, (F, I, B, W))


def test_predicted_device_kv_under_offload_is_the_measured():
    """Seq1F1B on 4 ranks, 8 microbatches of 4 units: the first ranks offload (their arenas lie unread between
    a microbatch's forwards and backwards; rank 0's peak falls), the last have nothing to offload."""
    p, n, k, seq_len = 4, 8, 4, 512
    shape = JobShape.of_model(flavor_shape("debugmodel"), seq_len, k, "compute", microbatches=n)
    for offload in (False, True):
        config = mm.MemoryConfig("debugmodel", shape, "Seq1F1B", pp=p, device="cpu", kv_offload=offload)
        predicted = [rank.kv_held for rank in mm.predict_memory(config).ranks]
        measured = _measured_kv(offload, p, n, k, seq_len)
        assert predicted == pytest.approx(measured, rel=0.05), (offload, predicted, measured)
        if not offload:
            held = predicted
    assert predicted[0] < held[0] and all(a <= b for a, b in zip(predicted, held))
