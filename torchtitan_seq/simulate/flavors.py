"""A flavor's shape for the tools: the simulator's cost model, the memory model and the planner.

A flavor is named as the tools take it: a Llama 3 flavor alone (``8B``), any family's as
``family:flavor`` with torchtitan's model name (``qwen3:235B-A22B``, ``deepseek_v3:671B``,
``llama4:17bx128e``, ``gpt_oss:120b``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtitan_seq.titan.family_flavors import FAMILY_SHAPES, family_shape
from torchtitan_seq.titan.flavors import ModelShape, flavor_shapes

if TYPE_CHECKING:
    from torchtitan.models.llama3 import TransformerModelArgs

__all__ = ["flavor_shape", "model_flavor", "split_flavor"]

LLAMA3 = "llama3"
"""The family a flavor named alone belongs to."""


def flavor_shape(flavor: str) -> ModelShape | TransformerModelArgs | None:
    """The shape of ``flavor``.

    Args:
        flavor: ``family:flavor`` of a family of :data:`~torchtitan_seq.titan.family_flavors.FAMILY_SHAPES`,
            or a flavor of torchtitan's Llama 3, or one added to ``seq_llama3_flavors``.

    Returns:
        The table's shape for torchtitan's flavors, else (importing torchtitan 0.2.2) the arguments of a
        flavor added to ``seq_llama3_flavors``; None for a name none holds.
    """
    family, name = split_flavor(flavor)
    if family != LLAMA3:
        return FAMILY_SHAPES.get(family, {}).get(name)
    if name in flavor_shapes:
        return flavor_shapes[name]
    from torchtitan_seq.titan.v022.models.llama3_seq import seq_llama3_flavors

    return seq_llama3_flavors.get(name)


def split_flavor(flavor: str) -> tuple[str, str]:
    """``flavor``'s (torchtitan model name, flavor): a name without a family is Llama 3's."""
    family, _, name = flavor.rpartition(":")
    return family or LLAMA3, name


def model_flavor(model: str) -> str:
    """The flavor name the tools take for ``--model FAMILY:FLAVOR`` (a Llama 3 flavor alone, as ``--flavor``
    names it).

    Args:
        model: ``family:flavor``, e.g. ``qwen3:235B-A22B``.

    Returns:
        The flavor as :func:`flavor_shape` reads it.

    Raises:
        ValueError: one line naming the unknown family or flavor and the known ones.
    """
    family, sep, name = model.partition(":")
    if not sep:
        raise ValueError(f"--model {model!r}: give FAMILY:FLAVOR, a family of {', '.join(FAMILY_SHAPES)}")
    try:
        family_shape(family, name)
    except ValueError as e:
        raise ValueError(f"--model {model!r}: {e}") from None
    return name if family == LLAMA3 else model
