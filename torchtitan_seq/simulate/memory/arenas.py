"""The KV context's arenas along a rank's actions: where each is allocated and let go, as the context
plans them (:mod:`.stage_bytes` says what they hold).
"""

from __future__ import annotations

import numpy as np

from torchtitan_seq.runtime.kv_offload import arena_of, offload_spans
from torchtitan_seq.runtime.kv_placement import Pass, plan_arenas


def slab_arena_events(
    count: int,
    stages: list[tuple[list[int], tuple[Pass, ...]]],
    lengths: tuple[int, ...],
    with_own: bool = False,
    offload: list[tuple[list[int], tuple[Pass, ...]]] | None = None,
    extents: tuple[int, ...] | None = None,
) -> np.ndarray:
    """Per action of a rank (``count`` of them), the K/V arenas that the KV context allocates (+) or
    lets go (-) there, in slabs (a slab: the keys later units read; ``with_own``, under CP, the last
    unit's too): each stage's arenas as it plans them (:func:`~torchtitan_seq.runtime.kv_placement.plan_arenas`)
    from its passes (``stages``: where the rank runs each, and the passes), from a write into an empty
    one to the end of the last backward of a slab in it; with ``offload`` (per stage, as ``stages``, every pass
    it announces and where the rank runs it), each arena off the device from the pass whose start frees it
    to the pass whose start brings it back (:func:`~torchtitan_seq.runtime.kv_offload.offload_spans`); with
    ``extents``, the copied slabs of a bounded reach, in slabs of its rows
    (:attr:`~torchtitan_seq.runtime.kv_reach.ReachRows.extents`)."""
    size = extents[-1] if extents else sum(lengths[: None if with_own else -1])
    deltas = np.zeros(count)
    for i, (where, passes) in enumerate(stages if size else ()):
        arenas = plan_arenas(passes, lengths, size, extents=extents)
        for start, end in arenas.busy:
            deltas[where[start]] += arenas.capacity / size
            deltas[where[end]] -= arenas.capacity / size
        if offload is not None:
            at, touches = offload[i]
            for span in offload_spans([m for _, m, _ in touches], arena_of(arenas)):
                slabs = (arenas.capacity if span.arena >= 0 else size) / size
                deltas[at[span.drop]] -= slabs
                deltas[at[span.back]] += slabs
    return deltas
