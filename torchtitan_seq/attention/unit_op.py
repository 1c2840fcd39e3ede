"""The unit attention op: a bound layer's attention in the KV context's phase, forward and backward,
as an autograd function (eager mode) and as custom ops (torch.compile, dispatch modes)."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

from torchtitan_seq.attention.calls import (
    Call,
    Keys,
    attention_backward,
    attention_forward,
    kernel_calls,
    sink_gradient,
)
from torchtitan_seq.attention.function_apply import function_apply
from torchtitan_seq.attention.handles import LayerBinding, binding_of
from torchtitan_seq.attention.kernels import AttentionKernel
from torchtitan_seq.attention.layouts import fake_attention, fake_gradients, heads_inner, lse_layout, sink_output
from torchtitan_seq.attention.whole_sequence import whole_sequence_backward, whole_sequence_forward
from torchtitan_seq.runtime.context_parallel import ContextShard
from torchtitan_seq.runtime.kv_context import KVContext, Phase, Unit
from torchtitan_seq.runtime.kv_slab import KVSlab, Stored
from torchtitan_seq.runtime.reach import Reach

__all__ = ["UnitAttention", "apply_unit_attention", "unit_calls"]


def _own_keys(
    context: KVContext, binding: LayerBinding, phase: Phase, k: Tensor, v: Tensor, saves_given: bool
) -> tuple[tuple[Tensor, Tensor], KVSlab, Stored | None]:
    """The running unit's own K and V (B, Hkv, L, D) in position order, its microbatch's slab, and
    where the slab holds the unit's K/V (None: nowhere): FORWARD writes them into the slab (gathered
    over the CP group, each rank's ``k``, ``v`` being its share; ``saves_given``: the caller's autograd
    saves ``k``, ``v`` as given where the slab does not hold them, :meth:`KVContext.append`); RECOMPUTE
    reads the slab its forward wrote, where under CP the whole unit's K/V lie."""
    shard = context.shard
    if phase is Phase.FORWARD:
        cp = shard.size > 1  # other ranks' chunks of the unit read keys of the last unit too
        if cp:
            k, v = shard.gather(k), shard.gather(v)
        slab, stored = context.append(binding.layer_id, k, v, cp, binding.reach, saves_given and not cp)
        return (k, v), slab, stored
    stored = context.own(binding.layer_id)
    if shard.size > 1:
        own_k, own_v, flipped = stored
        k, v = (own_k.flip(2), own_v.flip(2)) if flipped else (own_k, own_v)
    return (k, v), context.recorded(binding.layer_id), stored


def _one_call(kernel: AttentionKernel, slab: KVSlab, unit: Unit) -> bool:
    """Whether ``unit`` reads its prefix and own keys in one causal call: with a kernel that aligns causal
    masks bottom-right, from a slab that lays them out in position order (not descending) and holds the
    unit's own keys (every unit's but the last one's, which no later unit reads; under CP every unit's).
    Elsewhere two calls and a merge, as with a top-left kernel; so the kernel changes neither where the
    slabs lie nor their size, which the memory model plans for every kernel alike."""
    return kernel.bottom_right and not slab.descending and slab.holds(unit.offset + unit.length)


def unit_calls(context: KVContext, one_call: bool, reach: Reach) -> tuple[tuple[Call, ...], tuple[Call, ...]]:
    """The kernel calls of the running unit (:func:`.calls.kernel_calls`; ``one_call``: :func:`_one_call`'s)
    for layers of ``reach``, built by the first of its attention layers to ask and kept by the context for
    the others while the unit runs (each layer asking costs the host a few calls; packed documents' calls
    would be built again by each)."""
    per_unit = context.per_unit
    calls = per_unit.of(one_call, reach)
    if calls is None:
        unit = context.unit
        calls = kernel_calls(context.documents_of(unit), unit.segments, one_call, reach)
        per_unit.keep(one_call, reach, calls)
    return calls


