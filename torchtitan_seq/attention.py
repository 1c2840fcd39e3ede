"""Chunk-aware causal attention for one unit of a subsequence pipeline: the attention op, its
autograd, and its binding to a stage's KV context (the block kernels it calls are in
:mod:`torchtitan_seq.kernels`).

A unit's queries cover positions [s, s+L) of the sequence; its keys are the
prefix [0, s) and its own [s, s+L), all in its microbatch's K/V slab (written by the
:class:`~torchtitan_seq.kv_context.KVContext`, the unit's own first), read as views.
A kernel that aligns causal masks at the bottom right reads slab[0 : s+L] in one causal
call; torch's kernels align them top-left, so they get two: the prefix unmasked and the
square diagonal causally, merged once by log-sum-exp. Backward makes the same calls with
the *merged* output and log-sum-exp, which is exact (the ring-attention identity): dq
once (one add of two calls), dK/dV of the prefix added in place into the slab's gradient,
which the earlier units' backward reads. The unit saves only views of the slab, q, its
output and the log-sum-exp: no concatenated K/V and no mask are ever built.

What a call does is the context's phase (:class:`~torchtitan_seq.kv_context.Phase`), which the
op asks for: FORWARD writes the unit's K/V into the slab and reads the prefix; RECOMPUTE (the
forward again inside the unit's backward, under activation checkpointing) reads the slab and
writes nothing; BACKWARD reads the slab and sends the prefix its dK/dV. Outside a unit a bound
layer attends causally over the sequence it is given.

Packed documents (block-causal attention, :mod:`torchtitan_seq.documents`) keep
this shape: per batch row, each piece of a document within the unit is a causal
diagonal block, and only the queries of the document that continues into the
unit read the prefix, from that document's first key on, in one call (or in the
piece's own call, bottom-right aligned). An unbound layer (no pipeline, torch's schedules)
attends over whole packed sequences with the same calls at offset 0
(``torchtitan_seq::document_attention``), causal ones by torch's SDPA.

A bound layer's attention is the custom op ``torchtitan_seq::unit_attention`` with a
backward op of its own: torch.compile keeps it out of the compiled graph, so the KV
context (Python state) is read and changed when the op runs, never traced. A layer
names its context by a small host tensor, a graph input, so one compiled graph serves every
layer of a model; the op finds the binding by the tensor's address, never reading the tensor.

Nothing on a unit's path reads a tensor on the host (``item``, ``tolist``, a tensor-valued ``if``):
handles, offsets and document starts are Python values, the starts read once per step by the
schedule (once per batch on the whole-sequence path,
:meth:`~torchtitan_seq.documents.Documents.of_batch`), so on a GPU the host never waits for the
device between units. Every add is in place and every merge writes into the kernel's own output.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .documents import Documents
from .kernels import AttentionKernel, select_kernel
from .kv_context import KVContext, KVSlab, Phase

__all__ = ["SequenceAttention", "bind_kv_context"]


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


@dataclass(eq=False)
class _Binding:
    """What a bound attention layer's custom op reads at run time: the stage's context and kernel,
    and the layer's id in the context."""

    context: KVContext
    kernel: AttentionKernel
    layer_id: int


# Custom ops take no Python objects: a bound layer passes a small host tensor of its own, ``ids``,
# and its binding is found by that tensor's address, a Python int read without reading the tensor
# (its values are never read on the unit path: a read of a tensor is a device sync where it lies on
# one). The graphs that saved ``ids`` keep it alive, so its address names no other binding meanwhile.
_BINDINGS: weakref.WeakValueDictionary[int, _Binding] = weakref.WeakValueDictionary()


def _bound(ids: Tensor) -> _Binding:
    """The binding behind a layer's ``ids``."""
    binding = _BINDINGS.get(ids.data_ptr())
    if binding is None:
        raise RuntimeError(
            "unit attention: its SequenceAttention module is gone or rebound; "
            "keep the model alive (and bound) until its graphs have run backward"
        )
    return binding


_EVERY = slice(None)


