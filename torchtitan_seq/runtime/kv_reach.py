"""A slab that holds only what later units can still read: the K/V context of a layer of bounded reach.

A layer of a sliding window or of attention chunks (:class:`~torchtitan_seq.runtime.reach.Reach`) reads,
for unit j at offset s_j, only the keys [first_j, s_j) of its prefix (first_j: s_j - window + 1, or the
start of s_j's chunk). The union of those ranges over the microbatch's units (:class:`ReachRows`) is what
a slab of such a layer keeps: fewer than k x window positions for a window, whatever the sequence's
length. The unit's own K/V are not in it: its attention saves them itself, as a layer's saved
activations. Two kinds keep them:

- :class:`ReachViews`, where the units' attention saves its own K/V as it was given them (eager, no
  activation checkpointing): views of each unit's own K/V at the positions later units read, no copy.
  Autograd keeps each unit's K/V until its backward, and every unit that reads them runs backward
  before it, so the views hold no byte the units' saved activations do not; a unit's views go with
  its backward.
- :class:`ReachSlab`, where checkpointing (or a compiled graph, or ``eval``) drops, re-makes or never keeps
  what the attention saved: a copy of those positions, in position order with the gaps left out, as a
  :class:`~torchtitan_seq.runtime.kv_slab.KVSlab` of rows. It lies in an arena of the stage's slabs of
  that reach, planned as the full slabs' arenas are (:mod:`~torchtitan_seq.runtime.kv_arena`) from the rows
  in use while each unit is the last in flight (:attr:`ReachRows.extents`): a microbatch in backward frees
  rows from the end as the next one fills its own from the other, and the overwrite guard checks the rows.

The gradients later units send the keys they read are added into a gradient slab of the same rows,
and each unit's own backward adds what was sent its positions, as with a full slab; positions no unit
reads receive none.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Sequence

import torch

from torchtitan_seq.runtime.kv_slab import EVERY, KVSlab
from torchtitan_seq.runtime.reach import Reach

__all__ = ["ReachRows", "ReachSlab", "ReachViews", "reach_rows"]


class ReachRows:
    """Where a :class:`ReachSlab` lays out positions: the runs of positions later units read, each
    [start, stop), in order, at consecutive rows.

    Args:
        lengths: the units' lengths [L_0, ..., L_{k-1}] of a microbatch.
        reach: the layer's reach (a window, chunks or both).
    """

    def __init__(self, lengths: Sequence[int], reach: Reach) -> None:
        runs: list[list[int]] = []
        offset = 0
        for length in lengths[:-1]:
            offset += length  # the next unit's start
            first = offset - (offset % reach.chunk if reach.chunk is not None else offset)
            if reach.window is not None:
                first = max(first, offset - reach.window + 1)
            if first == offset:
                continue
            if runs and first <= runs[-1][1]:
                runs[-1][1] = offset
            else:
                runs.append([first, offset])
        self.runs = [tuple(run) for run in runs]
        """The runs [start, stop) of positions held, in order."""
        self.starts = [start for start, _ in self.runs]
        self.bases = [sum(stop - start for start, stop in self.runs[:i]) for i in range(len(self.runs))]
        """Each run's first row."""
        self.size = sum(stop - start for start, stop in self.runs)
        """Rows in all."""
        self.extents = tuple(self.before(end) for end in itertools.accumulate(lengths))
        """Per unit j, the rows in use while it is the last unit in flight: those of positions before its end."""

    def before(self, position: int) -> int:
        """Rows of the positions before ``position``."""
        return sum(max(0, min(stop, position) - start) for start, stop in self.runs)

    def of(self, offset: int, length: int) -> tuple[int, int]:
        """(first row, rows) of the positions [offset, offset + length), which lie at consecutive rows."""
        first = self.before(offset)
        return first, self.before(offset + length) - first

    def row(self, start: int, stop: int) -> int:
        """The first row of positions [start, stop), which must lie in one run."""
        i = bisect.bisect_right(self.starts, start) - 1
        if i < 0 or stop > self.runs[i][1]:
            raise RuntimeError(f"positions [{start}, {stop}) are not held by the layer's reach {self.runs}")
        return self.bases[i] + start - self.runs[i][0]

    def within(self, start: int, stop: int) -> list[tuple[int, int]]:
        """The held positions of [start, stop), as ranges [a, b) each in one run."""
        return [(max(a, start), min(b, stop)) for a, b in self.runs if a < stop and b > start]


@functools.lru_cache(maxsize=256)
def reach_rows(lengths: tuple[int, ...], reach: Reach) -> ReachRows:
    """The :class:`ReachRows` of a microbatch of units of ``lengths`` under ``reach``: made once, read by every
    microbatch's and layer's slab of that reach."""
    return ReachRows(lengths, reach)


