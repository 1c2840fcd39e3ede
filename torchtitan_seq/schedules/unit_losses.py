"""Losses filed by unit: the schedule runtime's loss bookkeeping.

torch's runtime counts units as microbatches and files each loss by the position it was computed at,
which on a last stage that runs units out of order, or only some of them, is not the unit. Here each
loss is filed under its unit id, and the one kept for the step is detached once its backward has taken
it, since an attached loss pins its unit's graph until the step ends.
"""

from __future__ import annotations

from typing import Any

import torch

from torchtitan_seq.runtime.torch_internals import UnitScheduleRuntime

__all__ = ["UnitLossRuntime"]


class UnitLossRuntime(UnitScheduleRuntime):
    """torch's action-list runtime for a schedule of units, each unit's loss filed under its unit id."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.unit_losses: dict[int, torch.Tensor] = {}
        """unit id -> its loss, on a rank of a last stage: attached until its backward takes it."""

    def compute_loss(self, stage: Any, output: Any, target_units: list, unit_id: int, loss_kwargs: dict | None) -> None:
        if stage.is_last and self.loss_fn is not None:
            # The loss function itself, not torch's _compute_loss, whose loss_kwargs torch 2.11 lacks.
            self.unit_losses[unit_id] = self.loss_fn(output, target_units[unit_id], **(loss_kwargs or {}))

    def backward_loss(self, stage: Any, unit_id: int) -> torch.Tensor | None:
        if stage.is_last and self.loss_fn is not None:
            loss = self.unit_losses[unit_id]
            self.unit_losses[unit_id] = loss.detach()
            return loss
        return None

    def report_losses(self, losses: list | None) -> None:
        """Per-unit losses of this rank's last stages, in unit-id order; 0 for units they do not run."""
        if losses is not None and any(s.is_last for s in self.stages):
            zero = next(iter(self.unit_losses.values())).new_zeros(())
            losses[:] = [self.unit_losses.get(u, zero) for u in range(self.num_units)]
        self.unit_losses.clear()
