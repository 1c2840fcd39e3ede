"""What the seam reads of a torchtitan 0.2.2 family beyond Llama 3's layout: each layer's attention reach,
gpt-oss's learned sinks and how its blocks hand their attention a call.

The families put their queries, keys and values where the seam expects them (their attention hands
(B, heads, L, head_dim) tensors to ``inner_attention``); they differ in what a layer's attention reads:

- DeepSeek-V3 (MLA): queries and keys of ``qk_nope_head_dim + qk_rope_head_dim``, values of
  ``v_head_dim``, every head its own keys; its decoupled RoPE part reads ``positions`` as Llama 3 does,
  so the generic seam runs it. Under ``kv_context = "latent"`` its inner attention also reads the call's
  normed latent and wkv_b (:mod:`torchtitan_seq.titan.mla_latent`, as under torchtitan 0.3).
- Llama 4: a flex flavor's RoPE layers (irope: every ``every_n_layers_nope``-th layer is NoPE) attend
  within attention chunks of ``fixed_attn_block_size`` (torchtitan's ``"rope"`` mask), its NoPE
  layers and every layer of an SDPA flavor causally (:func:`layer_reach`).
- gpt-oss: its even layers attend within a sliding window of ``sliding_window_size``
  (:func:`layer_reach`); every head merges a learned sink; its blocks pick a mask out of a dict and
  its attention reads RoPE from the first rows of a ``rope_cache`` table, asserts a ``BlockMask`` and
  applies the sinks after its inner attention as ``out * sigmoid(lse - sinks)``.
  :class:`LayerCall` and :func:`sink_attention_class` keep that forward as it is; its model's forward
  runs every part, which a pipeline stage lacks (torchtitan 0.2.2 runs gpt-oss without a pipeline), so
  a stage runs :func:`stage_forward`.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.attention.flex_attention import BlockMask

from torchtitan_seq.runtime.reach import FULL, Reach

__all__ = ["LayerCall", "layer_reach", "positions_like", "sink_attention_class", "stage_forward"]


def layer_reach(block: nn.Module, model_args: Any) -> Reach:
    """How far back block ``block``'s queries read, as torchtitan masks its flex attention.

    Args:
        block: a transformer block of the family.
        model_args: the flavor's model args (its own attention type, not the seam's).

    Returns:
        gpt-oss's even layers: a sliding window of ``sliding_window_size``; a Llama 4 flex flavor's RoPE
        layers: attention chunks of ``fixed_attn_block_size``; else full causal attention.
    """
    if getattr(block, "use_sliding_attention", False):
        return Reach(window=model_args.sliding_window_size)
    if model_args.attn_type == "flex" and getattr(block.attention, "use_rope", False):
        return Reach(chunk=model_args.fixed_attn_block_size)
    return FULL


def positions_like(table: Tensor, positions: Tensor) -> Tensor:
    """``positions`` as a RoPE ``table`` can be indexed by: a TP plan that hands the layer a distributed
    table (Qwen3's, gpt-oss's) indexes it by positions of the same kind, which torchtitan makes so
    only under its own CP.

    Args:
        table: the layer's RoPE table, a tensor or a replicated DTensor.
        positions: (1, L) positions.

    Returns:
        ``positions``, replicated over the table's mesh where the table is a DTensor.
    """
    if isinstance(table, DTensor) and not isinstance(positions, DTensor):
        return DTensor.from_local(positions, table.device_mesh, [Replicate()] * table.device_mesh.ndim)
    return positions


class LayerCall(BlockMask):
    """What a gpt-oss block hands its attention in place of a flex mask: the call's document ids, RoPE
    positions and (per layer) sinks. A ``BlockMask`` only because gpt-oss's attention asserts one; no
    mask of its own (the inner attention reads the documents and its layer's reach)."""

    def __init__(self, documents: Tensor | None, positions: Tensor | None, sinks: Tensor | None = None) -> None:
        """Args:
        documents: (B, L) document ids; None: causal.
        positions: (1, L) RoPE positions of the running unit; None: 0..L-1.
        sinks: (Hq,) the layer's learned sinks (a DTensor sharded on heads under its TP plan).
        """
        self.documents, self.positions, self.sinks = documents, positions, sinks


class _SinkAttention(nn.Module):
    """Mixed before gpt-oss's attention class: RoPE at the call's positions, and the layer's sinks and
    document ids handed to its inner attention."""

    sinks: nn.Parameter

    def forward(self, x: Tensor, rope_cache: Tensor, attention_masks: LayerCall) -> Tensor:
        call = attention_masks
        if call.positions is not None:
            # gpt-oss reads RoPE from the table's first L rows: hand it the rows of the unit's positions
            rope_cache = rope_cache[positions_like(rope_cache, call.positions).squeeze(0)]
        return super().forward(x, rope_cache, LayerCall(call.documents, call.positions, self.sinks))


@functools.cache
def sink_attention_class(attention_cls: type[nn.Module]) -> type[nn.Module]:
    """gpt-oss's attention class reading RoPE at the call's positions and handing its inner attention the
    layer's sinks and documents through :class:`LayerCall`.

    Args:
        attention_cls: gpt-oss's attention class, called as ``(x, rope_cache, attention_masks)``.

    Returns:
        Its subclass (one per class), with the same parameters and state.
    """
    return type(attention_cls.__name__, (_SinkAttention, attention_cls), {})


def stage_forward(model: nn.Module, tokens: Tensor, attention_masks: dict[str, LayerCall]) -> Tensor:
    """gpt-oss's forward over the parts a pipeline stage holds (the others are None).

    Args:
        model: a gpt-oss model or a stage's chunk of it.
        tokens: (B, L) ids on the first stage, else (B, L, dim) activations.
        attention_masks: the blocks' calls, by the mask names they pick.

    Returns:
        (B, L, vocab) logits on the last stage, else (B, L, dim) activations.
    """
    h = model.tok_embeddings(tokens) if model.tok_embeddings is not None else tokens
    for layer in model.layers.values():
        h = layer(h, model.rope_cache, attention_masks)
    h = model.norm(h) if model.norm is not None else h
    return model.output(h) if model.output is not None else h