def _unit_attention(
    binding: LayerBinding, q: Tensor, k: Tensor, v: Tensor, scale: float, sinks: Tensor | None, saves_given: bool
) -> tuple[Tensor, Tensor, Stored | None]:
    """A bound layer's attention, in its KV context's phase: FORWARD, the unit's K/V (B, Hkv, L, D)
    written into its microbatch's slab first, its queries q (B, Hq, L, D) attend to the prefix and
    their own keys; RECOMPUTE, the same from the slab the unit's forward wrote, nothing written;
    outside a unit, causal attention over ``q``'s sequence. Under context parallelism q, k and v are
    the CP rank's share of the unit (L / c tokens), and the unit's K/V are gathered over the CP group.
    Keys and values are read within the layer's reach, and ``sinks`` (Hq,), where given, are merged once.
    ``saves_given``: the caller saves ``k``, ``v`` for backward as they are where the slab does not hold them
    (an eager autograd function; a compiled graph saves what its partition chooses).
    Returns out (B, Hq, L, Dv) and lse (B, Hq, L) float32 as the kernels lay them out, and where the
    slab holds the unit's K/V (None: nowhere, or outside a unit)."""
    context, kernel, reach = binding.context, binding.kernel, binding.reach
    phase = context.phase(forward=True)
    if phase is None:
        return *whole_sequence_forward(kernel, q, k, v, None, scale, reach, sinks), None
    unit = context.unit
    own, slab, stored = _own_keys(context, binding, phase, k, v, saves_given)
    causal, prefix = unit_calls(context, _one_call(kernel, slab, unit), reach)
    keys = Keys(own, unit.offset, slab)
    return *attention_forward(kernel, q, keys, causal, prefix, scale, sinks), stored


