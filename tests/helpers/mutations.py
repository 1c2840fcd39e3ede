"""Mutations: each breaks one mechanism of exactness on purpose.

A mutation is a set of ``unittest.mock`` patches applied on every rank while
the exactness harness (:mod:`harness`) runs a schedule; ``test_mutations.py``
asserts that each one misses the full-sequence reference by a wide margin.
A mechanism whose mutation passes is not guarded by the exactness tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import torch
import torch.distributed as dist

__all__ = ["MutationContext", "MUTATIONS", "PROPERTY_MUTATIONS", "patches"]


@dataclass
class MutationContext:
    """What a mutation may need to know about the run it breaks."""

    schedule: str
    units_per_step: int  # units over all data-parallel ranks: a per-unit mean divides by this
    tp_group: dist.ProcessGroup | None
    replicate_group: dist.ProcessGroup | None = None  # HSDP's replicas


def _prefix_grads(keep_k: bool, keep_v: bool) -> list:
    """Later units' dK or dV never reach the prefix they read."""
    from torchtitan_seq.runtime.kv_slab import KVSlab

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
    from torchtitan_seq.attention.kernels import CpuSdpaKernel

    backward = CpuSdpaKernel.backward

    def no_prefix_dq(self, dout, q, k, v, out, lse, causal, scale, band=None):
        dq, dk, dv = backward(self, dout, q, k, v, out, lse, causal, scale, band)
        return (dq if causal else torch.zeros_like(dq)), dk, dv

    return [mock.patch.object(CpuSdpaKernel, "backward", no_prefix_dq)]


def _rope_offset(ctx: MutationContext) -> list:
    """Units after the first read RoPE one position too early."""
    from torchtitan_seq.runtime import rope

    positions = rope.unit_positions

    def shifted(unit, device):
        return positions(unit, device) - int(unit.index > 0)

    return [mock.patch.object(rope, "unit_positions", shifted)]


def _backward_order(ctx: MutationContext) -> list:
    """Every backward kind runs in subsequence order on each stage (rule 2 broken); the
    validator that would refuse such lists is switched off."""
    from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, base
    from torchtitan_seq.schedules.ordering import F

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
    from torchtitan_seq.runtime.loss import TokenNormalizedLoss

    def unit_mean(self, pred, target):
        return self.loss_fn(pred, target) / target.numel() / ctx.units_per_step

    return [mock.patch.object(TokenNormalizedLoss, "__call__", unit_mean)]


def _recompute_without_prefix(ctx: MutationContext) -> list:
    """Recomputation under activation checkpointing attends to no prefix: its calls over the
    prefix (unmasked: torch's CPU kernel aligns causal masks top-left) are dropped (and so, the unit's
    calls being built once for it, from the backward that follows)."""
    import sys

    from torchtitan_seq.attention import unit_op
    from torchtitan_seq.runtime.kv_context import Phase

    calls = unit_op.kernel_calls

    def without_prefix(documents, segments, bottom_right, reach):
        causal, prefix = calls(documents, segments, bottom_right, reach)
        caller = sys._getframe(2)  # the forward op (through unit_calls), in the phase the KV context gave it
        recomputing = caller.f_code.co_name == "_unit_attention" and caller.f_locals.get("phase") is Phase.RECOMPUTE
        return causal, [] if recomputing else prefix

    return [mock.patch.object(unit_op, "kernel_calls", without_prefix)]


