"""K/V arenas: slab placement from a stage's pass order, and the KV context following it."""

import itertools

import pytest
import torch

from torchtitan_seq.instrumentation.kv_memory import KVMemory
from torchtitan_seq.runtime.kv_context import KVContext, Unit
from torchtitan_seq.runtime.kv_placement import plan_arenas, slab_extents
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, ScheduleShape
from torchtitan_seq.schedules.ordering import stage_passes

SHAPES = [
    (name, p, n, k, split)
    for name in SEQUENCE_SCHEDULES
    for p, n, k, split in itertools.product((2, 4), (4, 8), (1, 2, 4, 8), (False, True))
    if not (split and SEQUENCE_SCHEDULES[name].parameter_copies > 1)
]


def _stage_orders(name, p, n, k, split):
    """Every stage's passes in the order its rank runs them."""
    order = SEQUENCE_SCHEDULES[name].compute_order(ScheduleShape(p, n, k, split))
    for actions in order.values():
        for stage in sorted({a.stage_index for a in actions if a is not None}):
            yield stage_passes(actions, stage, k)[1]


def _replay(passes, lengths, size, plan):
    """Walk the passes as the KV context does, and return the most positions the arenas' occupants
    use at once; fails on any overlap of two slabs in one arena, or two slabs at one end."""
    extents = slab_extents(lengths, size)
    live: dict[int, set[int]] = {}
    worst = 0
    for forward, m, j in passes:
        (live.setdefault(m, set()).add if forward else live[m].discard)(j)
        used: dict[tuple[int, bool], list[int]] = {}
        for mb, units in live.items():
            if units:
                placed = plan.slabs[mb]
                used.setdefault((placed.arena, placed.descending), []).append(extents[max(units)])
        for (arena, _), at_end in used.items():
            assert len(at_end) == 1, f"two slabs in use at one end of arena {arena}"
        for arena in {a for a, _ in used}:
            total = sum(used.get((arena, side), [0])[0] for side in (False, True))
            assert total <= plan.capacity, (arena, total, plan.capacity)
            worst = max(worst, total)
    return worst


@pytest.mark.parametrize("name,p,n,k,split", SHAPES)
def test_no_two_slabs_overlap_in_an_arena(name, p, n, k, split):
    """For every schedule's stages, uneven lengths: each arena end holds one slab in use at a time,
    and the slabs at its two ends never reach into each other."""
    lengths = [7, 5, 3, 2, 2, 1, 1, 1][:k]
    size = sum(lengths[:-1])
    for passes in _stage_orders(name, p, n, k, split):
        for alternate in (True, False):
            plan = plan_arenas(passes, lengths, size, alternate)
            assert set(plan.slabs) == {m for _, m, _ in passes}
            assert alternate or not any(s.descending for s in plan.slabs.values())
            if size:
                _replay(passes, lengths, size, plan)


@pytest.mark.parametrize("p,k", [(2, 4), (2, 8), (4, 4), (4, 8)])
def test_seq1f1b_arenas_hold_less_than_whole_slabs(p, k):
    """Seq1F1B, N = 2p: rank r keeps k + p - 1 - r units in flight. At p = 2 microbatches overlap two
    at a time, and one arena holds exactly the keys of those units (L each); in every case the arenas
    hold less than a slab of its own per microbatch (k - 1 units each) did."""
    L = 16

    order = SEQUENCE_SCHEDULES["Seq1F1B"].compute_order(ScheduleShape(p, 2 * p, k))
    for r in range(p):
        passes = stage_passes(order[r], r, k)[1]
        plan = plan_arenas(passes, [L] * k, L * (k - 1))
        if p == 2:
            assert len({s.arena for s in plan.slabs.values()}) == 1 and plan.peak == (k + p - 1 - r) * L, (r, plan)
        assert plan.peak < plan_arenas(passes, [L] * k, L * (k - 1), alternate=False).peak, r


