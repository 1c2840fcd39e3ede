"""The floor: a lower bound of the estimate without the schedule's lists, or with them but without arenas or
a walk (:func:`memory_floor`), which a search asks first.
"""

from __future__ import annotations

import numpy as np

from torchtitan_seq.schedules import SEQUENCE_SCHEDULES
from torchtitan_seq.simulate.memory.actions import action_plan
from torchtitan_seq.simulate.memory.buffers import buffer_bytes_per_token
from torchtitan_seq.simulate.memory.chunks import chunk_layout, memory_chunk_split
from torchtitan_seq.simulate.memory.config import MemoryConfig, dtype_bytes
from torchtitan_seq.simulate.memory.stage_bytes import StageBytes, chain_bytes
from torchtitan_seq.simulate.memory.states import state_rates
from torchtitan_seq.simulate.memory.workspace import workspace_per_token
from torchtitan_seq.simulate.network import chunk_parameters


def memory_floor(config: MemoryConfig, walked: bool = False) -> float:
    """A lower bound of ``predict_memory(config).total`` without the schedule's lists (the first
    estimate of a shape builds its lists and plans its arenas, and every estimate walks them): a
    search asks it first and drops what cannot fit.

    Each rank holds its stages' parameters, gradients and optimizer states, its workspace and its
    receive buffers (a chain's stage receives every unit of the chain's microbatches: N, or N / 2
    in each of two chains), as the estimate counts them; the stages come from the schedule's
    placement (:func:`~torchtitan_seq.simulate.build.stages_by_rank`). Of activations it holds, whatever the schedule,
    every unit of some microbatch on each of its stages of one chain at once, with the microbatch's
    slab and each stage's RoPE table: once the microbatch's last unit has run forward on the rank's
    deepest stage of the chain, its units have all run forward on the shallower ones (a forward
    reads the previous stage's output and, for unit j, the stage's K/V of units 0..j-1), and none
    has run backward on any (a backward needs the next stage's input gradient and, on a stage, the
    dK/dV of the units after it, so the last unit's backward on the deepest stage comes first).
    Other microbatches in flight and the arenas' sharing are left out (under ``kv_offload`` the slab too).
    Chunks of a kind whose layers of bounded reach differ weigh each part as the lightest of them.

    ``walked``: the rank's activations are also at least what its units weigh where it holds the
    most of them (found once per schedule shape, :meth:`ActionPlan.fullest`); this takes the schedule's
    lists, built once per shape as :func:`predict_memory` builds them, but no arenas and no walk."""
    args, c = config.model_args, config
    a = dtype_bytes(c.activation_dtype, "compute_dtype")
    layout = chunk_layout(c.schedule, c.pp, c.shape.stages_per_rank, args.n_layers)
    tokens = [length * c.microbatch_size for length in c.shape.lengths]
    is_sequence = c.schedule in SEQUENCE_SCHEDULES
    rates = state_rates(c)
    received = c.shape.microbatches / layout.copies * sum(c.shape.lengths)  # tokens a chain's stage receives
    chain = chain_bytes(args, c, a, memory_chunk_split(args.n_layers, len(layout.kind)), tokens, is_sequence)
    weights = [_lightest([w for w, kind in zip(chain, layout.kind) if kind == t]) for t in range(len(layout.chunks))]
    params = np.array([chunk_parameters(args, *chunk, c.tp) for chunk in layout.chunks])
    workspace = np.array([workspace_per_token(args, c, a, chunk, is_sequence) for chunk in layout.chunks])
    buffers = np.array([buffer_bytes_per_token(args, c, a, chunk) for chunk in layout.chunks]) * received
    # Under kv_offload a microbatch's slab may be on the host while its units are held on other stages.
    slab = 0.0 if c.kv_offload else 1.0
    microbatch = np.array(
        [sum(w.saved) + slab * (w.held + w.slab) + w.constant + w.latents + w.reach_held for w in weights]
    )

    base = (
        layout.count @ params * (rates.parameters + rates.gradients)
        + layout.primary @ params * rates.optimizer
        + np.max(np.where(layout.count > 0, workspace, 0.0), axis=1) * max(tokens) / c.cp
        + layout.count @ buffers
    )
    floor = base + (layout.per_chain @ microbatch).max(axis=1)  # (ranks,)
    if walked:
        shape = c.shape
        plan = action_plan(
            c.schedule, c.pp, shape.microbatches, shape.num_subsequences, shape.stages_per_rank, c.split_backward
        )
        live, holding = plan.fullest(shape.num_subsequences, args.n_layers)  # (ranks, kinds, k), (ranks, kinds)
        saved, constant = np.array([w.saved for w in weights]), np.array([w.constant for w in weights])
        units = np.einsum("rtj,tj->r", live, saved) + holding @ constant
        scale = np.where(plan.forwards_first, shape.microbatches / plan.built_microbatches, 1.0)
        floor = np.maximum(floor, base + units * scale)
    # The estimate rounds five sums of the fullest rank to bytes: 3 bytes below, the floor is below it.
    return float(floor.max()) - 3


def _lightest(weights: list[StageBytes]) -> StageBytes:
    """Each part of ``weights`` (of stages of one kind of chunk) at its least."""
    return StageBytes(
        list(np.min([w.saved for w in weights], axis=0)),
        *(min(w[i] for w in weights) for i in range(1, len(StageBytes._fields))),
    )
