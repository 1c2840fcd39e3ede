"""The Llama 3 flavors' shapes and their cut into pipeline chunks, without importing torchtitan.

The planner, the simulator's transformer cost model and the memory model read a handful of numbers
of a flavor. torchtitan's own table (``torchtitan.models.llama3.llama3_args``) sits in a package
that imports the model, its trainer components and, through ``torchtitan``'s own ``__init__``,
modules that wrap attention for ``torch.compile``: seconds of CPU on every planner call, more than
its search takes at 8B. Here they are plain numbers; ``tests/unit/test_flavors.py`` checks them,
and :func:`chunk_split`, against torchtitan's.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelShape", "flavor_shapes", "chunk_split"]


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


def chunk_split(n_layers: int, num_chunks: int) -> tuple[tuple[int, bool, bool], ...] | None:
    """Per chunk: (transformer layers, holds the embeddings, holds norm + output), as torchtitan's
    ``generate_llm_fqn_per_model_part(num_chunks, n_layers, 1, 1)`` cuts the model; None where it
    refuses (fewer than one effective layer per chunk)."""
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
