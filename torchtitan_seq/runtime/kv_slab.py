"""A K/V slab: one microbatch's K and V in one layer, written unit by unit and read as views, and the
gradient later units send its earlier positions.

Each unit's K/V are written at their offset as the unit runs forward (one copy of the unit's own K/V,
never of the prefix), so a unit reads its whole prefix, or prefix and own keys together, as one view.
A slab is a range of an arena (:mod:`torchtitan_seq.runtime.kv_arena`): ascending, position p lies at
p; descending, at size - 1 - p, so that the slab fills from the range's end and any positions [a, b)
are still one range, last position first. The slab holds K/V *detached*: a later unit's attention
backward adds dL/dK and dL/dV of the prefix it read into the slab's gradient
(:meth:`KVSlab.accumulate`), and a unit's own backward adds what was sent its positions to its own
gradients (:meth:`KVSlab.add_sent`). The stage's slabs are kept by its
:class:`~torchtitan_seq.runtime.kv_context.KVContext`.
"""

from __future__ import annotations

import torch

__all__ = ["EVERY", "Stored", "DescendingRows", "KVSlab", "new_keys"]


EVERY = slice(None)
"""Every batch row (an index of dim 0)."""


def new_keys(like: torch.Tensor, n: int, zeros: bool = False) -> torch.Tensor:
    """Room for K/V (or their gradient) of ``n`` positions shaped like ``like`` (B, H, _, D), laid out as
    (B, n, H, D) in memory, as a model's projections lay out K/V and torch's kernels their gradients:
    a unit's K/V are then copied into the slab as they lie, and a kernel's dK/dV of slab keys come
    back laid out as the model takes them (cuDNN's follow the keys' layout: a copy each, else)."""
    b, h, _, d = like.shape
    return (like.new_zeros if zeros else like.new_empty)(b, n, h, d).transpose(1, 2)


def _whole(t: torch.Tensor) -> bool:
    """Whether ``t`` spans its storage (a kernel's output, not a part of one)."""
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


Stored = tuple[torch.Tensor, torch.Tensor, bool]
"""Views of a slab where a unit's K/V (B, Hkv, L, D) lie, and whether they run last position first: what
the unit's attention saves for its backward (:meth:`KVSlab.stored`)."""


class DescendingRows:
    """The rows of a descending slab of ``size`` positions (position p at row size - 1 - p), an int64
    (size,) index on the slab's device, and views of it by position range, kept: the same few units
    run every step, and each view is host work."""

    __slots__ = ("rows", "_views")

    def __init__(self, size: int, device: torch.device) -> None:
        self.rows = torch.arange(size - 1, -1, -1, device=device)
        self._views: dict[tuple[int, int], torch.Tensor] = {}

    def of(self, start: int, n: int) -> torch.Tensor:
        """The rows of positions [start, start + n): size - 1 - start, ..., size - start - n."""
        view = self._views.get((start, n))
        if view is None:
            view = self._views[start, n] = self.rows.narrow(0, start, n)
        return view


