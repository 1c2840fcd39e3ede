"""Mutations: each breaks one mechanism of exactness on purpose.

A mutation is a set of ``unittest.mock`` patches applied on every rank while
the exactness harness (:mod:`harness`) runs a schedule; ``test_mutations.py``
asserts that each one misses the full-sequence reference by a wide margin.
A mechanism whose mutation passes is not guarded by the exactness tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import torch
import torch.distributed as dist

__all__ = ["MutationContext", "MUTATIONS", "patches"]


@dataclass
class MutationContext:
    """What a mutation may need to know about the run it breaks."""

    schedule: str
    units_per_step: int  # units over all data-parallel ranks: a per-unit mean divides by this
    tp_group: dist.ProcessGroup | None


def _prefix_grads(keep_k: bool, keep_v: bool) -> list:
    """Later units' dK or dV never reach the prefix they read."""
    from torchtitan_seq.kv_context import KVSlab

    accumulate = KVSlab.accumulate

    def dropped(self, grad_k, grad_v, rows, start):
        accumulate(
            self,
            grad_k if keep_k else torch.zeros_like(grad_k),
            grad_v if keep_v else torch.zeros_like(grad_v),
            rows,
            start,
        )

    return [mock.patch.object(KVSlab, "accumulate", dropped)]


def _prefix_dq(ctx: MutationContext) -> list:
    """The queries' gradient from the prefix blocks (the unmasked kernel calls) is dropped."""
    from torchtitan_seq.kernels import CpuSdpaKernel

    backward = CpuSdpaKernel.backward

    def no_prefix_dq(self, dout, q, k, v, out, lse, causal, scale):
        dq, dk, dv = backward(self, dout, q, k, v, out, lse, causal, scale)
        return (dq if causal else torch.zeros_like(dq)), dk, dv

    return [mock.patch.object(CpuSdpaKernel, "backward", no_prefix_dq)]


def _rope_offset(ctx: MutationContext) -> list:
    """Units after the first read RoPE one position too early."""
    from torchtitan_seq.models.llama3_seq import model

    positions = model.unit_positions

    def shifted(unit, device):
        return positions(unit, device) - int(unit.index > 0)

    return [mock.patch.object(model, "unit_positions", shifted)]


def _backward_order(ctx: MutationContext) -> list:
    """Every backward kind runs in subsequence order on each stage (rule 2 broken); the
    validator that would refuse such lists is switched off."""
    from torchtitan_seq.ordering import F
    from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, base

    cls = SEQUENCE_SCHEDULES[ctx.schedule]
    actions_fn = cls.actions_fn

    def first_subsequence_first(actions):
        queues = {}
        for a in actions:
            if a.computation_type != F:
                queues.setdefault((a.stage_index, a.computation_type), []).append(a.microbatch_index)
        queues = {key: iter(sorted(ids)) for key, ids in queues.items()}
        return [
            a
            if a.computation_type == F
            else a._replace(microbatch_index=next(queues[a.stage_index, a.computation_type]))
            for a in actions
        ]

    def misordered(*args, **kwargs):
        return {r: first_subsequence_first(acts) for r, acts in actions_fn(*args, **kwargs).items()}

    return [
        mock.patch.object(cls, "actions_fn", staticmethod(misordered)),
        mock.patch.object(base, "validate_unit_order", lambda *a: None),
    ]


def _unit_mean_loss(ctx: MutationContext) -> list:
    """Each unit's loss is its token mean over the number of units, not its token sum over
    the step's tokens: the same for even units, wrong for uneven ones."""
    from torchtitan_seq.loss import TokenNormalizedLoss

    def unit_mean(self, pred, target):
        return self.loss_fn(pred, target) / target.numel() / ctx.units_per_step

    return [mock.patch.object(TokenNormalizedLoss, "__call__", unit_mean)]


def _recompute_without_prefix(ctx: MutationContext) -> list:
    """Recomputation under activation checkpointing attends to no prefix: its calls over the
    prefix (unmasked: torch's CPU kernel aligns causal masks top-left) are dropped."""
    import sys

    from torchtitan_seq import attention
    from torchtitan_seq.kv_context import Phase

    calls = attention._calls

    def without_prefix(documents, segments, bottom_right):
        causal, prefix = calls(documents, segments, bottom_right)
        caller = sys._getframe(1)  # the forward op, in the phase the KV context gave it
        recomputing = caller.f_code.co_name == "_unit_attention" and caller.f_locals.get("phase") is Phase.RECOMPUTE
        return causal, [] if recomputing else prefix

    return [mock.patch.object(attention, "_calls", without_prefix)]


