"""What an MLA layer's inner attention reads of its layer under ``kv_context = "latent"``
(:mod:`torchtitan_seq.attention.latent`), for torchtitan 0.2.2's and 0.3's DeepSeek-V3 alike: both
compute ``kv = wkv_b(kv_norm(kv))`` in their attention, with the same module names, so the call's normed
latent is kv_norm's output, kept for the inner attention to take, and the up-projection is wkv_b.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch import Tensor, nn

__all__ = ["MLALatent", "mla_latent"]


class _RecordingNorm(nn.Module):
    """Mixed before MLA's kv_norm class: keeps its output (the call's normed latent) for the layer's inner
    attention to take (:meth:`MLALatent.take`)."""

    recorded: Tensor | None

    def forward(self, x: Tensor) -> Tensor:
        self.recorded = super().forward(x)
        return self.recorded


@functools.cache
def _recording_norm_class(norm_cls: type[nn.Module]) -> type[nn.Module]:
    """``norm_cls`` keeping its output (one subclass per class)."""
    return type(norm_cls.__name__, (_RecordingNorm, norm_cls), {})


@dataclass(eq=False)
class MLALatent:
    """A DeepSeek-V3 attention layer as its inner attention reads it under ``kv_context =
    "latent"`` (a :class:`~torchtitan_seq.attention.latent.LatentSource`): the call's normed latent, kept by
    its kv_norm, and its up-projection wkv_b."""

    norm: nn.Module
    up: nn.Module
    nope_dim: int

    def take(self) -> Tensor | None:
        """The call's normed latent (B, L, kv_lora_rank), handed over once."""
        latent, self.norm.recorded = self.norm.recorded, None
        return latent

    def weight(self) -> Tensor:
        """wkv_b's weight (n_heads (qk_nope_head_dim + v_head_dim), kv_lora_rank)."""
        return self.up.weight


def mla_latent(attention: nn.Module) -> MLALatent | None:
    """An MLA layer's latent for its inner attention: its kv_norm made to keep each call's output.

    Args:
        attention: a block's attention module.

    Returns:
        DeepSeek-V3's: its :class:`MLALatent`; None for attention without a latent.
    """
    if not hasattr(attention, "wkv_b"):
        return None
    norm = attention.kv_norm
    norm.__class__ = _recording_norm_class(type(norm))
    norm.recorded = None
    return MLALatent(norm, attention.wkv_b, attention.qk_nope_head_dim)