def _split_w_without_kv_grad(ctx: MutationContext) -> list:
    """With split backward, the input pass does not hand a unit the K/V gradient of later
    units, so its weight pass computes wk/wv gradients without it."""
    from torchtitan_seq.runtime.kv_slab import KVSlab
    from torchtitan_seq.schedules.stage import SequencePipelineStage

    backward_one_chunk = SequencePipelineStage.backward_one_chunk

    def input_pass_drops_side_buffers(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        if full_backward:
            return backward_one_chunk(self, bwd_chunk_id, loss, full_backward, last_backward)
        with mock.patch.object(KVSlab, "add_sent", lambda slab, dk, dv, offset: None):
            return backward_one_chunk(self, bwd_chunk_id, loss, full_backward, last_backward)

    return [mock.patch.object(SequencePipelineStage, "backward_one_chunk", input_pass_drops_side_buffers)]


def _tp_wrong_shard(ctx: MutationContext) -> list:
    """Under tensor parallelism each rank's KV context keeps its TP neighbour's K/V heads."""
    from torchtitan_seq.runtime.kv_slab import KVSlab

    write = KVSlab.write
    group = ctx.tp_group

    def neighbours(self, offset, k, v):
        size, me = dist.get_world_size(group), dist.get_rank(group)
        shards = []
        for t in (k.detach().contiguous(), v.detach().contiguous()):
            gathered = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(gathered, t, group=group)
            shards.append(gathered[(me + 1) % size])
        return write(self, offset, *shards)

    return [mock.patch.object(KVSlab, "write", neighbours)]


def _slab_offset(ctx: MutationContext) -> list:
    """Every unit after the first writes its K/V into the slab one position early (its last
    key written twice, so no position is left unwritten)."""
    from torchtitan_seq.runtime.kv_slab import KVSlab

    write = KVSlab.write

    def one_early(self, offset, k, v):
        write(self, max(offset - 1, 0), k, v)
        if offset:
            write(self, offset + k.shape[2] - 1, k[:, :, -1:], v[:, :, -1:])
        return self.keys(offset, offset + k.shape[2])

    return [mock.patch.object(KVSlab, "write", one_early)]


def _pairs_not_combined(ctx: MutationContext) -> list:
    """BSIPipe, Chimera: a chunk's two copies keep their own gradients; nothing adds them up."""
    from torchtitan_seq.schedules import MirroredCopies

    return [mock.patch.object(MirroredCopies, "combine_gradients", lambda self: None)]


def _copies_not_synced(ctx: MutationContext) -> list:
    """BSIPipe, Chimera: after an optimizer step the chain-B copies keep their old values."""
    from torchtitan_seq.schedules import MirroredCopies

    return [mock.patch.object(MirroredCopies, "sync_parameters", lambda self: None)]


def _replicas_not_reduced(ctx: MutationContext) -> list:
    """HSDP: FSDP reduces each stage's gradients over its shards but not over the replicas, so each
    replica keeps the gradients of its own rows."""
    all_reduce = dist.all_reduce

    def over_shards_only(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if group is ctx.replicate_group:
            return None
        return all_reduce(tensor, op=op, group=group, async_op=async_op)

    return [mock.patch.object(dist, "all_reduce", over_shards_only)]


def _across_documents(ctx: MutationContext) -> list:
    """Packed documents: a unit's queries read the whole prefix, across document boundaries."""
    from torchtitan_seq.runtime.documents import Documents

    return [mock.patch.object(Documents, "start_of", lambda self, row, position: 0)]


def _cp_shard_left_out(ctx: MutationContext) -> list:
    """Context parallelism: a unit's gathered K/V miss the last CP rank's share (zeros there)."""
    from torchtitan_seq.runtime.context_parallel import ContextShard

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
    from torchtitan_seq.runtime.context_parallel import ContextShard

    return [mock.patch.object(ContextShard, "reduce_scatter", lambda self, whole: self.shard(whole, 2))]


def _cp_second_chunk_positions(ctx: MutationContext) -> list:
    """Context parallelism: RoPE reads the second chunk of a CP rank's share one position early."""
    from torchtitan_seq.runtime import rope

    positions = rope.unit_positions

    def second_off(unit, device):
        p = positions(unit, device)
        if unit.queries is not None:
            p[:, p.shape[1] // 2 :] -= 1
        return p

    return [mock.patch.object(rope, "unit_positions", second_off)]


def _bottom_right_descending(ctx: MutationContext) -> list:
    """A kernel that aligns causal masks bottom-right reads a slab laid out last position first (a
    microbatch sharing an arena from its top) in one causal call, as if it were ascending."""
    from torchtitan_seq.attention import unit_op

    def any_order(kernel, slab, unit):
        return kernel.bottom_right and slab.holds(unit.offset + unit.length)

    return [mock.patch.object(unit_op, "_one_call", any_order)]


def _host_read_in_units(ctx: MutationContext) -> list:
    """Not a break of exactness: each unit reads a value of its keys on the host as it appends them (a
    device sync per unit and layer on a GPU), which every exactness test's host-read check refuses."""
    from torchtitan_seq.runtime.kv_context import KVContext

    append = KVContext.append

    def reading(self, layer_id, k, v, *args, **kwargs):
        k.sum().item()
        return append(self, layer_id, k, v, *args, **kwargs)

    return [mock.patch.object(KVContext, "append", reading)]


def _inference_counts_kept(ctx: MutationContext) -> list:
    """The stages' metadata inference (torch's, on the first step) leaves what it changed in the chunks'
    buffers: an MoE layer's tokens per expert count its made-up tokens too."""
    from torchtitan_seq.runtime import torch_internals

    def prepare(self, num_microbatches, *args, **kwargs):
        out = torch_internals.PipelineStage._prepare_forward_infra(self, num_microbatches, *args, **kwargs)
        self.resize_receives(self.args_recv_info)
        return out

    return [mock.patch.object(torch_internals.UnitStageBase, "_prepare_forward_infra", prepare)]


def _unit_reach(change: Callable) -> list:
    """Unit attention reads within ``change(reach, segments)`` in place of each layer's reach."""
    from torchtitan_seq.attention import unit_op

    kernel_calls = unit_op.kernel_calls

    def changed(documents, segments, bottom_right, reach):
        return kernel_calls(documents, segments, bottom_right, change(reach, segments))

    return [mock.patch.object(unit_op, "kernel_calls", changed)]


def _window_off_by_one(ctx: MutationContext) -> list:
    """Sliding windows (gpt-oss's) stop one key short of torchtitan's mask (one key further back reads
    outside what the slab keeps of a windowed layer, which the slab refuses)."""
    from torchtitan_seq.runtime.reach import Reach

    return _unit_reach(lambda reach, segments: reach if reach.window is None else Reach(window=reach.window - 1))


def _reach_copy_last_key_zeroed(ctx: MutationContext) -> list:
    """A bounded layer's copied slab (under checkpointing, in its arena) holds zeros for each unit's last key,
    the one next to the unit's end that the next unit's window reads first."""
    from torchtitan_seq.runtime import kv_reach

    write = kv_reach.ReachSlab.write

    def zeroed(self, offset, k, v):
        k = k.detach().clone()
        k[:, :, -1] = 0
        write(self, offset, k, v)

    return [mock.patch.object(kv_reach.ReachSlab, "write", zeroed)]


def _chunk_boundary_at_unit_start(ctx: MutationContext) -> list:
    """Attention chunks (Llama 4's) start over at each unit's start, not at multiples of the chunk size."""
    from torchtitan_seq.runtime.reach import Reach

    @dataclasses.dataclass(frozen=True)
    class FromUnitStart(Reach):
        start: int = 0

        def chunk_starts(self, begin: int, end: int) -> tuple[int, ...]:
            return (0, *range(self.start, end, self.chunk))

    def change(reach, segments):
        start = segments[0][0]
        return reach if reach.chunk is None or start % reach.chunk == 0 else FromUnitStart(None, reach.chunk, start)

    return _unit_reach(change)


def _sink_per_call(ctx: MutationContext) -> list:
    """Attention sinks (gpt-oss's) are merged into each kernel call's partial output before the calls
    are merged, so a query whose keys take two calls counts its sink twice."""
    from torchtitan_seq.attention import calls, unit_op

    attention_forward = unit_op.attention_forward

    class SinkEachCall:
        def __init__(self, kernel, sinks) -> None:
            self.kernel, self.sinks = kernel, sinks

        def forward(self, *args):
            out, lse = self.kernel.forward(*args)
            calls.merge_sinks(out, lse, self.sinks)
            return out, lse

    def per_call(kernel, q, keys, causal, prefix, scale, sinks=None):
        if sinks is None:
            return attention_forward(kernel, q, keys, causal, prefix, scale)
        return attention_forward(SinkEachCall(kernel, sinks), q, keys, causal, prefix, scale)

    return [mock.patch.object(unit_op, "attention_forward", per_call)]


def _mla_rope_at_sequence_positions(ctx: MutationContext) -> list:
    """DeepSeek-V3's decoupled RoPE part reads each unit at positions 0..L-1, not at its own."""
    from torchtitan.models.deepseek_v3.model import model

    apply_rotary_emb = model.apply_rotary_emb

    def local(x, freqs_cis, positions=None):
        return apply_rotary_emb(x, freqs_cis)

    return [mock.patch.object(model, "apply_rotary_emb", local)]


def _kv_offload_not_copied_out(ctx: MutationContext) -> list:
    """The K/V offload frees an arena without copying it out: the copy back brings what the host buffer held
    (zeros), stale K/V for the units that read it next."""
    from torchtitan_seq.runtime.kv_offload import KVOffload

    copy = KVOffload._copy

    def stale(self, pairs, out):
        if out:
            for _, host in pairs:
                host.fill_(0)
            return None
        return copy(self, pairs, out)

    return [mock.patch.object(KVOffload, "_copy", stale)]


def _latent_prefix_grad_dropped(ctx: MutationContext) -> list:
    """Under kv_context "latent", the gradient a unit sends its prefix's latent and RoPE key never reaches the
    units that wrote them (wkv_b's gradient from the expansion stays)."""
    from torchtitan_seq.runtime.kv_latent import LatentSlab

    accumulate = LatentSlab.accumulate

    def dropped(self, grad_latent, grad_rope):
        accumulate(self, *(None if g is None else torch.zeros_like(g) for g in (grad_latent, grad_rope)))

    return [mock.patch.object(LatentSlab, "accumulate", dropped)]


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
    "replicas_not_reduced": _replicas_not_reduced,
    "across_documents": _across_documents,
    "slab_offset": _slab_offset,
    "cp_shard_left_out": _cp_shard_left_out,
    "cp_kv_grads_local": _cp_kv_grads_local,
    "cp_second_chunk_positions": _cp_second_chunk_positions,
    "bottom_right_descending": _bottom_right_descending,
    "host_read_in_units": _host_read_in_units,
    "inference_counts_kept": _inference_counts_kept,
    "window_off_by_one": _window_off_by_one,
    "reach_copy_last_key_zeroed": _reach_copy_last_key_zeroed,
    "chunk_boundary_at_unit_start": _chunk_boundary_at_unit_start,
    "sink_per_call": _sink_per_call,
    "mla_rope_at_sequence_positions": _mla_rope_at_sequence_positions,
    "latent_prefix_grad_dropped": _latent_prefix_grad_dropped,
    "kv_offload_not_copied_out": _kv_offload_not_copied_out,
}


# Mutations of the mechanisms the property tests guard (tests/unit/test_property_mutations.py runs
# each property under its mutation and asserts that it fails).


def _guard_other_end_only() -> list:
    """The K/V arenas' overwrite guard looks only at the microbatch at the arena's other end, not at one
    that still holds the same end (a stage running its units out of the announced order)."""
    from torchtitan_seq.runtime.kv_arena import KVArenas

    def other_end_only(self, microbatch, index, offset, length, kind=None):
        capacity, placed = self._placed.get((kind, microbatch), (0, None))
        if placed is None or placed.arena < 0:
            return
        for (other_kind, m), (_, other) in self._placed.items():
            same_end = other.descending == placed.descending
            if other_kind is not kind or m == microbatch or other.arena != placed.arena or same_end:
                continue
            live = self._live.get(m)
            theirs = self.plans[kind][1][max(live)] if live else 0
            if offset + length + theirs > capacity:
                raise RuntimeError(f"K/V arena {placed.arena}: would overwrite keys microbatch {m} still reads")

    return [mock.patch.object(KVArenas, "check_room", other_end_only)]


def _guard_own_unit_left_out() -> list:
    """The guard counts the other microbatch's keys up to its last unit in flight, less that unit's own."""
    from torchtitan_seq.runtime.kv_arena import KVArenas

    check_room = KVArenas.check_room

    def short(self, microbatch, index, offset, length, kind=None):
        plans = dict(self.plans)
        plan, extents = self.plans[kind] if kind in self.plans else (None, ())
        self.plans[kind] = plan, (0, *extents[:-1])
        try:
            check_room(self, microbatch, index, offset, length, kind)
        finally:
            self.plans = plans

    return [mock.patch.object(KVArenas, "check_room", short)]


def _shape_cp_tp_apart() -> list:
    """The job shape cuts units on lcm(length_multiple, TP, 2 CP), as if each CP chunk need not be
    divisible by TP (the same as lcm(.., 2 CP TP) when TP and 2 CP share no factor)."""
    import math

    from torchtitan_seq.runtime.shape import JobShape

    multiple = property(lambda self: math.lcm(self.length_multiple, self.tp, 2 * self.cp if self.cp > 1 else 1))
    return [mock.patch.object(JobShape, "multiple", multiple)]


def _planner_bound_low() -> list:
    """The planner's bound (its stop rule's test) falls 2% below what a candidate can reach."""
    from torchtitan_seq.plan import bounds, search

    candidates = bounds.candidates_of

    def low(*args, **kwargs):
        return [dataclasses.replace(c, bound=0.98 * c.bound) for c in candidates(*args, **kwargs)]

    return [mock.patch.object(search, "candidates_of", low)]


def _planner_twins_by_tp_only() -> list:
    """Twin pruning takes a configuration with no more TP for a lighter twin, whatever its CP and AC."""
    from torchtitan_seq.plan import search, twins

    def by_tp(lighter, degrees):
        return lighter[0] <= degrees[0]

    return [mock.patch.object(twins, "no_heavier", by_tp), mock.patch.object(search, "no_heavier", by_tp)]


def _planner_tp_degrees_short() -> list:
    """The search's TP degrees leave out 8: a node of 8 GPUs is never one TP group."""
    from torchtitan_seq.plan import bounds

    return [mock.patch.object(bounds, "TP_DEGREES", (1, 2, 4))]


def _planner_cp_degrees_short() -> list:
    """The search's CP degrees leave out 8, which ``Job.cp`` promises to search."""
    from torchtitan_seq.plan import bounds

    return [mock.patch.object(bounds, "CP_DEGREES", (1, 2, 4))]


def _planner_pp_range_short() -> list:
    """The pipeline degrees stop one short: the deepest, min(layers, GPUs / TP), is never searched."""
    from torchtitan_seq.plan import bounds, search

    meshes = bounds.candidate_meshes

    def short(job, cluster, args):
        return [m for m in meshes(job, cluster, args) if m[0] < min(args.n_layers, cluster.gpus // m[1])]

    return [mock.patch.object(bounds, "candidate_meshes", short), mock.patch.object(search, "candidate_meshes", short)]


def _planner_ranks_over_part_of_a_node() -> list:
    """The search splits the GPUs into pipeline ranks that neither share a node nor fill whole nodes,
    which the network model cannot place."""
    from torchtitan_seq.plan import bounds

    return [mock.patch.object(bounds, "_placed", lambda gpus_per_rank, gpus_per_node: True)]


def _planner_memory_at_simulated_microbatches() -> list:
    """The memory model sizes a candidate at the microbatches its step is simulated at, min(N, 2p), not N."""
    from torchtitan_seq.plan import memory_check

    config = memory_check.memory_config

    def simulated(job, cluster, choice, pp, tp, ac, cp, option=None):
        out = config(job, cluster, choice, pp, tp, ac, cp, option)
        microbatches = min(out.shape.microbatches, 2 * pp)
        return dataclasses.replace(out, shape=dataclasses.replace(out.shape, microbatches=microbatches))

    return [mock.patch.object(memory_check, "memory_config", simulated)]


def _planner_network_without_dp() -> list:
    """The simulator's network takes a pipeline rank for its TP x CP GPUs, leaving out its data-parallel ones."""
    from torchtitan_seq.plan import costs, measure

    network = costs.step_network

    def without_dp(cluster, step_costs, tp, cp, dp):
        return network(cluster, step_costs, tp, cp, 1)

    return [mock.patch.object(measure, "step_network", without_dp)]


def _memory_arenas_unshared() -> list:
    """The memory model places every slab in an arena of its own, as if no two microbatches shared one."""
    import functools

    from torchtitan_seq.runtime.kv_placement import plan_arenas
    from torchtitan_seq.simulate.memory import arenas

    return [mock.patch.object(arenas, "plan_arenas", functools.partial(plan_arenas, alternate=False))]


def _memory_arenas_without_own() -> list:
    """Under CP the memory model's slabs leave out the last unit's K/V, which CP ranks read as a prefix."""
    from torchtitan_seq.simulate.memory import arenas

    arena_events = arenas.slab_arena_events

    def without_own(count, stages, lengths, with_own=False):
        return arena_events(count, stages, lengths)

    return [mock.patch.object(arenas, "slab_arena_events", without_own)]


def _job_check_fsdp_without_cp() -> list:
    """The 0.2.2 job check counts FSDP's ranks without the CP ranks, which torchtitan shards over too."""
    from torchtitan_seq.titan.v022 import job_check

    def without_cp(parallelism, world_size):
        par = parallelism
        fixed = par.data_parallel_replicate_degree * par.tensor_parallel_degree * par.pipeline_parallel_degree
        return world_size // (fixed * par.context_parallel_degree)

    return [mock.patch.object(job_check, "_fsdp_degree", without_cp)]


def _job_check_replicas_cast() -> list:
    """The 0.2.2 job check takes replicated data parallelism for FSDP (which casts the parameters)."""
    from torchtitan_seq.titan.v022 import job_check

    def with_replicas(parallelism, world_size):
        return world_size // (parallelism.tensor_parallel_degree * parallelism.pipeline_parallel_degree)

    return [mock.patch.object(job_check, "_fsdp_degree", with_replicas)]


def _job_check_float32_units_on_cuda() -> list:
    """The job check takes float32 for a dtype the CUDA attention kernels accept."""
    from torchtitan_seq.titan import job_rules
    from torchtitan_seq.titan.v022 import job_check

    rule = job_rules.check_unit_precision

    def float32_too(schedule, pp_degree, activations, why, fix):
        rule(schedule, pp_degree, "bfloat16" if activations == "float32" else activations, why, fix)

    return [mock.patch.object(job_check, "check_unit_precision", float32_too)]


def _reach_views_kept() -> list:
    """A bounded layer's slab of views keeps every unit's views until the microbatch ends (each unit's own
    K/V, which autograd frees with its backward, outlive it)."""
    from torchtitan_seq.runtime import kv_reach

    return [mock.patch.object(kv_reach.ReachViews, "add_sent", kv_reach.ReachSlab.add_sent)]


def _reach_views_under_checkpointing() -> list:
    """A bounded layer's slab is views of the units' K/V under checkpointing too (which does not keep them:
    the views would, uncounted)."""
    from torchtitan_seq.runtime import kv_context

    return [mock.patch.object(kv_context, "top_saved_tensors_hooks", lambda ignore_tracing: None)]


def _reach_arenas_unshared() -> list:
    """The runtime plans the copied slabs of a bounded reach in arenas that no two microbatches share."""
    from torchtitan_seq.runtime import kv_arena
    from torchtitan_seq.runtime.kv_placement import plan_arenas, slab_extents

    def unshared(passes, lengths, size, alternate=True, extents=None):
        full = extents is None or tuple(extents) == tuple(slab_extents(lengths, size))
        return plan_arenas(passes, lengths, size, alternate and full, extents)

    return [mock.patch.object(kv_arena, "plan_arenas", unshared)]


PROPERTY_MUTATIONS: dict[str, Callable[[], list]] = {
    "reach_arenas_unshared": _reach_arenas_unshared,
    "reach_views_kept": _reach_views_kept,
    "reach_views_under_checkpointing": _reach_views_under_checkpointing,
    "guard_other_end_only": _guard_other_end_only,
    "guard_own_unit_left_out": _guard_own_unit_left_out,
    "shape_cp_tp_apart": _shape_cp_tp_apart,
    "planner_bound_low": _planner_bound_low,
    "planner_twins_by_tp_only": _planner_twins_by_tp_only,
    "planner_tp_degrees_short": _planner_tp_degrees_short,
    "planner_cp_degrees_short": _planner_cp_degrees_short,
    "planner_pp_range_short": _planner_pp_range_short,
    "planner_ranks_over_part_of_a_node": _planner_ranks_over_part_of_a_node,
    "planner_memory_at_simulated_microbatches": _planner_memory_at_simulated_microbatches,
    "planner_network_without_dp": _planner_network_without_dp,
    "memory_arenas_unshared": _memory_arenas_unshared,
    "memory_arenas_without_own": _memory_arenas_without_own,
    "job_check_fsdp_without_cp": _job_check_fsdp_without_cp,
    "job_check_replicas_cast": _job_check_replicas_cast,
    "job_check_float32_units_on_cuda": _job_check_float32_units_on_cuda,
}


def patches(name: str | None, ctx: MutationContext) -> list:
    """The patches of mutation ``name`` (none for ``None``), not yet started."""
    return MUTATIONS[name](ctx) if name else []