def _split_w_without_kv_grad(ctx: MutationContext) -> list:
    """With split backward, the input pass does not hand a unit the K/V gradient of later
    units, so its weight pass computes wk/wv gradients without it."""
    from torchtitan_seq.kv_context import KVSlab
    from torchtitan_seq.stage import SequencePipelineStage

    backward_one_chunk = SequencePipelineStage.backward_one_chunk

    def input_pass_drops_side_buffers(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        if full_backward:
            return backward_one_chunk(self, bwd_chunk_id, loss, full_backward, last_backward)
        with mock.patch.object(KVSlab, "take", lambda slab, offset, length: (None, None)):
            return backward_one_chunk(self, bwd_chunk_id, loss, full_backward, last_backward)

    return [mock.patch.object(SequencePipelineStage, "backward_one_chunk", input_pass_drops_side_buffers)]


def _tp_wrong_shard(ctx: MutationContext) -> list:
    """Under tensor parallelism each rank's KV context keeps its TP neighbour's K/V heads."""
    from torchtitan_seq.kv_context import KVSlab

    write = KVSlab.write
    group = ctx.tp_group

    def neighbours(self, offset, k, v):
        size, me = dist.get_world_size(group), dist.get_rank(group)
        shards = []
        for t in (k.detach().contiguous(), v.detach().contiguous()):
            gathered = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(gathered, t, group=group)
            shards.append(gathered[(me + 1) % size])
        write(self, offset, *shards)

    return [mock.patch.object(KVSlab, "write", neighbours)]


def _slab_offset(ctx: MutationContext) -> list:
    """Every unit after the first writes its K/V into the slab one position early (its last
    key written twice, so no position is left unwritten)."""
    from torchtitan_seq.kv_context import KVSlab

    write = KVSlab.write

    def one_early(self, offset, k, v):
        write(self, max(offset - 1, 0), k, v)
        if offset:
            write(self, offset + k.shape[2] - 1, k[:, :, -1:], v[:, :, -1:])

    return [mock.patch.object(KVSlab, "write", one_early)]


def _pairs_not_combined(ctx: MutationContext) -> list:
    """BSIPipe, Chimera: a chunk's two copies keep their own gradients; nothing adds them up."""
    from torchtitan_seq.schedules import MirroredCopies

    return [mock.patch.object(MirroredCopies, "combine_gradients", lambda self: None)]


def _copies_not_synced(ctx: MutationContext) -> list:
    """BSIPipe, Chimera: after an optimizer step the chain-B copies keep their old values."""
    from torchtitan_seq.schedules import MirroredCopies

    return [mock.patch.object(MirroredCopies, "sync_parameters", lambda self: None)]


def _across_documents(ctx: MutationContext) -> list:
    """Packed documents: a unit's queries read the whole prefix, across document boundaries."""
    from torchtitan_seq.documents import Documents

    return [mock.patch.object(Documents, "start_of", lambda self, row, position: 0)]


def _cp_shard_left_out(ctx: MutationContext) -> list:
    """Context parallelism: a unit's gathered K/V miss the last CP rank's share (zeros there)."""
    from torchtitan_seq.context_parallel import ContextShard

    gather = ContextShard.gather

    def without_last(self, share):
        whole = gather(self, share)
        for a, b in ContextShard(None, self.size - 1, self.size).segments(0, whole.shape[2]):
            whole[:, :, a:b] = 0
        return whole

    return [mock.patch.object(ContextShard, "gather", without_last)]


def _cp_kv_grads_local(ctx: MutationContext) -> list:
    """Context parallelism: each CP rank keeps its own queries' dK/dV of its positions; nothing is
    summed over the CP group."""
    from torchtitan_seq.context_parallel import ContextShard

    return [mock.patch.object(ContextShard, "reduce_scatter", lambda self, whole: self.shard(whole, 2))]


def _cp_second_chunk_positions(ctx: MutationContext) -> list:
    """Context parallelism: RoPE reads the second chunk of a CP rank's share one position early."""
    from torchtitan_seq.models.llama3_seq import model

    positions = model.unit_positions

    def second_off(unit, device):
        p = positions(unit, device)
        if unit.queries is not None:
            p[:, p.shape[1] // 2 :] -= 1
        return p

    return [mock.patch.object(model, "unit_positions", second_off)]


MUTATIONS: dict[str, Callable[[MutationContext], list]] = {
    "prefix_dk_dropped": lambda ctx: _prefix_grads(keep_k=False, keep_v=True),
    "prefix_dv_dropped": lambda ctx: _prefix_grads(keep_k=True, keep_v=False),
    "prefix_dq_dropped": _prefix_dq,
    "rope_offset": _rope_offset,
    "backward_order": _backward_order,
    "unit_mean_loss": _unit_mean_loss,
    "recompute_without_prefix": _recompute_without_prefix,
    "split_w_without_kv_grad": _split_w_without_kv_grad,
    "tp_wrong_shard": _tp_wrong_shard,
    "pairs_not_combined": _pairs_not_combined,
    "copies_not_synced": _copies_not_synced,
    "across_documents": _across_documents,
    "slab_offset": _slab_offset,
    "cp_shard_left_out": _cp_shard_left_out,
    "cp_kv_grads_local": _cp_kv_grads_local,
    "cp_second_chunk_positions": _cp_second_chunk_positions,
}


def patches(name: str | None, ctx: MutationContext) -> list:
    """The patches of mutation ``name`` (none for ``None``), not yet started."""
    return MUTATIONS[name](ctx) if name else []
