"""A flavor's shape for the tools: the simulator's cost model, the memory model and the planner."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtitan_seq.titan.flavors import ModelShape, flavor_shapes

if TYPE_CHECKING:
    from torchtitan.models.llama3 import TransformerModelArgs

__all__ = ["flavor_shape"]


def flavor_shape(flavor: str) -> ModelShape | TransformerModelArgs | None:
    """The shape of ``flavor``.

    Args:
        flavor: a flavor of torchtitan's Llama 3, or one added to ``seq_llama3_flavors``.

    Returns:
        The table's shape (:data:`~torchtitan_seq.titan.flavors.flavor_shapes`) for torchtitan's
        flavors, else (importing torchtitan 0.2.2) the arguments of a flavor added to
        ``seq_llama3_flavors``; None for a name neither holds.
    """
    if flavor in flavor_shapes:
        return flavor_shapes[flavor]
    from torchtitan_seq.titan.v022.models.llama3_seq import seq_llama3_flavors

    return seq_llama3_flavors.get(flavor)
