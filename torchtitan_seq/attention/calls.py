"""The kernel calls of a span of queries, and their forward and backward: what unit attention and the
whole-sequence path both run.

Queries at positions [s, s+L) attend to keys [0, s+L): a kernel that aligns causal masks at the bottom
right reads them in one causal call where they lie in position order; otherwise (top-left kernels:
torch's CPU and cuDNN ones; a descending slab) a unit gets two, the prefix unmasked and the square
diagonal causally, merged once by log-sum-exp (:func:`_merge_into`). Packed
documents keep this shape: per batch row each piece of a document within the span is a causal call,
and only the queries of the document that continues into the span read the keys before it, from that
document's first key on (:func:`kernel_calls`). Backward makes the same calls with the *merged* output and
log-sum-exp, which is exact (the ring-attention identity). Outputs, gradients and log-sum-exps are laid
out as torch's kernels lay theirs out (:mod:`.layouts`), so none is copied.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from torchtitan_seq.attention.kernels import AttentionKernel, Band
from torchtitan_seq.attention.layouts import new_lse, new_out
from torchtitan_seq.runtime.documents import Documents
from torchtitan_seq.runtime.kv_slab import EVERY, KVSlab
from torchtitan_seq.runtime.reach import FULL, Reach


def _merge_into(out: Tensor, lse: Tensor, out_i: Tensor, lse_i: Tensor) -> None:
    """Combine two softmax-normalised partial attentions by their log-sum-exp, into ``out``
    (B, H, L, D) and ``lse`` (B, H, L) float32, in place: out_i's weight is
    exp(lse_i - logaddexp(lse, lse_i)) = sigmoid(lse_i - lse), so the merge is four kernels (no
    exp of each side, no product per side and sum); low-precision outputs are merged in float32
    and rounded once, as the kernels round their own."""
    weight = (lse_i - lse).sigmoid_().unsqueeze(-1)
    torch.logaddexp(lse, lse_i, out=lse)
    if out.dtype == torch.float32:
        out.lerp_(out_i, weight)
    else:
        out.copy_(out.float().lerp_(out_i.float(), weight))


@dataclass(frozen=True)
class Call:
    """One kernel call of a unit: the queries q[rows, :, queries] (positions within the unit)
    attend to the keys [keys.start, keys.stop) of the sequence, causally (the mask aligned at
    the bottom right: the last query sees the last key) or not; under a sliding window of
    ``window`` positions, only to keys fewer than ``window`` positions before each query, the
    call's first query lying ``shift`` positions after its first key."""

    rows: slice
    queries: slice
    keys: slice
    causal: bool
    window: int | None = None
    """None: the call reads all its keys (within the causal mask); no key lies out of a window."""
    shift: int = 0
    """The call's first query's position minus its first key's (a causal call's: Lk - Lq)."""

    @property
    def index(self) -> tuple[slice, slice, slice]:
        """The index of q, out and lse (B, H, L[, D]) this call reads and writes."""
        return self.rows, EVERY, self.queries

    @property
    def band(self) -> Band | None:
        """The window the kernel masks the call's keys by (None: no mask)."""
        return None if self.window is None else Band(self.shift, self.window)

    whole: bool = dataclasses.field(init=False)
    """Whether the call's queries are all of q's (every row)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "whole", self.rows == EVERY and self.queries == EVERY)

    def of(self, *ts: Tensor) -> tuple[Tensor, ...]:
        """The parts of ``ts`` (q, out, lse, dout: (B, H, L[, D])) this call reads or writes: the tensors
        themselves where the call's queries are all of them (an index makes a new view, host work, even of
        the whole); one call for them all."""
        return ts if self.whole else tuple(t[self.index] for t in ts)


def kernel_calls(
    documents: Documents | None, segments: tuple[tuple[int, int], ...], bottom_right: bool, reach: Reach = FULL
) -> tuple[tuple[Call, ...], tuple[Call, ...]]:
    """The kernel calls of queries at the positions ``segments`` ([start, stop) ranges, laid out in
    q in that order: one for a whole unit, a CP rank's two chunks) under ``documents`` (None:
    causal) and the layer's ``reach``: causal calls whose queries cover every segment once, and
    unmasked prefix calls over queries already covered, merged by log-sum-exp. Per segment and batch
    row (every row at once without documents) each piece inside the segment of a document (and of an
    attention chunk) is a causal call over its own keys; the piece continuing into the segment reads
    the keys before the segment that its document, chunk and window allow too: in the same call where
    ``bottom_right`` (a kernel that aligns causal masks at the bottom right, over keys in position
    order), else in one call of its own over the queries that reach them. A call whose keys lie
    further back than the window from some query is masked by it (:attr:`Call.window`)."""
    if documents is None:  # the same few units every step
        return _causal_calls(segments, bottom_right, reach)
    return _build_calls(documents, segments, bottom_right, reach)


@functools.cache
def _causal_calls(
    segments: tuple[tuple[int, int], ...], bottom_right: bool, reach: Reach
) -> tuple[tuple[Call, ...], tuple[Call, ...]]:
    """:func:`kernel_calls` without documents, built once per unit shape and reach."""
    return _build_calls(None, segments, bottom_right, reach)


def _windowed(window: int | None, farthest: int) -> int | None:
    """``window`` where a call's farthest query-to-key distance ``farthest`` reaches out of it, else None."""
    return window if window is not None and farthest >= window else None


