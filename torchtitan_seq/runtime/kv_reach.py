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
- :class:`ReachSlab`, where checkpointing (or a compiled graph) drops or re-makes what the attention
  saved: a copy of those positions, laid out in position order with the gaps left out, kept until the
  microbatch's last backward.

The gradients later units send the keys they read are added into a gradient slab of the same rows,
and each unit's own backward adds what was sent its positions, as with a full slab; positions no unit
reads receive none.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence

import torch

from torchtitan_seq.runtime.kv_slab import EVERY, new_keys
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
    """K/V of one microbatch in one layer of bounded reach: only the positions later units read
    (:class:`ReachRows`), (B, Hkv, rows, D) laid out as a full slab lays its positions out; the same
    interface as :class:`~torchtitan_seq.runtime.kv_slab.KVSlab` for what the attention reads and sends.

    Args:
        rows: where it lays out positions.
        k: a unit's keys (B, Hkv, L, Dqk), whose batch, heads, width and dtype it takes.
        v: a unit's values (B, Hkv, L, Dv), likewise.
    """

    descending = False  # position order: a windowed call reads its keys as they lie

    def __init__(self, rows: ReachRows, k: torch.Tensor, v: torch.Tensor) -> None:
        self.rows = rows
        self.k, self.v = new_keys(k, rows.size), new_keys(v, rows.size)
        self.filled = 0
        """The end of the positions written so far (units 0..j in order)."""
        self.grad_k: torch.Tensor | None = None
        self.grad_v: torch.Tensor | None = None

    def holds(self, stop: int) -> bool:
        """Whether the slab holds every key before ``stop``: never, but for an empty prefix (its units
        save their own K/V, and it drops what no later unit reads)."""
        return stop == 0

    def write(self, offset: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write what later units read of K/V (B, Hkv, L, D) of positions [offset, offset + L); returns
        None: the slab holds no unit's K/V whole, so the unit saves its own."""
        for a, b in self.rows.within(offset, offset + k.shape[2]):
            row = self.rows.row(a, b)
            self.k.narrow(2, row, b - a).copy_(k.detach().narrow(2, a - offset, b - a))
            self.v.narrow(2, row, b - a).copy_(v.detach().narrow(2, a - offset, b - a))
        self.filled = offset + k.shape[2]

    def keys(self, start: int, stop: int, rows: slice = EVERY) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [start, stop) of batch rows ``rows``, views in position order."""
        row = self.rows.row(start, stop)
        k, v = self.k.narrow(2, row, stop - start), self.v.narrow(2, row, stop - start)
        return (k, v) if rows == EVERY else (k[rows], v[rows])

    def accumulate(self, grad_k: torch.Tensor, grad_v: torch.Tensor, rows: slice, start: int) -> None:
        """Add the gradient a later unit's attention sends the keys [start, start + n) of batch rows
        ``rows`` (grad_k, grad_v: (rows, Hkv, n, D)), in place."""
        if self.grad_k is None:  # once per microbatch and layer
            self.grad_k, self.grad_v = (new_keys(t, self.rows.size, zeros=True) for t in (self.k, self.v))
        row, n = self.rows.row(start, start + grad_k.shape[2]), grad_k.shape[2]
        self.grad_k[rows].narrow(2, row, n).add_(grad_k)
        self.grad_v[rows].narrow(2, row, n).add_(grad_v)

    def add_sent(self, dk: torch.Tensor, dv: torch.Tensor, offset: int) -> None:
        """Add what later units sent positions [offset, offset + L) to ``dk``, ``dv`` (B, Hkv, L, D, in
        position order: the unit's own gradients), in place."""
        if self.grad_k is None:
            return
        for a, b in self.rows.within(offset, offset + dk.shape[2]):
            row = self.rows.row(a, b)
            dk.narrow(2, a - offset, b - a).add_(self.grad_k.narrow(2, row, b - a))
            dv.narrow(2, a - offset, b - a).add_(self.grad_v.narrow(2, row, b - a))


class ReachViews(ReachSlab):
    """K/V of one microbatch in one layer of bounded reach as views of its units' own K/V (the tensors their
    attention saves for backward), at the positions later units read: no K/V of its own (its ``k`` and ``v``
    are empty, the gradient slab's pattern); the interface of :class:`ReachSlab`, whose gradient slab it shares.

    Args:
        rows: the positions later units read.
        k: a unit's keys (B, Hkv, L, Dqk), whose batch, heads, width and dtype its gradient slab takes.
        v: a unit's values (B, Hkv, L, Dv), likewise.
    """

    def __init__(self, rows: ReachRows, k: torch.Tensor, v: torch.Tensor) -> None:
        # empty, not a view of the unit's: a view, even of no position, would keep its storage alive
        self.rows, self.k, self.v = (
            rows,
            k.new_empty(*k.shape[:2], 0, k.shape[3]),
            v.new_empty(*v.shape[:2], 0, v.shape[3]),
        )
        self.filled = 0
        self.grad_k: torch.Tensor | None = None
        self.grad_v: torch.Tensor | None = None
        self.pieces: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        """(start, stop, K, V) of the positions [start, stop) of each unit that later units read, in order."""

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
