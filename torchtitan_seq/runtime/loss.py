"""Token-normalised loss: the recipe that makes sums over units exact.

The loss of a step is the sum of its token losses divided by its token count (torchtitan's recipe).
Each unit (or microbatch) contributes its *sum* divided by that same count, so the pieces add up to
the step's loss whatever their lengths; a per-unit mean would weight short and long units alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

__all__ = ["TokenNormalizedLoss"]


class TokenNormalizedLoss:
    """``loss_fn(pred, target) / denominator`` with a per-step denominator (1 outside
    :meth:`normalized_by`), the per-unit loss a sequence schedule takes.

    Args:
        loss_fn: a loss that sums over tokens (e.g. torchtitan's ``cross_entropy_loss``).
    """

    def __init__(self, loss_fn: Callable[..., torch.Tensor]) -> None:
        self.loss_fn = loss_fn
        self.denominator: torch.Tensor | float = 1.0

    def __call__(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """One unit's (or, under torch's schedules, one microbatch's) share of the step's loss.

        Args:
            pred: its logits, (batch, L, vocab) (L / c tokens under context parallelism).
            target: its labels, (batch, L) (L / c).

        Returns:
            A scalar: the sum of its token losses over the denominator.
        """
        return self.loss_fn(pred, target) / self.denominator

    @contextlib.contextmanager
    def normalized_by(self, denominator: torch.Tensor | float) -> Iterator[None]:
        """Divide by ``denominator`` (the step's token count) inside the block."""
        self.denominator = denominator
        try:
            yield
        finally:
            self.denominator = 1.0
