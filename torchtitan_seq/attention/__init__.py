"""Chunk-aware causal attention for one unit of a subsequence pipeline, a module a concept: the
attention op and its autograd (this module), the kernel calls it makes (:mod:`.calls`) and the
layouts of what it returns (:mod:`.layouts`), the whole-sequence document path (:mod:`.whole_sequence`)
and binding a model's attention to a stage's KV context (:mod:`.binding`). The block kernels it calls
are in :mod:`torchtitan_seq.kernels`.

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

import torch
from torch import Tensor

# Beside __all__, every name the module had before it became a package (the tests reach some of its
# helpers as torchtitan_seq.attention.<name>, and patch _calls here: the op below looks it up here).
from ..documents import Documents  # noqa: F401
from ..kernels import AttentionKernel, select_kernel  # noqa: F401
from ..kv_context import KVContext, KVSlab, Phase
from .binding import _BINDINGS, SequenceAttention, _Binding, _bound, bind_kv_context  # noqa: F401
from .calls import _EVERY, _attention_backward, _attention_forward, _Call, _calls, _Keys, _merge_into  # noqa: F401
from .layouts import _fake_attention, _fake_gradients, _heads_inner, _lse_layout, _new_lse  # noqa: F401
from .whole_sequence import (  # noqa: F401
    _document_attention,
    _document_attention_backward,
    _documents_backward,
    _save_documents,
    _whole_sequence_attention,
    _whole_sequence_backward,
    _whole_sequence_forward,
)

__all__ = ["SequenceAttention", "bind_kv_context"]


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


_unit_attention.register_fake(_fake_attention)
_unit_attention_backward.register_fake(_fake_gradients)
_unit_attention.register_autograd(_unit_backward, setup_context=_save_unit)