class ReachSlab:
    """K/V of one microbatch in one layer of bounded reach: only the positions later units read, at their
    rows (:class:`ReachRows`) of ``slab``; the interface of :class:`~torchtitan_seq.runtime.kv_slab.KVSlab`
    for what the attention reads and sends, in positions.

    Args:
        rows: where it lays out positions.
        slab: the rows' K/V (a range of an arena, ascending or descending) and their gradient.
    """

    def __init__(self, rows: ReachRows, slab: KVSlab) -> None:
        self.rows, self.slab = rows, slab
        self.filled = 0
        """The end of the positions written so far (units 0..j in order)."""

    @property
    def k(self) -> torch.Tensor:
        return self.slab.k

    @property
    def v(self) -> torch.Tensor:
        return self.slab.v

    @property
    def descending(self) -> bool:
        """Whether the rows run last first (a windowed call then reads a flipped copy of its keys)."""
        return self.slab.descending

    def holds(self, stop: int) -> bool:
        """Whether the slab holds every key before ``stop``: never, but for an empty prefix (its units
        save their own K/V, and it drops what no later unit reads)."""
        return stop == 0

    def write(self, offset: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write what later units read of K/V (B, Hkv, L, D) of positions [offset, offset + L); the slab
        holds no unit's K/V whole, so the unit saves its own."""
        for a, b in self.rows.within(offset, offset + k.shape[2]):
            self.slab.write(self.rows.row(a, b), k.narrow(2, a - offset, b - a), v.narrow(2, a - offset, b - a))
        self.filled = offset + k.shape[2]

    def keys(self, start: int, stop: int, rows: slice = EVERY) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [start, stop) of batch rows ``rows``, views as the slab lays them out."""
        row = self.rows.row(start, stop)
        return self.slab.keys(row, row + stop - start, rows)

    def accumulate(self, grad_k: torch.Tensor, grad_v: torch.Tensor, rows: slice, start: int) -> None:
        """Add the gradient a later unit's attention sends the keys [start, start + n) of batch rows
        ``rows`` (grad_k, grad_v: (rows, Hkv, n, D), laid out as :meth:`keys` gave them), in place."""
        self.slab.accumulate(grad_k, grad_v, rows, self.rows.row(start, start + grad_k.shape[2]))

    def add_sent(self, dk: torch.Tensor, dv: torch.Tensor, offset: int) -> None:
        """Add what later units sent positions [offset, offset + L) to ``dk``, ``dv`` (B, Hkv, L, D, in
        position order: the unit's own gradients), in place."""
        for a, b in self.rows.within(offset, offset + dk.shape[2]):
            part = (t.narrow(2, a - offset, b - a) for t in (dk, dv))
            self.slab.add_sent(*part, self.rows.row(a, b))


class ReachViews(ReachSlab):
    """K/V of one microbatch in one layer of bounded reach as views of its units' own K/V (the tensors their
    attention saves for backward), at the positions later units read: no K/V of its own. Its gradient slab is
    a :class:`~torchtitan_seq.runtime.kv_slab.KVSlab` of the rows over a one-value pattern of K/V's shapes,
    allocated as later units send gradients, as a copy's is.

    Args:
        rows: the positions later units read.
        k: a unit's keys (B, Hkv, L, Dqk), whose batch, heads, width and dtype the gradient takes.
        v: a unit's values (B, Hkv, L, Dv), likewise.
    """

    def __init__(self, rows: ReachRows, k: torch.Tensor, v: torch.Tensor) -> None:
        # one value each, expanded: not a view of the unit's, which would keep its storage alive
        b, h, _, d = k.shape
        pattern = [t.new_empty(1).expand(b, rows.size, h, t.shape[3]).transpose(1, 2) for t in (k, v)]
        super().__init__(rows, KVSlab(*pattern))
        self.slab.filled = rows.size  # every row a later unit reads may be sent a gradient
        self.empty = tuple(t.new_empty(b, h, 0, t.shape[3]) for t in (k, v))  # what it holds: nothing
        self.pieces: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        """(start, stop, K, V) of the positions [start, stop) of each unit that later units read, in order."""

    @property
    def k(self) -> torch.Tensor:
        return self.empty[0]

    @property
    def v(self) -> torch.Tensor:
        return self.empty[1]

    def write(self, offset: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep views of K/V (B, Hkv, L, D) of positions [offset, offset + L) where later units read them."""
        for a, b in self.rows.within(offset, offset + k.shape[2]):
            self.pieces.append((a, b, k.detach().narrow(2, a - offset, b - a), v.detach().narrow(2, a - offset, b - a)))
        self.filled = offset + k.shape[2]

    def keys(self, start: int, stop: int, rows: slice = EVERY) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [start, stop) of batch rows ``rows``, in position order: a view where they lie
        in one unit (a window no longer than a unit), else a copy joining the units' (made for the call)."""
        parts = [
            (
                k.narrow(2, max(a, start) - a, min(b, stop) - max(a, start)),
                v.narrow(2, max(a, start) - a, min(b, stop) - max(a, start)),
            )
            for a, b, k, v in self.pieces
            if a < stop and b > start
        ]
        if sum(p[0].shape[2] for p in parts) != stop - start:
            raise RuntimeError(f"positions [{start}, {stop}) are not held by the layer's reach {self.rows.runs}")
        k, v = (
            parts[0] if len(parts) == 1 else (torch.cat([p[0] for p in parts], 2), torch.cat([p[1] for p in parts], 2))
        )
        return (k, v) if rows == EVERY else (k[rows], v[rows])

    def add_sent(self, dk: torch.Tensor, dv: torch.Tensor, offset: int) -> None:
        """As :meth:`ReachSlab.add_sent`, the last the backward of the unit at ``offset`` does with the slab:
        the views of it and of the unit before it go, as every unit that read them has run backward."""
        super().add_sent(dk, dv, offset)
        while self.pieces and self.pieces[-1][1] >= offset:
            self.pieces.pop()
