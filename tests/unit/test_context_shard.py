"""Context parallelism inside units (torchtitan_seq.runtime.context_parallel): a CP rank's share of a unit,
the collectives over the CP group, and unit attention over a share's two query chunks against
whole-sequence attention, in every slab layout (ascending and descending arenas)."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from torchtitan_seq.attention import SequenceAttention
from torchtitan_seq.attention.kernels import select_kernel
from torchtitan_seq.runtime.context_parallel import ContextShard
from torchtitan_seq.runtime.kv_context import KVContext, Unit


def test_a_rank_holds_one_chunk_from_each_end():
    shards = [ContextShard(None, r, 4) for r in range(4)]
    assert [s.segments(16, 16) for s in shards] == [
        ((16, 18), (30, 32)),
        ((18, 20), (28, 30)),
        ((20, 22), (26, 28)),
        ((22, 24), (24, 26)),
    ]
    # every position once over the group
    assert sorted(p for s in shards for a, b in s.segments(16, 16) for p in range(a, b)) == list(range(16, 32))
    assert ContextShard().segments(16, 16) == ((16, 32),)
    t = torch.arange(16).view(1, 16)
    assert shards[1].shard(t).tolist() == [[2, 3, 12, 13]]
    with pytest.raises(ValueError, match="multiple of 8"):
        shards[0].segments(0, 12)


def _collectives(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    shard = ContextShard.of_group(dist.group.WORLD)
    whole = torch.randn(2, 3, 8, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(shard.gather(shard.shard(whole, 2)), whole)
    partial = torch.randn(2, 3, 8, 4, generator=torch.Generator().manual_seed(1 + rank))
    total = sum(torch.randn(2, 3, 8, 4, generator=torch.Generator().manual_seed(1 + r)) for r in range(2))
    torch.testing.assert_close(shard.reduce_scatter(partial), shard.shard(total, 2))
    dist.destroy_process_group()


def test_gather_and_reduce_scatter_over_two_ranks():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    mp.start_processes(_collectives, args=(port,), nprocs=2, join=True, start_method="fork")


class _OneRankOfTwo(ContextShard):
    """CP rank ``rank`` of 2 given the whole unit's K/V: gathering them is the identity, and its dK/dV
    (its queries' part, over the whole unit) are kept whole, to be summed over both ranks by the test."""

    def gather(self, share):
        return share

    def reduce_scatter(self, whole):
        return whole


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal to 1e-5 of the reference's largest magnitude: fp32 round-off, whose size depends on the CPU's
    summation order (an absolute 1e-6 failed by 1.2e-6 on values near 3 on an AMD EPYC)."""
    torch.testing.assert_close(actual, expected, atol=1e-5 * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize("bottom_right", [False, True], ids=["top-left", "bottom-right"])
@pytest.mark.parametrize("told", [False, True], ids=["untold", "told-the-order"])
def test_both_ranks_shares_add_up_to_whole_sequence_attention(told, bottom_right):
    """Two microbatches of k = 2 units through one context in a 1F1B order, each in an arena of its own
    or, told the order, the second sharing the first's from its top (descending: a bottom-right kernel,
    flash-attn's, reads it in two calls as torch's top-left one does).
    Each CP rank's output, dq and its part of dk and dv (summed over the ranks) equal SDPA's over the
    whole sequence."""
    from bottom_right import BottomRightCpuKernel

    descending = told
    lengths, s = [8, 8], 16
    g = torch.Generator().manual_seed(0)
    data = [[torch.randn(1, h, s, 4, generator=g) for h in (4, 2, 2, 4)] for _ in range(2)]  # q, k, v, dout
    ref = []
    for q, k, v, w in data:
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        (out * w).sum().backward()
        ref.append((out.detach(), q.grad, k.grad, v.grad))
    passes = [(True, 0, 0), (True, 0, 1), (False, 0, 1), (True, 1, 0), (False, 0, 0), (True, 1, 1)]
    passes += [(False, 1, 1), (False, 1, 0)]
    dkv = [[torch.zeros(2, 1, 2, s, 4) for _ in range(2)] for _ in range(2)]  # per rank and microbatch: dk, dv
    for rank in range(2):
        shard = _OneRankOfTwo(None, rank, 2)
        context = KVContext(lengths, shard)
        if told:
            context.expect(passes)
        layer = SequenceAttention(0)
        layer.bind(context, BottomRightCpuKernel() if bottom_right else select_kernel(torch.device("cpu")))
        outs, inputs = {}, {}
        for forward, m, j in passes:
            unit = Unit(m, j, 8 * j, 8, 2, shard.segments(8 * j, 8))
            rows = torch.cat([torch.arange(a, b) for a, b in unit.segments])
            q, k, v, w = data[m]
            if forward:
                qq = q[:, :, rows].clone().requires_grad_()
                kk, vv = (t[:, :, 8 * j : 8 * j + 8].clone().requires_grad_() for t in (k, v))
                with context.running(unit):
                    outs[m, j] = layer(qq, kk, vv, enable_gqa=True)
                inputs[m, j] = (qq, kk, vv, rows)
                if (m, j) == (1, 0):
                    placed = context.arenas.placement(1)
                    assert placed.descending is descending
                    # ascending, the second's first unit would overwrite keys the first's still reads
                    assert (placed.arena == context.arenas.placement(0).arena) is descending
            else:
                with context.backward(unit):
                    (outs[m, j] * w[:, :, rows]).sum().backward()
        for (m, j), (qq, kk, vv, rows) in inputs.items():
            out, dq, _, _ = ref[m]
            _assert_close(outs[m, j], out[:, :, rows])
            _assert_close(qq.grad, dq[:, :, rows])
            dkv[rank][m][:, :, :, 8 * j : 8 * j + 8] = torch.stack([kk.grad, vv.grad])
    for m in range(2):
        _assert_close(dkv[0][m] + dkv[1][m], torch.stack(ref[m][2:]))