def _build_calls(
    documents: Documents | None, segments: tuple[tuple[int, int], ...], bottom_right: bool, reach: Reach
) -> tuple[tuple[Call, ...], tuple[Call, ...]]:
    """:func:`kernel_calls`, built."""
    end = segments[-1][1] if len(segments) == 1 else max(stop for _, stop in segments)
    chunks = reach.chunk_starts(0, end)
    # One call covers all of q where nothing splits it: no documents, chunk boundaries or CP chunks.
    one = documents is None and len(segments) == 1 and not chunks
    if documents is None:
        rows = [(EVERY, Documents(((0, *chunks[1:]),)))]
    else:
        rows = [
            (slice(b, b + 1), Documents((tuple(sorted(set(starts) | set(chunks))),) if chunks else (starts,)))
            for b, starts in enumerate(documents.starts)
        ]
    window = reach.window
    causal: list[Call] = []
    prefix: list[Call] = []
    local = 0  # where the segment's queries start in q
    for start, stop in segments:
        for row, bounds in rows:
            first = bounds.start_of(0, start)
            if window is not None:
                first = max(first, start - window + 1)
            calls = [
                Call(
                    row,
                    EVERY if one else slice(local + a, local + e),
                    slice(start + a, start + e),
                    True,
                    _windowed(window, e - a - 1),
                )
                for a, e in bounds.pieces(0, start, stop)
            ]
            if first < start:  # the continuing piece's keys [first, start)
                head = calls[0]
                length = head.keys.stop - start
                if bottom_right:
                    keys = slice(first, head.keys.stop)
                    calls[0] = Call(row, head.queries, keys, True, _windowed(window, length - 1 + start - first),
                                    keys.stop - keys.start - length)  # fmt: skip
                else:
                    # Only the queries fewer than ``window`` positions after key start - 1 read any of them.
                    n = length if window is None else min(length, window - 1)
                    queries = head.queries if n == length else slice(local, local + n)
                    farthest = n - 1 + start - first
                    prefix.append(Call(row, queries, slice(first, start), False, _windowed(window, farthest),
                                       start - first))  # fmt: skip
            causal += calls
        local += stop - start
    return tuple(causal), tuple(prefix)


# Not frozen: one is made per unit and layer, and a frozen dataclass's __init__ sets each field through
# object.__setattr__.
@dataclass(slots=True)
class Keys:
    """Where a unit's keys lie: the unit's own, ``own`` (B, Hkv, L, D) from ``offset`` on, in
    position order; those before ``offset`` in ``slab``."""

    own: tuple[Tensor, Tensor]
    offset: int
    slab: KVSlab | None

    def __call__(self, c: Call) -> tuple[Tensor, Tensor]:
        """K and V of call ``c``'s keys, views: a call within the unit reads its own keys (in
        position order, as causal calls need them), one reaching before it the slab (an unmasked
        prefix call in the slab's order, or a bottom-right causal call over an ascending slab)."""
        if c.keys.start >= self.offset:
            start, stop = c.keys.start - self.offset, c.keys.stop - self.offset
            if start == 0 and stop == self.own[0].shape[2] and c.rows == EVERY:
                return self.own  # all of them (an index would make new views, host work at every call)
            return self.own[0][c.rows, :, start:stop], self.own[1][c.rows, :, start:stop]
        k, v = self.slab.keys(c.keys.start, c.keys.stop, c.rows)
        if c.window is not None and self.slab.descending:
            # a window masks keys by position, in position order: a copy, of fewer than ``window`` keys
            return k.flip(2), v.flip(2)
        return k, v


