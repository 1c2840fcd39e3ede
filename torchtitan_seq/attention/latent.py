"""Unit attention over MLA's latent context (``kv_context = "latent"``,
:mod:`torchtitan_seq.runtime.kv_latent`): a unit reads its prefix's normed latent and RoPE key from the
context and expands them into keys and values itself, inside its own autograd graph.

Per MLA layer and unit at offset s, two autograd functions and MLA's own expansion between them:

- :class:`LatentPrefix` writes the unit's normed latent c (B, L, r) and RoPE key (B, L, rope) into its
  microbatch's latent slab (forward; a recomputation writes nothing) and returns the prefix's, [0, s),
  detached from the units that wrote them. Its backward adds the gradient the unit sends the prefix into
  the slab's gradient, and returns as the gradient of the unit's own latent what later units (run backward
  first: ``torchtitan_seq.schedules.ordering``) sent its positions, once.
- :func:`expand` expands the prefix as MLA does (wkv_b, then the RoPE key beside every head's key) with
  autograd, so wkv_b's gradient from the prefix is the unit's own; torch's split backward finds it too (the
  expansion's input comes from the stage input through :class:`LatentPrefix`).
- :class:`LatentAttention` attends the unit's queries over the expanded prefix and its own keys (the
  unit's kernel calls, as :mod:`.calls` makes them, over keys [0, s + L) in position order) and returns
  the gradients of both. It does not keep the expanded prefix (H (qk_head_dim + v_head_dim) a position,
  what the context saves): its backward expands it again from the latent, a recomputation of wkv_b over
  the prefix.

The unit's own keys and values are the layer's (expanded by the model, saved by the attention as the
last unit's are under ``"full"``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx

from torchtitan_seq.attention.calls import Keys, attention_backward, attention_forward
from torchtitan_seq.attention.handles import LayerBinding
from torchtitan_seq.attention.unit_op import unit_calls
from torchtitan_seq.runtime.kv_context import Phase
from torchtitan_seq.runtime.kv_latent import LatentSlab

__all__ = ["LatentSource", "LatentAttention", "LatentPrefix", "expand", "latent_unit_attention"]


class LatentSource(Protocol):
    """What an MLA layer's inner attention reads of its layer under ``kv_context = "latent"`` (a family's
    seam provides it: torchtitan 0.2.2's in ``family_adapters``)."""

    nope_dim: int
    """A head's key width without RoPE (``qk_nope_head_dim``)."""

    def take(self) -> Tensor | None:
        """The call's normed latent (B, L, r), kv_norm's output, handed over once (None: none recorded)."""
        ...

    def weight(self) -> Tensor:
        """The up-projection's weight (H (nope_dim + v_head_dim), r), wkv_b's."""
        ...


