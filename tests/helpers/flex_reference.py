"""The exactness reference of torchtitan 0.2.2's flex families (DeepSeek-V3, Llama 4, gpt-oss): the family's
own model class with its own flex masks, attention computed densely.

torch's flex attention has no backward on CPU, so :class:`MaskModAttention` stands in for torchtitan's
``FlexAttentionWrapper``: it evaluates the ``BlockMask``'s own ``mask_mod`` (torchtitan's causal, document,
sliding-window and fixed-block mask mods) at every (query, key) pair and attends with plain softmax
arithmetic, returning the log-sum-exp gpt-oss merges its sinks with. Nothing of torchtitan_seq runs
on this side: the masks are torchtitan's (:func:`own_masks`), the arithmetic plain torch.
"""

from __future__ import annotations

import sys
import types
from unittest import mock

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask

__all__ = ["MaskModAttention", "own_masks", "use_mask_mod_attention"]


class MaskModAttention(torch.nn.Module):
    """``FlexAttentionWrapper``'s call, computed densely from the block mask's ``mask_mod``.

    Args:
        mask_key: the key of the layer's mask where its model hands the layer a dict of them (Llama 4's
            ``"rope"`` or ``"nope"``: torchtitan 0.2.2's Llama 4 hands its inner attention the whole dict).
    """

    def __init__(self, mask_key: str | None = None) -> None:
        super().__init__()
        self.mask_key = mask_key

    def forward(self, q, k, v, *, block_mask, scale=None, return_lse=False, enable_gqa=False, score_mod=None):
        """q (B, Hq, L, Dqk), k (B, Hkv, L, Dqk), v (B, Hkv, L, Dv): the output (B, Hq, L, Dv), and with
        ``return_lse`` the log-sum-exp (B, Hq, L)."""
        if isinstance(block_mask, dict):
            block_mask = block_mask[self.mask_key]
        assert isinstance(block_mask, BlockMask) and score_mod is None
        length = q.shape[2]
        allowed = create_mask(block_mask.mask_mod, block_mask.kv_num_blocks.shape[0], 1, length, length, q.device)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse = scores.logsumexp(-1)
        out = (scores - lse.unsqueeze(-1)).exp() @ v
        return (out, lse) if return_lse else out


def use_mask_mod_attention(model: torch.nn.Module) -> None:
    """Give every layer of torchtitan's own flex model a :class:`MaskModAttention`."""
    for layer in model.layers.values():
        use_rope = getattr(layer.attention, "use_rope", None)
        layer.attention.inner_attention = MaskModAttention(None if use_rope is None else ("nope", "rope")[use_rope])


def own_masks(model: torch.nn.Module, tokens: torch.Tensor, eos_id: int):
    """The masks ``model`` (torchtitan's own flex model) builds for ``tokens``, by its own
    ``get_attention_masks``; its block masks made eagerly on the CPU (torchtitan compiles them)."""
    family = sys.modules[type(model).__module__]
    eager = mock.patch.object(family, "create_attention_mask", lambda *a: create_block_mask(*a, device=tokens.device))
    with eager:
        return model.get_attention_masks(tokens, types.SimpleNamespace(eos_id=eos_id))
