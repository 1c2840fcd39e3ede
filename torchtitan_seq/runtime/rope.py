"""RoPE positions of a unit: what every version's chunk-aware model reads while a stage runs one."""

from __future__ import annotations

import torch

from torchtitan_seq.runtime.kv_context import KVContext, Unit

__all__ = ["unit_positions", "UnitPositions"]


def unit_positions(unit: Unit, device: torch.device) -> torch.Tensor:
    """RoPE positions of ``unit``'s queries on this rank: (1, L), the range [offset, offset + L) of the
    whole sequence, or a CP rank's two chunks of it, (1, L / c) (under sequence parallelism too: RoPE
    is applied after the gather, to the rank's whole share)."""
    return torch.cat([torch.arange(a, b, device=device) for a, b in unit.segments]).unsqueeze(0)


class UnitPositions:
    """A model's RoPE positions per unit, built once: a stage runs the same few units every step."""

    def __init__(self) -> None:
        self._cache: dict[tuple[tuple[tuple[int, int], ...], torch.device], torch.Tensor] = {}

    def of(self, context: KVContext | None, device: torch.device) -> torch.Tensor | None:
        """The positions of the unit ``context`` runs (:func:`unit_positions`', looked up in this module at
        the call and kept), or None outside a unit (whole sequences: the model's own positions).

        Args:
            context: the stage's KV context, or None where the model runs outside a pipeline.
            device: where the positions go.

        Returns:
            (1, L) positions of the unit's queries on this rank, or None.
        """
        unit = context.unit if context is not None else None
        if unit is None:
            return None
        key = (unit.segments, device)
        if (positions := self._cache.get(key)) is None:
            positions = self._cache[key] = unit_positions(unit, device)
        return positions
