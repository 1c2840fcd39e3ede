"""What the KV context keeps of layers of bounded reach (a sliding window, attention chunks) under
``kv_context = "reach"``: which layers of each chunk are bounded (:func:`bounded_layers`) and how many
positions of a microbatch their slab holds (:func:`reach_positions`). :mod:`.stage_bytes` weighs them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from torchtitan_seq.runtime.kv_reach import ReachRows
from torchtitan_seq.runtime.layer_shapes import AttentionReach
from torchtitan_seq.runtime.reach import Reach


def bounded_layers(args: Any, chunks: Sequence[tuple[float, bool, bool]]) -> list[float]:
    """Per chunk of a chain, its layers of bounded reach.

    Args:
        args: the model's shape (its ``reach``; None: every layer reads its whole prefix).
        chunks: the chain's chunks in order, (layers, embeddings, output) each
            (:func:`~.chunks.memory_chunk_split`).

    Returns:
        Per chunk, the bounded layers among the consecutive layers it holds; where the chunks hold an even
        real-valued share of the layers (more chunks than layers), that share of the model's bounded layers.
    """
    reach: AttentionReach | None = getattr(args, "reach", None)
    if reach is None:
        return [0.0] * len(chunks)
    if any(not float(layers).is_integer() for layers, _, _ in chunks):
        share = reach.bounded_layers(args.n_layers) / args.n_layers
        return [layers * share for layers, _, _ in chunks]
    counts, start = [], 0
    for layers, _, _ in chunks:
        stop = start + int(layers)
        counts.append(float(sum(1 for i in range(start, stop) if i % reach.period != reach.global_phase)))
        start = stop
    return counts


@functools.lru_cache(maxsize=1024)
def reach_positions(lengths: tuple[int, ...], reach: AttentionReach) -> int:
    """Positions of one microbatch a bounded layer's slab holds: the keys later units read, the runtime's
    :class:`~torchtitan_seq.runtime.kv_reach.ReachRows` of units of ``lengths`` (a window's last positions
    before each later unit, the part of its attention chunk before it).

    Args:
        lengths: the units' lengths [L_0, ..., L_{k-1}].
        reach: the bounded layers' window or chunk.

    Returns:
        The positions held, at most (k - 1) x (window - 1) for a window, whatever the sequence's length.
    """
    return reach_extents(lengths, reach)[-1]


@functools.lru_cache(maxsize=1024)
def reach_extents(lengths: tuple[int, ...], reach: AttentionReach) -> tuple[int, ...]:
    """Per unit j, the positions of a bounded layer's slab in use while j is the last unit in flight (the
    runtime's :attr:`~torchtitan_seq.runtime.kv_reach.ReachRows.extents`, from which its copies' arenas are
    planned); the last is :func:`reach_positions`."""
    return ReachRows(lengths, Reach(window=reach.window, chunk=reach.chunk)).extents