def test_terapipe_holds_whole_microbatches():
    """Every forward first: all slabs are whole at once, so nothing is shared."""
    k, lengths = 4, [8] * 4
    order = SEQUENCE_SCHEDULES["TeraPipe"].compute_order(ScheduleShape(2, 4, k))
    plan = plan_arenas(stage_passes(order[0], 0, k)[1], lengths, 24)
    assert plan.capacity == 24 and plan.peak == 4 * 24


@pytest.mark.parametrize("bottom_right", [False, True], ids=["top-left", "bottom-right"])
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "block-causal"])
def test_context_in_a_shared_arena_is_exact(packed, bottom_right):
    """One attention layer run as Seq1F1B's rank 0 runs its units (p 2, N 4, k 4, uneven lengths):
    microbatches share arenas at opposite ends, whatever the kernel (a bottom-right one, flash-attn's,
    reads an ascending slab in one call per unit and a descending one in two), and each one's output and
    q, k, v gradients equal whole-sequence attention, causal or over packed documents (block-causal,
    dense mask)."""
    from bottom_right import BottomRightCpuKernel
    from harness import EOS, packed_tokens
    from torchtitan_seq.attention import SequenceAttention
    from torchtitan_seq.attention.kernels import select_kernel
    from torchtitan_seq.runtime.documents import Documents, document_ids, document_mask

    lengths, n, kk = [12, 9, 7, 4], 4, 4
    seq = sum(lengths)
    passes = stage_passes(SEQUENCE_SCHEDULES["Seq1F1B"].compute_order(ScheduleShape(2, n, kk))[0], 0, kk)[1]
    context, layer = KVContext(lengths), SequenceAttention(0)
    context.expect(passes)
    layer.bind(context, BottomRightCpuKernel() if bottom_right else select_kernel(torch.device("cpu")))
    g = torch.Generator().manual_seed(0)
    ids = [document_ids(packed_tokens(2, seq, g), EOS) for _ in range(n)] if packed else None
    context.documents = [Documents.from_ids(i) for i in ids] if packed else None
    qkv = [[torch.randn(2, h, seq, 8, generator=g, requires_grad=True) for h in (4, 2, 2)] for _ in range(n)]
    weights = [torch.randn(2, 4, seq, 8, generator=g) for _ in range(n)]
    outs, descending, arenas = {}, set(), set()
    for forward, m, j in passes:
        u = Unit(m, j, sum(lengths[:j]), lengths[j], kk)
        part = slice(u.offset, u.offset + u.length)
        if forward:
            with context.running(u):
                outs[m, j] = layer(*(t[:, :, part] for t in qkv[m]), enable_gqa=True)
            descending.add(context.arenas.placement(m).descending)
            arenas.add(context.arenas.placement(m).arena)
        else:
            with context.backward(u):
                (outs[m, j] * weights[m][:, :, part]).sum().backward()
    assert descending == {False, True}
    assert len(arenas) < n  # arenas shared
    assert len(context) == 0 and KVMemory([context]).held() == 0
    for m in range(n):
        q, k, v = (t.detach().requires_grad_() for t in qkv[m])
        mask = document_mask(ids[m]) if packed else None
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=not packed, enable_gqa=True
        )
        ref_grads = torch.autograd.grad((ref * weights[m]).sum(), (q, k, v))
        out = torch.cat([outs[m, j] for j in range(kk)], 2)
        for got, want in zip((out, *(t.grad for t in qkv[m])), (ref, *ref_grads)):
            assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_context_refuses_to_overwrite_keys_still_read():
    """A stage that runs its units in another order than it announced: the next microbatch's write
    would land on keys the previous one still reads, and the context says so."""
    lengths, kk = [4] * 4, 4
    order = SEQUENCE_SCHEDULES["Seq1F1B"].compute_order(ScheduleShape(2, 4, kk))[0]
    context = KVContext(lengths)
    context.expect(stage_passes(order, 0, kk)[1])
    kv = torch.zeros(1, 1, 4, 2)
    with pytest.raises(RuntimeError, match="KVContext.expect"):
        for m, j in itertools.product(range(2), range(kk)):  # both microbatches whole, no backward
            with context.running(Unit(m, j, 4 * j, 4, kk)):
                context.append(0, kv, kv)