def _unit_attention_backward(
    binding: LayerBinding, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
    kv_flipped: bool, sinks: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:  # fmt: skip
    """dq, dk, dv (shaped like q, k, v) and dsinks (None without sinks) of :func:`_unit_attention`,
    given dout, its out and lse
    (``kv_flipped``: k and v as a descending slab holds them, last position first). In phase
    BACKWARD it sends the dK/dV of the prefix the unit read to its slab's gradient, and adds what
    the later units (run backward first) sent the unit's own keys; outside a unit, the gradients
    of causal attention over the whole sequence. Under context parallelism k and v are the whole
    unit's, as saved, and so are dk and dv: this rank's part of them (:func:`_reduce_scattered`)."""
    context, kernel, reach = binding.context, binding.kernel, binding.reach
    if kv_flipped:  # a copy of the unit's own K/V for its causal calls, not of the prefix
        k, v = k.flip(2), v.flip(2)
    dsinks = None if sinks is None else sink_gradient(dout, out, lse, sinks)
    if context.phase(forward=False) is None:
        return *whole_sequence_backward(kernel, dout, q, k, v, out, lse, None, scale, reach), dsinks
    unit = context.unit
    slab = context.recorded(binding.layer_id)
    causal, prefix = unit_calls(context, _one_call(kernel, slab, unit), reach)
    keys = Keys((k, v), unit.offset, slab)
    return *attention_backward(kernel, dout, q, keys, out, lse, causal, prefix, scale), dsinks


def _cp_shard(context: KVContext) -> ContextShard | None:
    """The CP group over which the unit's dK/dV are reduce-scattered (None: no unit, or no CP)."""
    return context.shard if context.unit is not None and context.shard.size > 1 else None


def _save(
    ctx: FunctionCtx, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, stored: Stored | None, *rest: Tensor
) -> None:
    """Save q, the unit's K/V, ``sinks`` and ``rest`` (the output, log-sum-exp, ...): the K/V as ``stored``
    in the slab where it holds them (the slab is then the one copy of K/V, and the saved-tensor count sees
    it; under context parallelism the whole unit's, gathered), else ``k``, ``v``."""
    k, v, ctx.kv_flipped = stored or (k, v, False)
    ctx.save_for_backward(q, k, v, sinks, *rest)
    ctx.set_materialize_grads(False)  # no zeros for the log-sum-exp's gradient, which backward ignores


def _reduce_scattered(ctx: FunctionCtx, dq: Tensor, dk: Tensor, dv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Under context parallelism dk and dv of this rank's share of the unit, summed over the CP ranks'
    queries; as they are without."""
    if ctx.shard is not None:
        dk, dv = ctx.shard.reduce_scatter(dk), ctx.shard.reduce_scatter(dv)
    return dq, dk, dv


class UnitAttention(torch.autograd.Function):
    """Unit attention in eager mode: the op's Python functions as an autograd function, without the
    dispatcher's round trips of a custom op (its autograd wrapper, redispatch and dynamo guards) and
    with the layer's binding passed as it is (``benchmarks/unit_host.py`` measures the host time).
    ``apply(q, k, v, binding, scale, sinks)`` -> out, laid out as the kernels lay it out; the log-sum-exp
    is saved for backward, not returned (each output of a Function costs autograd's bookkeeping per call)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, q: Tensor, k: Tensor, v: Tensor, binding: LayerBinding, scale: float, sinks: Tensor | None
    ) -> Tensor:
        # ctx as forward's first argument: with a separate setup_context, Function.apply binds every
        # call's arguments to forward's signature with inspect.signature
        out, lse, stored = _unit_attention(binding, q, k, v, scale, sinks, True)
        ctx.binding, ctx.scale, ctx.shard = binding, scale, _cp_shard(binding.context)
        _save(ctx, q, k, v, sinks, stored, out, lse)
        return out

    @staticmethod
    def backward(ctx: FunctionCtx, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, sinks, out, lse = ctx.saved_tensors
        gradients = _unit_attention_backward(ctx.binding, dout, q, k, v, out, lse, ctx.scale, ctx.kv_flipped, sinks)
        return *_reduce_scattered(ctx, *gradients[:3]), None, None, gradients[3]


apply_unit_attention = function_apply(UnitAttention, tensors=3)
"""``UnitAttention.apply``, without the Python wrapper torch before 2.15 puts around ``Function.apply``
(:func:`~torchtitan_seq.attention.function_apply.function_apply`)."""


# The custom ops, for torch.compile (which keeps them out of its graphs) and dispatch modes (under which
# the whole op is one op: selective checkpointing saves or recomputes it as one). A custom op takes no
# Python objects: the layer's binding is named by ``ids`` (:mod:`.handles`), and what it returns must
# have the strides of its fake implementation (:mod:`.layouts`).


@torch.library.custom_op("torchtitan_seq::unit_attention", mutates_args=())
def _unit_attention_op(
    q: Tensor, k: Tensor, v: Tensor, ids: Tensor, scale: float, compiled: bool, sinks: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """:func:`_unit_attention` of the layer ``ids`` names; ``compiled``: called from a compiled graph
    (see :func:`_save_unit`)."""
    out, lse, _ = _unit_attention(binding_of(ids), q, k, v, scale, sinks, not compiled)
    return heads_inner(out), lse_layout(lse)


@torch.library.custom_op("torchtitan_seq::unit_attention_backward", mutates_args=())
def _unit_attention_backward_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, out: Tensor, lse: Tensor, ids: Tensor,
    scale: float, kv_flipped: bool, compiled: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """:func:`_unit_attention_backward` of the layer ``ids`` names; dsinks empty without sinks (an op
    returns no None). From a compiled graph under context parallelism (``compiled``), ``k`` and ``v`` are
    this rank's share, as the graph saved them: the unit's gathered K/V are read where the slab holds them
    (the graph traces no Python state), and dk, dv are reduce-scattered here, shaped like ``k``, ``v``."""
    binding = binding_of(ids)
    shard = _cp_shard(binding.context) if compiled else None
    if shard is not None:
        k, v, kv_flipped = binding.context.own(binding.layer_id)
    gradients = _unit_attention_backward(binding, dout, q, k, v, out, lse, scale, kv_flipped, sinks)
    dq, dk, dv = gradients[:3]
    if shard is not None:
        dk, dv = shard.reduce_scatter(dk), shard.reduce_scatter(dv)
    return heads_inner(dq), heads_inner(dk), heads_inner(dv), sink_output(gradients[3], q)


def _save_unit(ctx, inputs, output) -> None:
    """The custom op's autograd context: in eager mode (under a dispatch mode) the unit's K/V saved
    where the slab holds them, as :class:`UnitAttention` saves them; a compiled graph saves its own k, v
    (the op's Python state is not traced; under context parallelism the backward op reads the unit's
    gathered K/V from the slab). ``ids`` too, for the backward op."""
    q, k, v, ids, ctx.scale, ctx.compiled, sinks = inputs
    stored, ctx.shard, compiled = None, None, ctx.compiled
    if not compiled:
        binding = binding_of(ids)
        stored, ctx.shard = binding.context.own(binding.layer_id), _cp_shard(binding.context)
    _save(ctx, q, k, v, sinks, stored, *output, ids)


def _op_gradients(ctx, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor | None, ...]:
    """The custom op's backward: its backward op; no gradient for ids, scale and compiled."""
    q, k, v, sinks, *rest = ctx.saved_tensors
    dq, dk, dv, dsinks = _unit_attention_backward_op(
        dout, q, k, v, sinks, *rest, ctx.scale, ctx.kv_flipped, ctx.compiled
    )
    return *_reduce_scattered(ctx, dq, dk, dv), None, None, None, None if sinks is None else dsinks


_unit_attention_op.register_fake(fake_attention)
_unit_attention_backward_op.register_fake(fake_gradients)
_unit_attention_op.register_autograd(_op_gradients, setup_context=_save_unit)
