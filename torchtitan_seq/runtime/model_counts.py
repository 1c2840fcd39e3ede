"""What a model counts per token and layer, for every family: widths, weights (all experts', or those a token
runs through) and the matmul work they make, read off a model's shape.

``args`` is torchtitan's Llama 3 ``TransformerModelArgs`` or a :class:`~torchtitan_seq.titan.flavors.ModelShape`,
whose optional parts (``moe``, ``mla``, ``biases``, ``qk_norm``: :mod:`.layer_shapes`) say how a family's
layers differ from Llama 3's; a shape without them counts as Llama 3 does. Plain Python.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "ffn_hidden_dim",
    "head_width",
    "kv_heads",
    "attention_weights",
    "head_widths",
    "kv_values",
    "pair_flops",
    "rope_width",
    "mlp_width",
    "moe_share",
    "layer_weights",
    "chunk_moe_layers",
]


def ffn_hidden_dim(args: Any) -> int:
    """Width of a dense layer's MLP (w1, w3 outputs): a model shape's own ``ffn_width`` where it has one, else
    Llama 3's SwiGLU width as torchtitan's ``FeedForward`` computes it: 8/3 dim, times ``ffn_dim_multiplier``,
    rounded up to ``multiple_of``."""
    if (width := getattr(args, "ffn_width", None)) is not None:
        return width
    hidden = int(2 * 4 * args.dim / 3)
    if args.ffn_dim_multiplier is not None:
        hidden = int(args.ffn_dim_multiplier * hidden)
    return args.multiple_of * math.ceil(hidden / args.multiple_of)


def head_width(args: Any) -> int:
    """Width of a query or key head of standard attention: the shape's ``head_dim``, else dim / heads."""
    return getattr(args, "head_dim", None) or args.dim // args.n_heads


def kv_heads(args: Any) -> int:
    """K/V heads (grouped-query attention's; all heads without it)."""
    return args.n_kv_heads or args.n_heads


def attention_weights(args: Any) -> int:
    """Matrix weights of one layer's attention projections (q, k, v, o; MLA's latent projections)."""
    if (mla := getattr(args, "mla", None)) is not None:
        return mla.projection_weights(args.dim, args.n_heads)
    return args.dim * head_width(args) * (2 * args.n_heads + 2 * kv_heads(args))


def head_widths(args: Any) -> tuple[int, int]:
    """Values per token of a layer's queries and of its attention output, all heads."""
    if (mla := getattr(args, "mla", None)) is not None:
        return args.n_heads * mla.qk_head_dim, args.n_heads * mla.v_head_dim
    width = args.n_heads * head_width(args)
    return width, width


def kv_values(args: Any) -> int:
    """K and V values per token and layer, the K/V heads' (MLA: every head's K of ``qk_head_dim`` and V of
    ``v_head_dim``, as torchtitan expands them from the latent before attention)."""
    if (mla := getattr(args, "mla", None)) is not None:
        return args.n_heads * (mla.qk_head_dim + mla.v_head_dim)
    return 2 * kv_heads(args) * head_width(args)


def pair_flops(args: Any) -> int:
    """Forward FLOPs of one (query, key) pair in one layer: q.k and the weighted value, every head."""
    if (mla := getattr(args, "mla", None)) is not None:
        return 2 * args.n_heads * (mla.qk_head_dim + mla.v_head_dim)
    return 4 * args.n_heads * head_width(args)


def rope_width(args: Any) -> int:
    """Rotary embedding values per position (complex pairs: half of it): a head's (MLA: its rope part)."""
    if (mla := getattr(args, "mla", None)) is not None:
        return mla.qk_rope_head_dim
    return head_width(args)


def moe_share(args: Any) -> float:
    """Share of the layers with an MoE MLP (0 without MoE)."""
    moe = getattr(args, "moe", None)
    return 0.0 if moe is None else moe.moe_layers(args.n_layers) / args.n_layers


def mlp_width(args: Any, widest: bool = False) -> float:
    """Hidden width of the MLP a token runs through, over the layers: the mean of the dense layers' width and
    the MoE layers' active one (:attr:`~.layer_shapes.MoEShape.active_width`), or (``widest``) the larger."""
    if (moe := getattr(args, "moe", None)) is None:
        return ffn_hidden_dim(args)
    share = moe_share(args)
    dense = ffn_hidden_dim(args) if share < 1 else 0
    if widest:
        return max(dense, moe.active_width)
    return (1 - share) * dense + share * moe.active_width


def layer_weights(args: Any, moe_layer: bool, active: bool = False) -> tuple[int, int]:
    """Weights of one layer: (the matrices TP shards, those it keeps whole: norms, the router, biases and
    attention sinks). ``moe_layer``: with the MoE MLP (all experts, or ``active``: those a token runs
    through), else the dense one."""
    moe, d = getattr(args, "moe", None), args.dim
    whole = 2 * d  # attention_norm, ffn_norm
    if getattr(args, "qk_norm", False):
        whole += 2 * head_width(args)
    if (mla := getattr(args, "mla", None)) is not None:
        whole += mla.norm_weights
    biased = getattr(args, "biases", False)
    if biased:  # q, k, v, o biases and one sink a head
        q, _ = head_widths(args)
        whole += q + kv_values(args) + d + args.n_heads
    if not moe_layer:
        return attention_weights(args) + 3 * d * ffn_hidden_dim(args), whole
    experts = moe.top_k if active else moe.experts
    whole += d * moe.experts + (moe.experts + experts * (2 * moe.width + d) if biased else 0)
    return attention_weights(args) + moe.expert_weights(d, active), whole


def chunk_moe_layers(args: Any, layers: float, first: bool) -> float:
    """MoE layers of a model chunk of ``layers`` layers: the first chunk holds the leading dense layers, the
    others the MoE layers' share of the layers past them (exact where the first chunk covers the dense ones;
    otherwise the next chunk's dense layers count as MoE, an upper bound of its weights)."""
    moe = getattr(args, "moe", None)
    if moe is None:
        return 0.0
    later = args.n_layers - moe.dense_layers
    share = moe.moe_layers(args.n_layers) / later if later else 0.0
    return share * (max(layers - moe.dense_layers, 0) if first else layers)
