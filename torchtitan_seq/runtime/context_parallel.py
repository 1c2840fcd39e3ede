"""Context parallelism inside a unit: which of a unit's queries a CP rank holds, and the collectives
that give every CP rank the unit's whole K/V and hand each its share of their gradient.

Under ``[parallelism] context_parallel_degree = c`` a sequence schedule does not shard whole sequences
(torchtitan's way); it cuts each unit of L tokens into 2c equal chunks and CP rank r holds chunks r and
2c - 1 - r (:meth:`ContextShard.segments`): one from each end, so every rank's causal work on the unit
is the same, as Llama 3's load-balanced CP does it per sequence. Tokens, labels and RoPE positions of
a unit are its rank's share (L / c tokens, the two chunks in order). The attention of a unit all-gathers
its K/V over the CP group (:meth:`ContextShard.gather`) into the stage's slab, so every CP rank holds
the whole prefix and the whole unit, and each query chunk attends there; in backward the unit's dK/dV
(over its L positions, partial on every rank) are reduce-scattered back to the ranks that own the
positions (:meth:`ContextShard.reduce_scatter`). Parameter gradients are summed over the CP ranks by
FSDP, whose mesh torchtitan builds over data-parallel x CP ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["ContextShard"]

# torch 2.13 names the tensor collectives so and deprecates the old names, which torch 2.11 has alone.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


@dataclass(frozen=True)
class ContextShard:
    """One CP rank's share of every unit, and the collectives over its CP group.

    Args:
        group: the CP process group; None where ``size`` is 1.
        rank: this process's rank in ``group``, r: it holds chunks r and 2c - 1 - r of each unit.
        size: c, the CP degree; 1: the whole unit, no collective.
    """

    group: dist.ProcessGroup | None = None
    rank: int = 0
    size: int = 1

    @classmethod
    def of_group(cls, group: dist.ProcessGroup | None) -> ContextShard:
        """This process's shard in ``group`` (the DeviceMesh's ``cp`` dimension); None: no CP."""
        if group is None or dist.get_world_size(group) == 1:
            return cls()
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def segments(self, offset: int, length: int) -> tuple[tuple[int, int], ...]:
        """Positions [start, stop) of the queries this rank holds of a unit, in the order its share lays
        them out: the whole unit, or chunks ``rank`` and 2c - 1 - ``rank`` of 2c.

        Args:
            offset: the unit's first position in the sequence.
            length: L, the unit's tokens.

        Returns:
            One [start, stop) range, or two under context parallelism.

        Raises:
            ValueError: where ``length`` is not a multiple of 2c.
        """
        if self.size == 1:
            return ((offset, offset + length),)
        if length % (2 * self.size):
            raise ValueError(
                f"a subsequence of {length} tokens cannot be cut into 2 x {self.size} equal chunks for "
                f"parallelism.context_parallel_degree = {self.size}: make every subsequence length a multiple of "
                f"{2 * self.size} (sequence_pipeline.length_multiple)"
            )
        h = length // (2 * self.size)
        first, second = self.rank, 2 * self.size - 1 - self.rank
        return ((offset + first * h, offset + (first + 1) * h), (offset + second * h, offset + (second + 1) * h))

    def shard(self, unit: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's share of a unit's tensor, ``unit`` (..., L, ...) along ``dim`` -> (..., L / c, ...)."""
        if self.size == 1:
            return unit
        return torch.cat([unit.narrow(dim, a, b - a) for a, b in self.segments(0, unit.shape[dim])], dim=dim)

    def _of_rank(self, rank: int) -> ContextShard:
        """Rank ``rank``'s share of the same group's units (for laying out every rank's, no collective)."""
        return ContextShard(None, rank, self.size)

    def gather(self, share: torch.Tensor) -> torch.Tensor:
        """The unit's whole K or V (B, H, L, D) in position order, from every rank's ``share``
        (B, H, L / c, D)."""
        if self.size == 1:
            return share
        # every rank's share stacked on the batch dimension, as the collective lays them out
        blocks = share.new_empty(self.size * share.shape[0], *share.shape[1:])
        _all_gather(blocks, share.contiguous(), group=self.group)
        whole = share.new_empty(*share.shape[:2], self.size * share.shape[2], share.shape[3])
        for rank, block in enumerate(blocks.chunk(self.size)):
            at = 0  # each share lays its segments out in order
            for a, b in self._of_rank(rank).segments(0, whole.shape[2]):
                whole[:, :, a:b] = block[:, :, at : at + b - a]
                at += b - a
        return whole

    def reduce_scatter(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's share (B, H, L / c, D) of ``whole`` (B, H, L, D) summed over the CP ranks: the
        gradient of the positions it owns, from every rank's queries."""
        if self.size == 1:
            return whole
        blocks = torch.cat([self._of_rank(r).shard(whole, 2) for r in range(self.size)])
        share = blocks.new_empty(whole.shape[0], *blocks.shape[1:])
        _reduce_scatter(share, blocks, group=self.group)
        return share