def attention_forward(
    kernel: AttentionKernel,
    q: Tensor,
    keys: Keys,
    causal: tuple[Call, ...],
    prefix: tuple[Call, ...],
    scale: float,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """out (B, Hq, L, Dv) and lse (B, Hq, L) float32 of the ``causal`` and ``prefix`` calls, and of
    the attention ``sinks`` (Hq,) where given (:func:`merge_sinks`)."""
    if len(causal) == 1 and causal[0].whole:
        out, lse = kernel.forward(q, *keys(causal[0]), True, scale, causal[0].band)
    else:
        out, lse = new_out(q, keys.own[1].shape[-1]), new_lse(q)
        for c in causal:
            out[c.index], lse[c.index] = kernel.forward(q[c.index], *keys(c), True, scale, c.band)
    for c in prefix:  # merged into the views of out and lse the call's queries lie in
        q_i, out_i, lse_i = c.of(q, out, lse)
        _merge_into(out_i, lse_i, *kernel.forward(q_i, *keys(c), False, scale, c.band))
    if sinks is not None:
        merge_sinks(out, lse, sinks)
    return out, lse


def merge_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> None:
    """Merge attention sinks into ``out`` (B, H, L, D) and ``lse`` (B, H, L) float32, in place, once,
    after every call: a sink is a key of logit ``sinks[h]`` (H,) and value zero, so the merge
    (:func:`_merge_into` with a zero output) scales the output by sigmoid(lse - sink) and adds the sink
    to the log-sum-exp. The backward of the calls given the merged output and log-sum-exp is then the
    sinks' too (the ring-attention identity), and the sinks' own gradient is :func:`sink_gradient`'s."""
    sink = sinks.detach().float().view(1, -1, 1)
    weight = (lse - sink).sigmoid_().unsqueeze(-1)
    torch.logaddexp(lse, sink, out=lse)
    if out.dtype == torch.float32:
        out.mul_(weight)
    else:
        out.copy_(out.float().mul_(weight))


def sink_gradient(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """dL/dsinks (H,) of :func:`merge_sinks`, given dout and the merged ``out`` (B, H, L, D) and ``lse``
    (B, H, L): a sink's probability exp(sink - lse) times the softmax's gradient at a zero value,
    -sum(dout * out), summed over the batch and queries."""
    delta = (dout.float() * out.float()).sum(-1)
    share = (sinks.detach().float().view(1, -1, 1) - lse).exp_()
    return (share * delta).sum((0, 2)).neg_().to(sinks.dtype)


def attention_backward(
    kernel: AttentionKernel,
    dout: Tensor,
    q: Tensor,
    keys: Keys,
    out: Tensor,
    lse: Tensor,
    causal: tuple[Call, ...],
    prefix: tuple[Call, ...],
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, and dk, dv of the unit's own keys, of :func:`attention_forward` given its merged
    ``out`` and ``lse``; the gradient of earlier keys goes to the slab."""
    offset, slab = keys.offset, keys.slab
    length = keys.own[0].shape[2]  # the unit's keys (under CP more than its queries here)
    # One causal call over every query and every own key writes dq, dk and dv whole (own keys may reach before
    # the queries: a unit's expanded prefix, :mod:`.latent`, whose prefix calls then add into them).
    whole = len(causal) == 1 and causal[0].whole and causal[0].keys.stop - max(causal[0].keys.start, offset) == length
    if not whole:
        dq = torch.empty_like(q)
        # As many queries as own keys (no CP): the causal calls cover each own key once, and write its
        # gradient. Under CP zeros, added to: a rank's calls leave other ranks' keys unread, and
        # bottom-right calls of its two chunks read some keys twice.
        once = q.shape[2] == length
        dk, dv = (torch.empty_like(t) if once else torch.zeros_like(t) for t in keys.own)
        put = Tensor.copy_ if once else Tensor.add_
    # Every add below is in place into a view (``x[i] += y`` would copy the sum back onto itself).
    for c in causal:
        dout_i, q_i, out_i, lse_i = c.of(dout, q, out, lse)
        dq_i, dk_i, dv_i = kernel.backward(dout_i, q_i, *keys(c), out_i, lse_i, True, scale, c.band)
        cut = max(offset - c.keys.start, 0)  # keys before the unit: a bottom-right call's prefix
        if cut:
            slab.accumulate(dk_i[:, :, :cut], dv_i[:, :, :cut], c.rows, c.keys.start)
        if whole:
            dq, dk, dv = (dq_i, dk_i, dv_i) if not cut else (dq_i, dk_i[:, :, cut:], dv_i[:, :, cut:])
        else:
            own = slice(c.keys.start + cut - offset, c.keys.stop - offset)
            dq[c.index].copy_(dq_i)
            put(dk[c.rows, :, own], dk_i[:, :, cut:])
            put(dv[c.rows, :, own], dv_i[:, :, cut:])
    for c in prefix:
        dout_i, q_i, out_i, lse_i, into = c.of(dout, q, out, lse, dq)
        dq_i, dk_i, dv_i = kernel.backward(dout_i, q_i, *keys(c), out_i, lse_i, False, scale, c.band)
        into.add_(dq_i)
        if c.keys.start >= offset:  # keys within the unit, read from its own (a CP rank's later chunk)
            own = slice(c.keys.start - offset, c.keys.stop - offset)
            dk[c.rows, :, own].add_(dk_i)
            dv[c.rows, :, own].add_(dv_i)
        else:  # read from the slab, laid out as it lays positions out (a windowed call's in position order)
            if c.window is not None and slab.descending:
                dk_i, dv_i = dk_i.flip(2), dv_i.flip(2)
            slab.accumulate(dk_i, dv_i, c.rows, c.keys.start)
    if slab is not None:  # dk, dv are the kernels' own (or written above): added to in place
        slab.add_sent(dk, dv, offset)
    return dq, dk, dv