class KVSlab:
    """K/V of one microbatch in one layer, and the gradient later units send earlier positions.

    ``k`` and ``v``: (batch, kv_heads, size, head_dim) views of a range of an arena
    (:mod:`torchtitan_seq.runtime.kv_placement`), laid out (batch, size, kv_heads, head_dim) in memory
    (:func:`new_keys`), positions [0, ``filled``) written so far (units 0..j in order). Ascending,
    position p lies at p; ``descending``, at size - 1 - p, so that the slab fills from the range's
    end: any positions [a, b) are still one range, last position first.
    ``grad_k`` and ``grad_v``: dL/dK and dL/dV of the positions later units read, laid out alike,
    sent by their backward; None until the first is sent.
    """

    __slots__ = ("k", "v", "descending", "filled", "grad_k", "grad_v", "_views", "_rows")

    def __init__(self, k: torch.Tensor, v: torch.Tensor, rows: DescendingRows | None = None) -> None:
        self.k, self.v = k, v
        self.descending = rows is not None
        self._rows = rows  # descending: each position's row, for indexed copies and adds
        self.filled = 0
        self.grad_k: torch.Tensor | None = None
        self.grad_v: torch.Tensor | None = None
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (start, stop) -> K, V

    def _pair(
        self, k: torch.Tensor, v: torch.Tensor, start: int, stop: int, rows: slice = EVERY
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``k``, ``v`` (the slab's keys, or their gradients: (B, H, _, D)) at positions [start, stop) of batch
        rows ``rows``, views where the slab lays those positions out. One call for the pair, and ``narrow``
        for all rows, where an index is parsed first: each call and view is host work, a few times per
        unit and layer."""
        if self.descending:
            size = self.k.shape[2]
            start, stop = size - stop, size - start
        if rows == EVERY:
            return k.narrow(2, start, stop - start), v.narrow(2, start, stop - start)
        return k[rows, :, start:stop], v[rows, :, start:stop]

    def write(self, offset: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write K/V (B, Hkv, L, D) of positions [offset, offset + L); returns the views written, as
        :meth:`keys` gives them."""
        stop = offset + k.shape[2]
        if stop > self.k.shape[2]:  # a context told no lengths grows the slab (copies the prefix)
            grown = [new_keys(t, stop) for t in (self.k, self.v)]
            grown[0][:, :, : self.filled], grown[1][:, :, : self.filled] = self.keys(0, self.filled)
            self.k, self.v = grown
            self._views.clear()
        into_k, into_v = self._pair(self.k, self.v, offset, stop)
        # Read, not differentiated through: the slab holds K/V detached. Inside the attention's forward
        # grad mode is off and the copy records nothing; an alias through .data would cost a tensor each.
        if torch.is_grad_enabled():
            k, v = k.data, v.data
        if self.descending:  # one indexed copy each: a flipped copy would be a kernel and a tensor more
            rows = self._rows.of(offset, stop - offset)
            self.k.index_copy_(2, rows, k)
            self.v.index_copy_(2, rows, v)
        else:
            into_k.copy_(k)
            into_v.copy_(v)
        self.filled = stop
        return into_k, into_v

    def stored(self, k: torch.Tensor, v: torch.Tensor) -> Stored:
        """Views ``k``, ``v`` of this slab as a unit's attention saves them, and whether they run last
        position first: aliases with a version counter of their own, since later units (and other
        microbatches in the arena) write other positions, which autograd would otherwise take for a change
        of what the unit saved."""
        return k.data, v.data, self.descending

    def holds(self, stop: int) -> bool:
        """Whether the slab holds the keys before position ``stop``."""
        return self.filled >= stop

    def keys(self, start: int, stop: int, rows: slice = EVERY) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [start, stop) of batch rows ``rows``, views as the slab lays them out
        (a descending slab's last position first: right for an unmasked kernel call). Those of every row
        are kept: a unit reads its prefix forward and again backward, one view made for both."""
        if rows != EVERY:
            return self._pair(self.k, self.v, start, stop, rows)
        views = self._views.get((start, stop))
        if views is None:
            views = self._views[start, stop] = self._pair(self.k, self.v, start, stop)
        return views

    def accumulate(self, grad_k: torch.Tensor, grad_v: torch.Tensor, rows: slice, start: int) -> None:
        """Add the gradient a later unit's attention sends the keys [start, start + n) of batch
        rows ``rows`` (grad_k, grad_v: (rows, Hkv, n, D), laid out as :meth:`keys` gave them), in place."""
        if self.grad_k is None:  # once per microbatch and layer: every position a later unit reads
            readable = self.k.shape[2] if self.descending else self.filled
            covers = start == 0 and grad_k.shape[2] == readable and grad_k.shape[0] == self.k.shape[0]
            if covers and _whole(grad_k) and _whole(grad_v):
                # The first sender (the last unit, whose prefix is every readable position) covers the
                # whole gradient slab: a kernel's fresh output, nothing else in its storage, which
                # becomes the gradient slab itself (no zeros, no add).
                self.grad_k, self.grad_v = grad_k, grad_v
                return
            self.grad_k, self.grad_v = (new_keys(t, readable, zeros=True) for t in (self.k, self.v))
        into_k, into_v = self._pair(self.grad_k, self.grad_v, start, start + grad_k.shape[2], rows)
        into_k.add_(grad_k)  # into the view: ``+=`` on an index copies the sum back
        into_v.add_(grad_v)

    def add_sent(self, dk: torch.Tensor, dv: torch.Tensor, offset: int) -> None:
        """Add what later units sent positions [offset, offset + L) to ``dk``, ``dv`` (B, Hkv, L, D, in
        position order: the unit's own gradients), in place; from a descending slab by an indexed add
        (its positions run the other way), not a flipped copy and an add."""
        readable = self.grad_k.shape[2] if self.grad_k is not None else 0
        n = min(readable - offset, dk.shape[2])
        if n <= 0:
            return
        grad_k, grad_v = self._pair(self.grad_k, self.grad_v, offset, offset + n)
        if n < dk.shape[2]:
            dk, dv = dk.narrow(2, 0, n), dv.narrow(2, 0, n)
        if self.descending:
            # n - 1, ..., 0 (the rows of the last n positions): where each sent row's position lies in dk
            rows = self._rows.of(self.k.shape[2] - n, n)
            dk.index_add_(2, rows, grad_k)
            dv.index_add_(2, rows, grad_v)
        else:
            dk.add_(grad_k)
            dv.add_(grad_v)
