"""The model flavors' shapes and their cut into pipeline chunks, without importing torchtitan.

The planner, the simulator's transformer cost model and the memory model read a handful of numbers
of a flavor. torchtitan's own tables (``torchtitan.models.llama3.llama3_args`` and the other families')
sit in packages that import the models, their trainer components and, through ``torchtitan``'s own
``__init__``, modules that wrap attention for ``torch.compile``: an import far heavier than the planner's
own work. Here they are plain numbers (the Llama 3 flavors here, the other families' in
:mod:`.family_flavors`), which the test suite checks against torchtitan's tables, as it checks
:func:`chunk_split` against torchtitan's ``generate_llm_fqn_per_model_part``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from torchtitan_seq.runtime.layer_shapes import AttentionReach, MLAShape, MoEShape

__all__ = ["ModelShape", "flavor_shapes", "chunk_split", "model_shape"]


@dataclass(frozen=True)
class ModelShape:
    """What the models of :mod:`torchtitan_seq.simulate` and :mod:`torchtitan_seq.runtime.partition` read of a
    flavor: the fields of torchtitan's Llama 3 ``TransformerModelArgs``, and where a family's layers differ
    from Llama 3's, its own parts (:mod:`torchtitan_seq.runtime.layer_shapes`; counted by
    :mod:`torchtitan_seq.runtime.model_counts`)."""

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
    """Width of a dense layer's MLP (where every layer is an MoE layer: the width a token runs through in
    one, its routed and shared experts' widths summed); None: Llama 3's SwiGLU width from ``multiple_of``
    and ``ffn_dim_multiplier``."""
    moe: MoEShape | None = None
    """The MoE MLP and which layers have it; None: every layer is dense."""
    mla: MLAShape | None = None
    """Multi-head latent attention (DeepSeek-V3); None: standard attention of ``head_dim`` heads."""
    reach: AttentionReach | None = None
    """Layers whose queries read fewer keys than their causal prefix; None: every layer reads it whole."""
    qk_norm: bool = False
    """An RMSNorm on each query and key head (Qwen3's)."""
    biases: bool = False
    """Biases on the attention projections, the experts and the router, and an attention sink a head (gpt-oss's)."""


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
    """What the cost models read of a model family's args (torchtitan 0.2.2's: ``llama3``, ``qwen3``,
    ``deepseek_v3``, ``llama4``, ``gpt_oss``; a torchtitan 0.3 decoder's config; or a :class:`ModelShape`).

    Llama 3's ``TransformerModelArgs`` are read as they are. The other families give their head and MLP
    widths and their own parts: MoE layers (:class:`MoEShape`), MLA (:class:`MLAShape`), layers of bounded
    attention reach (:class:`AttentionReach`), Qwen3's QK norms and gpt-oss's biases. A 0.3 config
    (``Decoder.Config``) is read the same way from its first layer (:func:`_decoder_shape`).

    Args:
        args: the flavor's model args, or its 0.3 model config.

    Returns:
        Its shape.
    """
    if isinstance(args, ModelShape):
        return args
    if hasattr(args, "first_attention"):  # 0.3's Decoder.Config
        return _decoder_shape(args)
    if hasattr(args, "interleave_moe_layer_step"):
        return _llama4_shape(args)
    if hasattr(args, "multiple_of"):  # Llama 3's
        return ModelShape(*(getattr(args, f.name) for f in fields(ModelShape)[:7]))
    if hasattr(args, "kv_lora_rank"):
        return _deepseek_v3_shape(args)
    moe = _moe_shape(args.moe_args, args.moe_inter_dim) if getattr(args, "moe_enabled", True) else None
    heads = (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.vocab_size, args.head_dim)
    if hasattr(args, "sliding_window_size"):  # gpt-oss: every other layer (the even ones) windowed
        reach = AttentionReach(window=args.sliding_window_size, period=2, global_phase=1)
        return _with_own_widths(*heads, moe.active_width, moe=moe, reach=reach, biases=True)
    return _with_own_widths(*heads, moe.active_width if moe else args.hidden_dim, moe=moe, qk_norm=args.qk_norm)


def _moe_shape(moe_args: Any, width: int, **layers: int) -> MoEShape:
    """The MoE of torchtitan 0.2.2's ``MoEArgs`` with experts ``width`` wide (``layers``: where its layers are)."""
    return MoEShape(moe_args.num_experts, moe_args.top_k, width, moe_args.num_shared_experts, **layers)


def _deepseek_v3_shape(args: Any) -> ModelShape:
    """DeepSeek-V3's: MLA, dense leading layers of ``inter_dim``, then MoE layers."""
    mla = MLAShape(args.q_lora_rank, args.kv_lora_rank, args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim)
    moe = _moe_shape(args.moe_args, args.moe_inter_dim, dense_layers=args.n_dense_layers)
    shape = (args.dim, args.n_layers, args.n_heads, None, args.vocab_size, None, args.inter_dim)
    return _with_own_widths(*shape, moe=moe, mla=mla)


def _llama4_shape(args: Any) -> ModelShape:
    """Llama 4's: Llama 3's dense layers, an MoE layer every ``interleave_moe_layer_step``, its experts' width as
    torchtitan's ``TransformerBlock`` derives it, and under iRoPE chunked attention but on every
    ``every_n_layers_nope``-th layer (the first of each such run reads the whole prefix)."""
    moe_args = args.moe_args
    width = int(2 * 4 * args.dim / 3)
    if args.ffn_dim_multiplier is not None:
        width = int(args.ffn_dim_multiplier * width)
    if args.auto_scale_hidden_dim:
        width = int(width / (moe_args.top_k + moe_args.num_shared_experts))
    width += -width % args.multiple_of
    nope = args.every_n_layers_nope
    reach = None if nope is None else AttentionReach(chunk=args.fixed_attn_block_size, period=nope)
    return ModelShape(
        *(getattr(args, f.name) for f in fields(ModelShape)[:7]),
        moe=_moe_shape(moe_args, width, every=args.interleave_moe_layer_step),
        reach=reach,
    )


def _decoder_shape(config: Any) -> ModelShape:
    """The shape of a torchtitan 0.3 decoder's config: its first layer's attention (heads, K/V heads, head
    width, QK norms; MLA's latents and head parts), its layers' MLPs (:func:`_decoder_moe`) and reach
    (:func:`_decoder_reach`), and gpt-oss's biases."""
    attention, layers = config.first_attention, config.layers
    moe = _decoder_moe(layers)
    dense = [layer.feed_forward for layer in layers if getattr(layer, "feed_forward", None) is not None]
    ffn_width = dense[0].w1.out_features if dense else moe.active_width
    parts = {"moe": moe, "reach": _decoder_reach(layers), "qk_norm": getattr(attention, "qk_norm", None) is not None}
    parts["biases"] = getattr(getattr(attention, "wo", None), "bias", False)
    if hasattr(attention, "kv_lora_rank"):  # MLA: every head its K and V, no head_dim of its own
        dims = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        parts["mla"] = MLAShape(*(getattr(attention, d) for d in dims))
        heads = (attention.n_heads, None, None)
    else:
        heads = (attention.n_heads, attention.n_kv_heads, attention.head_dim)
    return _with_own_widths(config.dim, len(layers), *heads[:2], config.vocab_size, heads[2], ffn_width, **parts)


def _decoder_moe(layers: list[Any]) -> MoEShape | None:
    """The MoE of a 0.3 decoder's layers (the layers before its first MoE layer dense), None without one."""
    moe_layers = [i for i, layer in enumerate(layers) if getattr(layer, "moe", None) is not None]
    if not moe_layers:
        return None
    moe = layers[moe_layers[0]].moe
    width = moe.routed_experts.inner_experts.hidden_dim
    shared = moe.shared_experts.w1.out_features // width if moe.shared_experts is not None else 0
    return MoEShape(moe.router.num_experts, moe.router.top_k, width, shared, dense_layers=moe_layers[0])


def _decoder_reach(layers: list[Any]) -> AttentionReach | None:
    """The windowed layers of a 0.3 decoder (gpt-oss's name their ``sliding_window_size``; the others read
    the whole prefix, one every ``period`` layers), None where every layer reads it."""
    windows = [getattr(layer.attention, "sliding_window_size", None) for layer in layers]
    whole = [i for i, window in enumerate(windows) if window is None]
    if len(whole) == len(layers):
        return None
    period = whole[1] - whole[0] if len(whole) > 1 else len(layers)
    return AttentionReach(window=next(w for w in windows if w is not None), period=period, global_phase=whole[0])


def _with_own_widths(
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int | None,
    vocab_size: int,
    head_dim: int | None,
    ffn_width: int,
    **parts: Any,
) -> ModelShape:
    """The shape of a family that gives its head and MLP widths (no Llama 3 rounding to read), with its own
    ``parts`` (:class:`ModelShape`'s ``moe``, ``mla``, ``reach``, ``qk_norm``, ``biases``)."""
    return ModelShape(
        dim, n_layers, n_heads, n_kv_heads, vocab_size, 1, None, head_dim=head_dim, ffn_width=ffn_width, **parts
    )


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
