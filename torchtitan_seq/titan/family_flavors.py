"""Every family's flavors as plain numbers: torchtitan 0.2.2's tables of Qwen3 (``qwen3_args``), DeepSeek-V3
(``deepseekv3_args``), Llama 4 (``llama4_args``) and gpt-oss (``gptoss_configs``) beside Llama 3's
(:data:`~torchtitan_seq.titan.flavors.flavor_shapes`), keyed by torchtitan's model name. The test suite checks
each entry against torchtitan's args (:func:`~torchtitan_seq.titan.flavors.model_shape` of them) and its
parameter count against the model torchtitan builds.
"""

from __future__ import annotations

from torchtitan_seq.runtime.layer_shapes import AttentionReach, MLAShape, MoEShape
from torchtitan_seq.titan.flavors import ModelShape, flavor_shapes

__all__ = ["FAMILY_SHAPES", "family_shape"]


def _qwen3(dim: int, n_layers: int, n_heads: int, n_kv: int, vocab: int, ffn: int, moe: MoEShape | None = None):
    """A Qwen3 flavor: heads 128 wide with QK norms; an MoE flavor's ``ffn`` is its active width."""
    return ModelShape(dim, n_layers, n_heads, n_kv, vocab, 1, None, 128, ffn, moe=moe, qk_norm=True)


_QWEN3_MOE_DEBUG = MoEShape(64, 8, 768)

qwen3_shapes: dict[str, ModelShape] = {
    "debugmodel": _qwen3(256, 8, 16, 8, 2048, 3072),
    "0.6B": _qwen3(1024, 28, 16, 8, 151936, 3072),
    "1.7B": _qwen3(2048, 28, 16, 8, 151936, 6144),
    "4B": _qwen3(2560, 36, 32, 8, 151936, 9728),
    "8B": _qwen3(4096, 36, 32, 8, 151936, 12288),
    "14B": _qwen3(5120, 40, 40, 8, 151936, 17408),
    "32B": _qwen3(5120, 64, 64, 8, 151936, 25600),
    "debugmodel_moe": _qwen3(256, 8, 16, 8, 2048, 6144, _QWEN3_MOE_DEBUG),
    "30B-A3B": _qwen3(2048, 48, 32, 4, 151936, 6144, MoEShape(128, 8, 768)),
    "235B-A22B": _qwen3(4096, 94, 64, 4, 151936, 12288, MoEShape(128, 8, 1536)),
}

_MLA = MLAShape(0, 512, 128, 64, 128)
_MLA_Q_LATENT = MLAShape(1536, 512, 128, 64, 128)


def _deepseek_v3(dim: int, n_layers: int, n_heads: int, vocab: int, inter: int, moe: MoEShape, mla: MLAShape):
    return ModelShape(dim, n_layers, n_heads, None, vocab, 1, None, None, inter, moe=moe, mla=mla)


_DEEPSEEK_DEBUG = _deepseek_v3(256, 6, 16, 2048, 1024, MoEShape(8, 3, 256, 2, dense_layers=1), _MLA)

deepseek_v3_shapes: dict[str, ModelShape] = {
    "debugmodel": _DEEPSEEK_DEBUG,
    "debugmodel_flex_attn": _DEEPSEEK_DEBUG,
    "16B": _deepseek_v3(2048, 27, 16, 102400, 10944, MoEShape(64, 6, 1408, 2, dense_layers=1), _MLA),
    "236B": _deepseek_v3(5120, 60, 128, 102400, 12288, MoEShape(160, 6, 1536, 2, dense_layers=1), _MLA_Q_LATENT),
    "671B": _deepseek_v3(7168, 61, 128, 129280, 18432, MoEShape(256, 8, 2048, 1, dense_layers=3), _MLA_Q_LATENT),
}


def _llama4(dim: int, n_layers: int, n_heads: int, n_kv: int | None, vocab: int, multiple_of: int, **parts):
    return ModelShape(dim, n_layers, n_heads, n_kv, vocab, multiple_of, parts.pop("ffn_multiplier", None), **parts)


_L4_DEBUG_MOE = MoEShape(8, 1, 512, 1, every=2)
_L4_16E = MoEShape(16, 1, 8192, 1)
_L4_128E = MoEShape(128, 1, 8192, 1, every=2)
_IROPE = AttentionReach(chunk=8192, period=4)

llama4_shapes: dict[str, ModelShape] = {
    "debugmodel": _llama4(256, 6, 16, None, 2048, 256, moe=_L4_DEBUG_MOE),
    "17bx16e": _llama4(5120, 48, 40, 8, 202048, 2048, ffn_multiplier=1.2, moe=_L4_16E),
    "17bx128e": _llama4(5120, 48, 40, 8, 202048, 2048, ffn_multiplier=1.2, moe=_L4_128E),
    "debugmodel_irope": _llama4(
        256, 6, 16, None, 2048, 256, moe=_L4_DEBUG_MOE, reach=AttentionReach(chunk=256, period=4)
    ),
    "17bx16e_irope": _llama4(5120, 48, 40, 8, 202048, 2048, ffn_multiplier=1.2, moe=_L4_16E, reach=_IROPE),
    "17bx128e_irope": _llama4(5120, 48, 40, 8, 202048, 2048, ffn_multiplier=1.2, moe=_L4_128E, reach=_IROPE),
}

_WINDOWED = AttentionReach(window=128, period=2, global_phase=1)


def _gpt_oss(dim: int, n_layers: int, moe: MoEShape):
    """A gpt-oss flavor: 64 heads of 64, 8 K/V heads, every layer MoE, the even ones windowed."""
    return ModelShape(
        dim, n_layers, 64, 8, 201088, 1, None, 64, moe.active_width, moe=moe, reach=_WINDOWED, biases=True
    )


gpt_oss_shapes: dict[str, ModelShape] = {
    "debugmodel": _gpt_oss(256, 4, MoEShape(8, 4, 2880)),
    "20b": _gpt_oss(2880, 24, MoEShape(32, 4, 2880)),
    "120b": _gpt_oss(2880, 36, MoEShape(128, 4, 2880)),
}

FAMILY_SHAPES: dict[str, dict[str, ModelShape]] = {
    "llama3": flavor_shapes,
    "qwen3": qwen3_shapes,
    "deepseek_v3": deepseek_v3_shapes,
    "llama4": llama4_shapes,
    "gpt_oss": gpt_oss_shapes,
}
"""Per torchtitan model name, its flavors' shapes."""


def family_shape(family: str, flavor: str) -> ModelShape:
    """The shape of ``flavor`` of ``family``.

    Args:
        family: a torchtitan model name of :data:`FAMILY_SHAPES`.
        flavor: one of its flavors.

    Returns:
        Its shape.

    Raises:
        ValueError: one line naming the unknown family or flavor and the known ones.
    """
    if family not in FAMILY_SHAPES:
        raise ValueError(f"model family {family!r} is unknown: use one of {', '.join(FAMILY_SHAPES)}")
    if flavor not in (flavors := FAMILY_SHAPES[family]):
        raise ValueError(f"{family} has no flavor {flavor!r}: use one of {', '.join(flavors)}")
    return flavors[flavor]