@dataclass(frozen=True)
class _Call:
    """One kernel call of a unit: the queries q[rows, :, queries] (positions within the unit)
    attend to the keys [keys.start, keys.stop) of the sequence, causally (the mask aligned at
    the bottom right: the last query sees the last key) or not."""

    rows: slice
    queries: slice
    keys: slice
    causal: bool

    @property
    def index(self) -> tuple[slice, slice, slice]:
        """The index of q, out and lse (B, H, L[, D]) this call reads and writes."""
        return self.rows, _EVERY, self.queries


def _calls(
    documents: Documents | None, segments: tuple[tuple[int, int], ...], bottom_right: bool
) -> tuple[list[_Call], list[_Call]]:
    """The kernel calls of queries at the positions ``segments`` ([start, stop) ranges, laid out in
    q in that order: one for a whole unit, a CP rank's two chunks) under ``documents`` (None:
    causal): causal calls whose queries cover every segment once, and unmasked prefix calls over
    queries already covered, merged by log-sum-exp. Per segment and batch row (every row at once
    without documents) each document piece inside the segment is a causal call over its own keys;
    the piece of the document continuing into the segment reads that document's keys before the
    segment too: in the same call where the kernel aligns causal masks at the bottom right, else in
    one unmasked call of its own."""
    one = documents is None and len(segments) == 1  # one call covers all of q
    rows = [_EVERY] if documents is None else [slice(b, b + 1) for b in range(len(documents.starts))]
    causal: list[_Call] = []
    prefix: list[_Call] = []
    local = 0  # where the segment's queries start in q
    for start, stop in segments:
        for b, row in enumerate(rows):
            pieces = [(0, stop - start)] if documents is None else documents.pieces(b, start, stop)
            first = 0 if documents is None else documents.start_of(b, start)
            calls = [
                _Call(row, _EVERY if one else slice(local + a, local + e), slice(start + a, start + e), True)
                for a, e in pieces
            ]
            if first < start:  # the continuing document's keys [first, start)
                head = calls[0]
                if bottom_right:
                    calls[0] = _Call(row, head.queries, slice(first, head.keys.stop), True)
                else:
                    prefix.append(_Call(row, head.queries, slice(first, start), False))
            causal += calls
        local += stop - start
    return causal, prefix


@dataclass(frozen=True)
class _Keys:
    """Where a unit's keys lie: the unit's own, ``own`` (B, Hkv, L, D) from ``offset`` on, in
    position order; those before ``offset`` in ``slab``."""

    own: tuple[Tensor, Tensor]
    offset: int
    slab: KVSlab | None

    def __call__(self, c: _Call) -> tuple[Tensor, Tensor]:
        """K and V of call ``c``'s keys, views: a call within the unit reads its own keys (in
        position order, as causal calls need them), one reaching before it the slab (an unmasked
        prefix call in the slab's order, or a bottom-right causal call over an ascending slab)."""
        if c.keys.start >= self.offset:
            start, stop = c.keys.start - self.offset, c.keys.stop - self.offset
            return self.own[0][c.rows, :, start:stop], self.own[1][c.rows, :, start:stop]
        return self.slab.keys(c.keys.start, c.keys.stop, c.rows)


def _attention_forward(
    kernel: AttentionKernel, q: Tensor, keys: _Keys, causal: list[_Call], prefix: list[_Call], scale: float
) -> tuple[Tensor, Tensor]:
    """out (B, Hq, L, D) and lse (B, Hq, L) float32 of the ``causal`` and ``prefix`` calls."""
    whole = (_EVERY, _EVERY, _EVERY)
    if len(causal) == 1 and causal[0].index == whole:
        out, lse = kernel.forward(q, *keys(causal[0]), True, scale)
    else:
        out, lse = torch.empty_like(q), _new_lse(q)
        for c in causal:
            out[c.index], lse[c.index] = kernel.forward(q[c.index], *keys(c), True, scale)
    for c in prefix:  # merged into the views of out and lse the call's queries lie in
        _merge_into(out[c.index], lse[c.index], *kernel.forward(q[c.index], *keys(c), False, scale))
    return out, lse