def expand(latent: Tensor, rope: Tensor, weight: Tensor, nope_dim: int, heads: int) -> tuple[Tensor, Tensor]:
    """Keys and values of positions from their normed latent, as MLA expands them.

    Args:
        latent: (B, n, r) normed latents.
        rope: (B, n, rope) RoPE key parts, post-RoPE.
        weight: the up-projection's weight (heads (nope_dim + Dv), r).
        nope_dim: a head's key width without RoPE.
        heads: heads (the local ones).

    Returns:
        Keys (B, heads, n, nope_dim + rope) and values (B, heads, n, Dv).
    """
    b, n, _ = latent.shape
    kv = F.linear(latent, weight).view(b, n, heads, weight.shape[0] // heads)
    k_nope, v = kv.split([nope_dim, kv.shape[-1] - nope_dim], dim=-1)
    k = torch.cat([k_nope, rope.unsqueeze(2).expand(-1, -1, heads, -1)], dim=-1)
    return k.transpose(1, 2), v.transpose(1, 2)


class LatentPrefix(torch.autograd.Function):
    """``apply(latent, rope, binding)`` -> the prefix's latent (B, s, r) and RoPE key (B, s, rope), read from
    the running unit's latent slab (its own written first, in its forward); see the module docstring."""

    @staticmethod
    def forward(ctx: FunctionCtx, latent: Tensor, rope: Tensor, binding: LayerBinding) -> tuple[Tensor, Tensor]:
        context = binding.context
        unit, latents = context.unit, context.latents
        if context.phase(forward=True) is Phase.FORWARD:
            ctx.slab = latents.write(unit.microbatch, unit.index, unit.offset, binding.layer_id, latent, rope)
        else:  # recomputed in the unit's backward: as its forward left it
            ctx.slab = latents.recorded(unit.microbatch, unit.offset, binding.layer_id)
        ctx.offset, ctx.length, ctx.sent = unit.offset, latent.shape[1], False
        ctx.set_materialize_grads(False)
        return ctx.slab.prefix(unit.offset)

    @staticmethod
    def backward(ctx: FunctionCtx, grad_latent: Tensor | None, grad_rope: Tensor | None) -> tuple[Tensor | None, ...]:
        slab: LatentSlab = ctx.slab
        # Once: a split backward's weight pass runs this again (the RoPE key, a slice of the layer's keys, joins
        # wkv_b's output in one concatenation, so torch's weight pass walks through it toward wkv_b).
        if not ctx.sent:
            slab.accumulate(grad_latent, grad_rope)
            ctx.sent = True
        sent = slab.sent(ctx.offset, ctx.length)
        return (None, None, None) if sent is None else (*sent, None)


def _keys(k_prefix: Tensor, v_prefix: Tensor, k: Tensor, v: Tensor) -> Keys:
    """The unit's keys and values [0, s + L) in position order, the prefix's (B, H, s, D) then its own, as
    the kernel calls read them (one tensor each: a bottom-right kernel reads them in one call)."""
    return Keys((torch.cat([k_prefix, k], dim=2), torch.cat([v_prefix, v], dim=2)), 0, None)


class LatentAttention(torch.autograd.Function):
    """``apply(q, k, v, k_prefix, v_prefix, binding, scale, expand_prefix)`` -> out (B, Hq, L, Dv): the running
    unit's queries (B, Hq, L, D) over the prefix's keys and values (B, H, s, D|Dv), expanded from the latent,
    and its own (B, H, L, D|Dv); ``expand_prefix()`` expands the prefix again for the backward."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_prefix: Tensor,
        v_prefix: Tensor,
        binding: LayerBinding,
        scale: float,
        expand_prefix: Callable[[], tuple[Tensor, Tensor]],
    ) -> Tensor:
        context, kernel = binding.context, binding.kernel
        causal, prefix = unit_calls(context, kernel.bottom_right, binding.reach)
        keys = _keys(k_prefix, v_prefix, k, v)
        out, lse = attention_forward(kernel, q, keys, causal, prefix, scale)
        ctx.binding, ctx.scale, ctx.expand_prefix = binding, scale, expand_prefix
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)  # no zeros for the log-sum-exp's gradient, which backward ignores
        return out

    @staticmethod
    def backward(ctx: FunctionCtx, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        binding = ctx.binding
        k_prefix, v_prefix = ctx.expand_prefix()
        causal, prefix = unit_calls(binding.context, binding.kernel.bottom_right, binding.reach)
        keys = _keys(k_prefix, v_prefix, k, v)
        dq, dk, dv = attention_backward(binding.kernel, dout, q, keys, out, lse, causal, prefix, ctx.scale)
        s = k_prefix.shape[2]
        return dq, dk[:, :, s:], dv[:, :, s:], dk[:, :, :s], dv[:, :, :s], None, None, None


def latent_unit_attention(
    q: Tensor, k: Tensor, v: Tensor, latent: Tensor, source: LatentSource, binding: LayerBinding, scale: float
) -> Tensor:
    """A bound MLA layer's attention for the running unit under ``kv_context = "latent"``.

    Args:
        q: (B, H, L, nope + rope) queries, post-RoPE.
        k: (B, H, L, nope + rope) the unit's own keys, every head's RoPE part the same.
        v: (B, H, L, Dv) the unit's own values.
        latent: (B, L, r) the unit's normed latent, from which the layer expanded ``k`` and ``v``.
        source: the layer's up-projection.
        binding: the layer's binding to the stage's KV context.
        scale: the softmax scale.

    Returns:
        (B, H, L, Dv).
    """
    nope, heads = source.nope_dim, q.shape[1]
    rope = k[:, 0, :, nope:]  # the RoPE key part every head shares: (B, L, rope)
    prefix_latent, prefix_rope = LatentPrefix.apply(latent, rope, binding)
    weight = source.weight()
    k_prefix, v_prefix = expand(prefix_latent, prefix_rope, weight, nope, heads)
    saved = (prefix_latent.detach(), prefix_rope.detach(), weight.detach())

    def expand_prefix() -> tuple[Tensor, Tensor]:
        return expand(*saved, nope, heads)

    return LatentAttention.apply(q, k, v, k_prefix, v_prefix, binding, scale, expand_prefix)
