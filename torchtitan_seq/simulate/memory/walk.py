"""The activation peaks: each rank's actions walked in order, the bytes of what each saves and frees
summed (memory on a rank depends only on the order of its own actions, not on their timing).
"""

from __future__ import annotations

import numpy as np

from torchtitan_seq.simulate.memory.actions import ActionPlan
from torchtitan_seq.simulate.memory.stage_bytes import StageBytes


def memory_walks(
    plan: ActionPlan,
    weights: dict[int, StageBytes],
    lengths: tuple[int, ...],
    n: int,
    with_own: bool = False,
    offload: bool = False,
    reach_extents: tuple[int, ...] | None = None,
) -> list[tuple[float, float, float]]:
    """Per rank, (peak of saved activations, peak of activations + KV context, peak of the K/V its KV
    contexts hold) over its actions (bookkeeping in :func:`pass_events` and :func:`slab_arena_events`, built
    once per plan and lengths; all ranks in one pass); ``with_own``: slabs hold the last unit's K/V too (CP);
    ``offload``: arenas leave the device while no pass reads them (``kv_offload``); ``reach_extents``: the rows in
    use of the copied slabs of the model's bounded reach (their arenas' plan).
    The K/V held are the arenas and the slabs of bounded reach, not their gradients, as
    :class:`~torchtitan_seq.instrumentation.kv_memory.KVMemory` measures them between a rank's actions."""
    k = len(lengths)
    e, starts = plan.merged_events(k)
    arenas = plan.merged_arenas(lengths, with_own, offload)
    stages = np.array(list(weights))
    saved = np.zeros((stages.max() + 1, k))
    names = ("slab", "held", "grad", "constant", "latents", "reach_held")
    slab, held, grad, constant, latents, reach_held = (np.zeros(stages.max() + 1) for _ in names)
    saved[stages] = [w.saved for w in weights.values()]
    for table, name in zip((slab, held, grad, constant, latents, reach_held), names):
        table[stages] = [getattr(w, name) for w in weights.values()]
    act = e.saved * saved[e.stage, e.unit] + arenas * slab[e.stage] + e.constant * constant[e.stage]
    context = e.microbatch * latents[e.stage]
    if reach_extents and reach_held.any():
        context = context + plan.merged_arenas(lengths, False, False, reach_extents) * reach_held[e.stage]
    kv = arenas * held[e.stage] + e.grad * grad[e.stage] + context
    context = context + arenas * (slab[e.stage] + held[e.stage])
    peaks = []
    for deltas in (act, act + kv, context):
        running = np.cumsum(deltas)
        before = np.concatenate(([0.0], running))[starts]  # the running sum as each rank begins
        peaks.append(np.maximum(np.maximum.reduceat(running, starts) - before, 0.0))
    scale = np.where(plan.forwards_first, n / plan.built_microbatches, 1.0)
    return [(float(a), float(b), float(c)) for a, b, c in zip(*(p * scale for p in peaks))]