def _attention_backward(
    kernel: AttentionKernel,
    dout: Tensor,
    q: Tensor,
    keys: _Keys,
    out: Tensor,
    lse: Tensor,
    causal: list[_Call],
    prefix: list[_Call],
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, and dk, dv of the unit's own keys, of :func:`_attention_forward` given its merged
    ``out`` and ``lse``; the gradient of earlier keys goes to the slab."""
    offset, slab = keys.offset, keys.slab
    length = keys.own[0].shape[2]  # the unit's keys (under CP more than its queries here)
    whole = len(causal) == 1 and causal[0].index == (_EVERY, _EVERY, _EVERY)
    if not whole:
        dq = torch.empty_like(q)
        # zeros: a CP rank's calls leave other ranks' keys unread, and bottom-right calls of its two
        # chunks read some keys twice
        dk, dv = (torch.zeros_like(t) for t in keys.own)
    # Every add below is in place into a view (``x[i] += y`` would copy the sum back onto itself).
    for c in causal:
        dq_i, dk_i, dv_i = kernel.backward(dout[c.index], q[c.index], *keys(c), out[c.index], lse[c.index], True, scale)
        cut = max(offset - c.keys.start, 0)  # keys before the unit: a bottom-right call's prefix
        if cut:
            slab.accumulate(dk_i[:, :, :cut], dv_i[:, :, :cut], c.rows, c.keys.start)
        own = slice(c.keys.start + cut - offset, c.keys.stop - offset)
        if whole:
            dq, dk, dv = dq_i, dk_i[:, :, cut:], dv_i[:, :, cut:]
        else:
            dq[c.index].copy_(dq_i)
            dk[c.rows, :, own].add_(dk_i[:, :, cut:])
            dv[c.rows, :, own].add_(dv_i[:, :, cut:])
    for c in prefix:
        dq_i, dk_i, dv_i = kernel.backward(
            dout[c.index], q[c.index], *keys(c), out[c.index], lse[c.index], False, scale
        )
        dq[c.index].add_(dq_i)
        if c.keys.start >= offset:  # keys within the unit, read from its own (a CP rank's later chunk)
            own = slice(c.keys.start - offset, c.keys.stop - offset)
            dk[c.rows, :, own].add_(dk_i)
            dv[c.rows, :, own].add_(dv_i)
        else:  # read from the slab, laid out as it lays positions out
            slab.accumulate(dk_i, dv_i, c.rows, c.keys.start)
    later_k, later_v = slab.take(offset, length) if slab is not None else (None, None)
    if later_k is not None:  # dk, dv are the kernels' own (or the zeros above): added to in place
        n = later_k.shape[2]
        dk[:, :, :n].add_(later_k)
        dv[:, :, :n].add_(later_v)
    return dq, dk, dv


def _heads_inner(t: Tensor) -> Tensor:
    """(B, H, L, D) laid out as (B, L, H, D) in memory (a copy only if it is not): what torch's
    attention kernels return, out and gradients alike. torchtitan's ``out.transpose(1, 2).contiguous()``
    then takes the output without a copy (so the output projection saves the same storage as this op
    does), and the gradients of q, k, v reach the projections' (B, L, H, D) views without one."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _new_lse(q: Tensor) -> Tensor:
    """An empty log-sum-exp (B, H, L) float32 for queries q (B, H, L, D), laid out as the kernels of
    q's device lay theirs out: torch's CPU flash kernel (B, L, H) in memory, every CUDA kernel
    (B, H, L); so the op returns the kernel's own without a copy."""
    b, h, n, _ = q.shape
    if q.device.type == "cpu":
        return q.new_empty(b, n, h, dtype=torch.float32).transpose(1, 2)
    return q.new_empty(b, h, n, dtype=torch.float32)


def _lse_layout(lse: Tensor) -> Tensor:
    """``lse`` (B, H, L) laid out as :func:`_new_lse` lays it out (a copy only if it is not)."""
    if lse.device.type == "cpu":
        return lse.transpose(1, 2).contiguous().transpose(1, 2)
    return lse.contiguous()


def _whole_sequence_forward(
    kernel: AttentionKernel, q: Tensor, k: Tensor, v: Tensor, documents: Documents | None, scale: float
) -> tuple[Tensor, Tensor]:
    """Causal attention over the whole sequence, block-causal given ``documents`` (one causal call
    per document piece, no mask, nothing before position 0): q (B, Hq, L, D), k, v (B, Hkv, L, D).
    Returns out (B, Hq, L, D) and lse (B, Hq, L) float32."""
    causal, prefix = _calls(documents, ((0, q.shape[2]),), kernel.bottom_right)
    return _attention_forward(kernel, q, _Keys((k, v), 0, None), causal, prefix, scale)


def _whole_sequence_backward(
    kernel: AttentionKernel,
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    documents: Documents | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (shaped like q, k, v) of :func:`_whole_sequence_forward`, given its ``out`` and ``lse``."""
    causal, prefix = _calls(documents, ((0, q.shape[2]),), kernel.bottom_right)
    return _attention_backward(kernel, dout, q, _Keys((k, v), 0, None), out, lse, causal, prefix, scale)


def _own_keys(
    context: KVContext, kernel: AttentionKernel, layer_id: int, phase: Phase, k: Tensor, v: Tensor
) -> tuple[tuple[Tensor, Tensor], KVSlab]:
    """The running unit's own K and V (B, Hkv, L, D) in position order, and its microbatch's slab:
    FORWARD writes them into the slab (gathered over the CP group, each rank's ``k``, ``v`` being its
    share); RECOMPUTE reads the slab its forward wrote, where under CP the whole unit's K/V lie."""
    shard = context.shard
    if phase is Phase.FORWARD:
        k, v = shard.gather(k), shard.gather(v)
        cp = shard.size > 1  # other ranks' chunks of the unit read keys of the last unit too
        return (k, v), context.append(layer_id, k, v, with_own=kernel.bottom_right or cp, ascending=kernel.bottom_right)
    slab = context.recorded(layer_id)
    if shard.size > 1:
        own_k, own_v, flipped = context.own(layer_id)
        k, v = (own_k.flip(2), own_v.flip(2)) if flipped else (own_k, own_v)
    return (k, v), slab


@torch.library.custom_op("torchtitan_seq::unit_attention", mutates_args=())
def _unit_attention(
    q: Tensor, k: Tensor, v: Tensor, ids: Tensor, scale: float, compiled: bool
) -> tuple[Tensor, Tensor]:
    """A bound layer's attention (``ids``: its binding), in the KV context's phase: FORWARD, the
    unit's K/V (B, Hkv, L, D) written into its microbatch's slab first, its queries q (B, Hq, L, D)
    attend to the prefix and their own keys; RECOMPUTE, the same from the slab the unit's forward
    wrote, nothing written; outside a unit, causal attention over ``q``'s sequence. Under context
    parallelism q, k and v are the CP rank's share of the unit (L / c tokens), and the unit's K/V
    are gathered over the CP group. ``compiled``: called from a compiled graph (see
    :func:`_save_unit`). Returns out (B, Hq, L, D) and lse (B, Hq, L) float32."""
    binding = _bound(ids)
    context, kernel, layer_id = binding.context, binding.kernel, binding.layer_id
    phase = context.phase(forward=True)
    if phase is None:
        out, lse = _whole_sequence_forward(kernel, q, k, v, None, scale)
    else:
        unit = context.unit
        own, slab = _own_keys(context, kernel, layer_id, phase, k, v)
        causal, prefix = _calls(context.documents_of(unit), unit.segments, kernel.bottom_right)
        out, lse = _attention_forward(kernel, q, _Keys(own, unit.offset, slab), causal, prefix, scale)
    return _heads_inner(out), _lse_layout(lse)


@torch.library.custom_op("torchtitan_seq::unit_attention_backward", mutates_args=())
def _unit_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, ids: Tensor, scale: float, kv_flipped: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (shaped like q, k, v) of :func:`_unit_attention`, given dout, its out and lse
    (``kv_flipped``: k and v as a descending slab holds them, last position first). In phase
    BACKWARD it sends the dK/dV of the prefix the unit read to its slab's gradient, and adds what
    the later units (run backward first) sent the unit's own keys; outside a unit, the gradients
    of causal attention over the whole sequence. Under context parallelism k and v are the whole
    unit's, as saved, and so are dk and dv: this rank's part of them (:func:`_unit_backward`
    reduce-scatters them). The gradients are laid out as :func:`_heads_inner` lays them out."""
    binding = _bound(ids)
    context, kernel, layer_id = binding.context, binding.kernel, binding.layer_id
    if kv_flipped:  # a copy of the unit's own K/V for its causal calls, not of the prefix
        k, v = k.flip(2), v.flip(2)
    if context.phase(forward=False) is None:
        dq, dk, dv = _whole_sequence_backward(kernel, dout, q, k, v, out, lse, None, scale)
    else:
        unit = context.unit
        keys = _Keys((k, v), unit.offset, context.recorded(layer_id))
        causal, prefix = _calls(context.documents_of(unit), unit.segments, kernel.bottom_right)
        dq, dk, dv = _attention_backward(kernel, dout, q, keys, out, lse, causal, prefix, scale)
    # A custom op's outputs must have the strides of its fake implementation.
    return _heads_inner(dq), _heads_inner(dk), _heads_inner(dv)


@torch.library.custom_op("torchtitan_seq::document_attention", mutates_args=())
def _document_attention(q: Tensor, k: Tensor, v: Tensor, documents: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Block-causal attention of whole packed sequences, no unit: q (B, Hq, L, D), k, v
    (B, Hkv, L, D), ``documents`` (B, L) their ids. Returns out (B, Hq, L, D) and lse (B, Hq, L)."""
    out, lse = _whole_sequence_forward(select_kernel(q.device), q, k, v, Documents.of_batch(documents), scale)
    return _heads_inner(out), _lse_layout(lse)


@torch.library.custom_op("torchtitan_seq::document_attention_backward", mutates_args=())
def _document_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, documents: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (shaped like q, k, v, laid out as :func:`_heads_inner` lays them out) of
    :func:`_document_attention`, given dout, its out and lse."""
    kernel, packed = select_kernel(q.device), Documents.of_batch(documents)
    dq, dk, dv = _whole_sequence_backward(kernel, dout, q, k, v, out, lse, packed, scale)
    return _heads_inner(dq), _heads_inner(dk), _heads_inner(dv)


def _fake_attention(q: Tensor, *_) -> tuple[Tensor, Tensor]:
    """out (B, Hq, L, D) laid out as :func:`_heads_inner` lays it out, and lse (B, Hq, L) float32 as
    :func:`_new_lse` lays it out."""
    b, h, n, d = q.shape
    return q.new_empty(b, n, h, d).transpose(1, 2), _new_lse(q)


def _fake_gradients(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, *_) -> tuple[Tensor, ...]:
    """dq, dk, dv shaped like q, k, v, laid out as :func:`_heads_inner` lays them out."""
    return tuple(t.new_empty(t.shape[0], t.shape[2], t.shape[1], t.shape[3]).transpose(1, 2) for t in (q, k, v))


def _save_unit(ctx, inputs, output) -> None:
    """Saves q, the output and log-sum-exp, and the unit's K/V: in eager mode the slab's views
    where they lie (the slab is then the one copy of K/V, and the saved-tensor count sees it; under
    context parallelism the whole unit's, gathered); a compiled graph saves its own k, v (the op's
    Python state is not traced)."""
    q, k, v, ids, ctx.scale, compiled = inputs
    ctx.kv_flipped, ctx.shard = False, None
    if not compiled:
        binding = _bound(ids)
        context = binding.context
        k, v, ctx.kv_flipped = context.own(binding.layer_id) or (k, v, False)
        ctx.shard = context.shard if context.unit is not None and context.shard.size > 1 else None
    ctx.save_for_backward(q, k, v, *output, ids)
    ctx.set_materialize_grads(False)  # no zeros for the log-sum-exp's gradient, which backward ignores


def _unit_backward(ctx, dout: Tensor, _dlse: Tensor | None):
    """dq, dk, dv, under context parallelism dk and dv of this rank's share of the unit, summed over
    the CP ranks' queries; no gradient for ids, scale and compiled."""
    dq, dk, dv = _unit_attention_backward(dout, *ctx.saved_tensors, ctx.scale, ctx.kv_flipped)
    if ctx.shard is not None:
        dk, dv = ctx.shard.reduce_scatter(dk), ctx.shard.reduce_scatter(dv)
    return dq, dk, dv, None, None, None


def _save_documents(ctx, inputs, output) -> None:
    """Saves q, k, v, the output and log-sum-exp, and the document ids."""
    q, k, v, documents, ctx.scale = inputs
    ctx.save_for_backward(q, k, v, *output, documents)
    ctx.set_materialize_grads(False)


def _documents_backward(ctx, dout: Tensor, _dlse: Tensor | None):
    """dq, dk, dv; no gradient for documents and scale."""
    return *_document_attention_backward(dout, *ctx.saved_tensors, ctx.scale), None, None


_unit_attention.register_fake(_fake_attention)
_document_attention.register_fake(_fake_attention)
_unit_attention_backward.register_fake(_fake_gradients)
_document_attention_backward.register_fake(_fake_gradients)
_unit_attention.register_autograd(_unit_backward, setup_context=_save_unit)
_document_attention.register_autograd(_documents_backward, setup_context=_save_documents)


def _whole_sequence_attention(
    q: Tensor, k: Tensor, v: Tensor, documents: Tensor | None, scale: float | None, is_causal: bool, enable_gqa: bool
) -> Tensor:
    """Attention over whole sequences, no unit (torch's schedules, no pipeline): torchtitan's SDPA,
    or, given ``documents`` (B, L) ids, block-causal attention by ``torchtitan_seq::document_attention``
    (no mask built). q (B, Hq, L, D); k, v (B, Hkv, L, D). Returns (B, Hq, L, D)."""
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=is_causal, enable_gqa=enable_gqa)
    if not is_causal:
        raise ValueError("SequenceAttention runs packed documents block-causally only")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.torchtitan_seq.document_attention(q, k, v, documents, scale)[0]


class SequenceAttention(nn.Module):
    """Drop-in for torchtitan's ``ScaledDotProductAttentionWrapper``. Unbound, it computes
    exactly what torchtitan's Llama 3 computes: causal SDPA over the whole sequence
    (block-causal given documents, by ``torchtitan_seq::document_attention``).
    Bound to a stage's KV context (:meth:`bind`: after construction, as torchtitan deep-copies
    the model per pipeline stage and each stage has its own context), it runs
    ``torchtitan_seq::unit_attention`` on the units the context announces."""

    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.ids: Tensor | None = None  # names the binding, on the host: see the module docstring
        self._binding: _Binding | None = None

    def bind(self, context: KVContext, kernel: AttentionKernel) -> None:
        self.ids = torch.tensor([self.layer_id], device="cpu")  # a storage of its own, whose address is the handle
        _BINDINGS[self.ids.data_ptr()] = self._binding = _Binding(context, kernel, self.layer_id)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        scale: float | None = None,
        enable_gqa: bool = False,
        is_causal: bool = True,
        documents: Tensor | None = None,
    ) -> Tensor:
        """q: (B, Hq, L, D) post-RoPE; k, v: (B, Hkv, L, D) post-RoPE, before GQA expansion.
        documents: (B, L) document ids of a packed batch (block-causal attention), read
        when unbound; a bound layer reads its unit's documents from the KV context.
        Returns (B, Hq, L, D)."""
        if self.ids is None:
            return _whole_sequence_attention(q, k, v, documents, scale, is_causal, enable_gqa)
        if not is_causal:
            raise ValueError("SequenceAttention runs units of causal attention only")
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        compiled = torch.compiler.is_compiling()
        return torch.ops.torchtitan_seq.unit_attention(q, k, v, self.ids, scale, compiled)[0]


def bind_kv_context(model: nn.Module, context: KVContext, kernel: AttentionKernel) -> None:
    """Attach ``context`` and ``kernel`` to every :class:`SequenceAttention` of a model chunk,
    and the context to the chunk itself where it reads it (``model.kv_context``: RoPE at the
    unit's offset). A chunk may hold no attention layer (the output layer alone), but a model
    whose attention is not chunk-aware cannot run units."""
    layers = [m for m in model.modules() if isinstance(m, SequenceAttention)]
    if not layers and not hasattr(model, "kv_context"):
        raise TypeError(
            f"{type(model).__name__} has no chunk-aware attention: sequence schedules need "
            '[model] name = "llama3_seq" (or SequenceAttention layers in a model of your own)'
        )
    for m in layers:
        m.bind(context, kernel)
    if hasattr(model, "kv_context"):
        model.kv_context = context
