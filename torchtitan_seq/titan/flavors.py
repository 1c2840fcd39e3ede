"""The Llama 3 flavors' shapes and their cut into pipeline chunks, without importing torchtitan.

The planner, the simulator's transformer cost model and the memory model read a handful of numbers
of a flavor. torchtitan's own table (``torchtitan.models.llama3.llama3_args``) sits in a package
that imports the model, its trainer components and, through ``torchtitan``'s own ``__init__``,
modules that wrap attention for ``torch.compile``: an import far heavier than the planner's own
work. Here they are plain numbers, which the test suite checks against torchtitan's table, as it
checks :func:`chunk_split` against torchtitan's ``generate_llm_fqn_per_model_part``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

__all__ = ["ModelShape", "flavor_shapes", "chunk_split", "model_shape"]


@dataclass(frozen=True)
class ModelShape:
    """The fields of torchtitan's Llama 3 ``TransformerModelArgs`` that the models of
    :mod:`torchtitan_seq.simulate` and :mod:`torchtitan_seq.runtime.partition` read."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None
    vocab_size: int
    multiple_of: int
    ffn_dim_multiplier: float | None
    head_dim: int | None = None
    """Width of a query or key head; None: dim / n_heads, as Llama 3's."""
    ffn_width: int | None = None
    """Width of the MLP a token runs through (an MoE layer's: its routed experts' and shared experts'
    widths summed); None: Llama 3's SwiGLU width from ``multiple_of`` and ``ffn_dim_multiplier``."""


_OWN_WIDTHS = ("head_dim", "ffn_width")
_DEBUG = ModelShape(256, 6, 16, None, 2048, 256, None)
_8B = ModelShape(4096, 32, 32, 8, 128256, 1024, 1.3)

flavor_shapes: dict[str, ModelShape] = {
    "debugmodel": _DEBUG,
    "debugmodel_flex_attn": _DEBUG,
    "debugmodel_varlen_attn": _DEBUG,
    "8B": _8B,
    "8B_flex": _8B,
    "8B_varlen": _8B,
    "70B": ModelShape(8192, 80, 64, 8, 128256, 4096, 1.3),
    "405B": ModelShape(16384, 126, 128, 8, 128256, 4096, 1.2),
}
"""Per flavor of ``torchtitan_seq.titan.v022.models.llama3_seq.seq_llama3_flavors`` (torchtitan's), its shape."""


def model_shape(args: Any) -> ModelShape:
    """What the cost models read of a model family's args (torchtitan 0.2.2's, a torchtitan 0.3 decoder's
    config, or a :class:`ModelShape`).

    Llama 3's ``TransformerModelArgs`` are read as they are. A family with head dims of its own and an
    MLP width (Qwen3) gives them; its MoE layers count the width of the experts a token runs through
    (``top_k`` routed and the shared ones). A 0.3 config (``Decoder.Config``) is read the same way from
    its first layer (:func:`_decoder_shape`).

    Args:
        args: the flavor's model args, or its 0.3 model config.

    Returns:
        Its shape.
    """
    if isinstance(args, ModelShape):
        return args
    if hasattr(args, "first_attention"):  # 0.3's Decoder.Config
        return _decoder_shape(args)
    if hasattr(args, "multiple_of"):  # Llama 3's
        return ModelShape(*(getattr(args, f.name) for f in fields(ModelShape) if f.name not in _OWN_WIDTHS))
    if getattr(args, "moe_enabled", False):
        moe = args.moe_args
        ffn_width = (moe.top_k + moe.num_shared_experts) * args.moe_inter_dim
    else:
        ffn_width = args.hidden_dim
    return _with_own_widths(
        args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.vocab_size, args.head_dim, ffn_width
    )


def _decoder_shape(config: Any) -> ModelShape:
    """The shape of a torchtitan 0.3 decoder's config, whose layers are alike: the first layer's
    attention (heads, K/V heads, head width) and MLP (a dense layer's ``w1`` width; an MoE layer's
    ``top_k`` routed experts' and shared experts' widths summed)."""
    attention, layer = config.first_attention, config.layers[0]
    if (moe := getattr(layer, "moe", None)) is not None:
        shared = moe.shared_experts.w1.out_features if moe.shared_experts is not None else 0
        ffn_width = moe.router.top_k * moe.routed_experts.inner_experts.hidden_dim + shared
    else:
        ffn_width = layer.feed_forward.w1.out_features
    heads = (attention.n_heads, attention.n_kv_heads)
    return _with_own_widths(config.dim, len(config.layers), *heads, config.vocab_size, attention.head_dim, ffn_width)


def _with_own_widths(
    dim: int, n_layers: int, n_heads: int, n_kv_heads: int, vocab_size: int, head_dim: int, ffn_width: int
) -> ModelShape:
    """The shape of a family that gives its head and MLP widths (no Llama 3 rounding to read)."""
    return ModelShape(dim, n_layers, n_heads, n_kv_heads, vocab_size, 1, None, head_dim=head_dim, ffn_width=ffn_width)


def chunk_split(n_layers: int, num_chunks: int) -> tuple[tuple[int, bool, bool], ...] | None:
    """How torchtitan cuts a Llama 3 model into pipeline chunks, as layer counts.

    The cut of torchtitan's ``generate_llm_fqn_per_model_part(num_chunks, n_layers, 1, 1)``: the
    embeddings and norm + output weigh a layer each, and the first chunks take the remainder.

    Args:
        n_layers: the model's transformer layers.
        num_chunks: the chunks the model is cut into.

    Returns:
        Per chunk, in model order: (transformer layers, holds the embeddings, holds norm + output);
        None where torchtitan refuses the cut (fewer than one effective layer per chunk).
    """
    if num_chunks == 1:
        return ((n_layers, True, True),)
    # The embeddings and norm + output count as a layer each; the first chunks take the remainder.
    per_chunk, extra = divmod(n_layers + 2, num_chunks)
    if per_chunk < 1:
        return None
    split, left = [], n_layers
    for i in range(num_chunks):
        first, last = i == 0, i == num_chunks - 1
        layers = min(per_chunk + (i < extra) - first - last, left)
        left -= layers
        split.append((layers, first, last))
    return tuple(split)
