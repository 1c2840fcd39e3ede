"""The unit attention op: a bound layer's attention in the KV context's phase, forward and backward,
as custom ops (torch.compile, dispatch modes) and as an autograd function (eager mode)."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

from ..kernels import AttentionKernel
from ..kv_context import KVContext, KVSlab, Phase
from .calls import _attention_backward, _attention_forward, _calls, _Keys
from .handles import _bound
from .layouts import _fake_attention, _fake_gradients, _heads_inner, _lse_layout
from .whole_sequence import _whole_sequence_backward, _whole_sequence_forward

__all__ = ["UnitAttention"]


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


def _gradients(backward, ctx, dout: Tensor):
    """dq, dk, dv by ``backward`` (the backward op or its Python function), under context parallelism
    dk and dv of this rank's share of the unit, summed over the CP ranks' queries; no gradient for ids,
    scale and compiled."""
    dq, dk, dv = backward(dout, *ctx.saved_tensors, ctx.scale, ctx.kv_flipped)
    if ctx.shard is not None:
        dk, dv = ctx.shard.reduce_scatter(dk), ctx.shard.reduce_scatter(dv)
    return dq, dk, dv, None, None, None


# The custom ops, for torch.compile (which keeps them out of its graphs) and dispatch modes (under
# which the whole op is one op: selective checkpointing saves or recomputes it as one).
_unit_attention_op = torch.library.custom_op("torchtitan_seq::unit_attention", mutates_args=())(_unit_attention)
_unit_attention_backward_op = torch.library.custom_op("torchtitan_seq::unit_attention_backward", mutates_args=())(
    _unit_attention_backward
)
_unit_attention_op.register_fake(_fake_attention)
_unit_attention_backward_op.register_fake(_fake_gradients)
_unit_attention_op.register_autograd(
    lambda ctx, dout, _dlse: _gradients(_unit_attention_backward_op, ctx, dout), setup_context=_save_unit
)


class UnitAttention(torch.autograd.Function):
    """The op's autograd in eager mode: the same Python functions and saved tensors without the
    dispatcher's round trips of a custom op (its autograd wrapper, redispatch and dynamo guards:
    about 100 of the unit path's host µs per unit and layer, ``benchmarks/unit_host.py``).
    ``apply(q, k, v, ids, scale, compiled)`` -> (out, lse), as the op."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, q: Tensor, k: Tensor, v: Tensor, ids: Tensor, scale: float, compiled: bool
    ) -> tuple[Tensor, Tensor]:
        # ctx as forward's first argument: with a separate setup_context, Function.apply binds every
        # call's arguments to forward's signature (inspect, about 16 µs a call)
        output = _unit_attention(q, k, v, ids, scale, compiled)
        _save_unit(ctx, (q, k, v, ids, scale, compiled), output)
        return output

    @staticmethod
    def backward(ctx: FunctionCtx, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        return _gradients(_unit_attention_backward, ctx, dout)
