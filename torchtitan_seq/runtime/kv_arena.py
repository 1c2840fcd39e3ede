"""The arenas of a stage's K/V slabs: where each microbatch's slab lies, the memory it lies in, and the
guard against a write into keys another microbatch still reads.

Told the order of its stage's passes (:meth:`KVArenas.expect`), a stage shares each arena between a
microbatch in backward, which frees positions from its slab's end, and the next in forward, which fills
its own from the start, the two growing toward each other (the plan:
:func:`~torchtitan_seq.runtime.kv_placement.plan_arenas`), so the arenas hold about the K/V of the units
in flight rather than room for whole microbatches. An arena is allocated, per layer, by the first slab
placed in it and goes when no slab in it is in use. Untold, each microbatch's slab is an arena of its
own; told no lengths, a slab of its own that grows. A write into positions another microbatch in the
arena still reads is refused (:meth:`KVArenas.check_room`): the stage ran its units in an order other than
the one it announced.

The copied slabs of layers of bounded reach (:class:`~torchtitan_seq.runtime.kv_reach.ReachSlab`) lie in
arenas of their own, one set per reach, planned alike from the rows each unit keeps in use
(:attr:`~torchtitan_seq.runtime.kv_reach.ReachRows.extents`) and guarded by rows.
"""

from __future__ import annotations

import torch

from torchtitan_seq.runtime.kv_placement import ArenaPlan, Pass, SlabPlacement, plan_arenas, slab_extents
from torchtitan_seq.runtime.kv_reach import ReachRows
from torchtitan_seq.runtime.kv_slab import DescendingRows, KVSlab, new_keys

__all__ = ["KVArenas"]


Kind = ReachRows | None
"""What a slab holds: the rows of a bounded reach, or (None) every position later units read."""


class KVArenas:
    """Where the slabs of a stage's microbatches lie, the arenas (per layer) they lie in, and which units
    of each microbatch are in flight. ``lengths``: the units' lengths [L_0, ..., L_{k-1}] of every
    microbatch, which size the slabs (None: untold). Slabs of each :data:`Kind` have arenas of their own."""

    def __init__(self, lengths: list[int] | None = None) -> None:
        self.lengths = lengths
        self.plans: dict[Kind, tuple[ArenaPlan, tuple[int, ...]]] = {}
        """Per kind, the placement of every microbatch and the positions (rows) in use while each unit is the
        last in flight: planned as the kind's first slab after :meth:`expect` is placed."""
        self._passes: list[Pass] | None = None
        self._placed: dict[tuple[Kind, int], tuple[int, SlabPlacement]] = {}  # (kind, m) -> (capacity, placement)
        self._buffers: dict[tuple[Kind, int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (kind, layer, arena)
        self._live: dict[int, set[int]] = {}  # microbatch -> units run forward whose backward has not ended
        self._rows: dict[tuple[int, torch.device], DescendingRows] = {}  # kept across steps

    @property
    def plan(self) -> ArenaPlan | None:
        """The placement of the full slabs (the kind that offload moves), planned with the first."""
        planned = self.plans.get(None)
        return None if planned is None else planned[0]

    def expect(self, passes: list[Pass]) -> None:
        """The order in which the stage runs its units' passes each step (see
        :data:`~torchtitan_seq.runtime.kv_placement.Pass`); the arenas are planned from it."""
        self._passes = list(passes)
        self.plans = {}

    def placement(self, microbatch: int) -> SlabPlacement | None:
        """Where ``microbatch``'s full slabs lie (an arena below 0: one of its own); None before its first is placed."""
        placed = self._placed.get((None, microbatch))
        return None if placed is None else placed[1]

    def place(
        self, layer_id: int, m: int, k: torch.Tensor, v: torch.Tensor, with_own: bool, kind: Kind = None
    ) -> KVSlab:
        """Microbatch ``m``'s slab for ``layer_id``, for K and V shaped like ``k`` and ``v``, in the arena its
        kind's plan names (allocated by its first slab), or in one of its own: room for the keys later units
        read, the last unit's too if ``with_own``; for a bounded reach ``kind``, its rows."""
        if self.lengths is None:  # nothing to plan with: a slab of its own that grows
            return KVSlab(new_keys(k, 0), new_keys(v, 0))
        size = kind.size if kind is not None else sum(self.lengths[: None if with_own else -1])
        if (kind, m) not in self._placed:
            if kind not in self.plans:
                extents = kind.extents if kind is not None else tuple(slab_extents(self.lengths, size))
                self.plans[kind] = plan_arenas(self._passes or [], self.lengths, size, extents=extents), extents
            plan = self.plans[kind][0]
            solo = (size, SlabPlacement(-1 - m, descending=False))
            self._placed[kind, m] = (plan.capacity, plan.slabs[m]) if m in plan.slabs else solo
        capacity, placed = self._placed[kind, m]
        key = (kind, layer_id, placed.arena)
        if key not in self._buffers:
            self._buffers[key] = (new_keys(k, capacity), new_keys(v, capacity))
        region = slice(capacity - size, capacity) if placed.descending else slice(0, size)
        arena_k, arena_v = self._buffers[key]
        rows = self._descending_rows(size, k.device) if placed.descending else None
        return KVSlab(arena_k[:, :, region], arena_v[:, :, region], rows)

    def _descending_rows(self, size: int, device: torch.device) -> DescendingRows:
        """A descending slab's rows, made once per size."""
        rows = self._rows.get((size, device))
        if rows is None:
            rows = self._rows[size, device] = DescendingRows(size, device)
        return rows

    def unit_started(self, m: int, index: int) -> None:
        """Unit ``index`` of microbatch ``m`` runs forward: its keys are read until its backward ends."""
        self._live.setdefault(m, set()).add(index)

    def unit_ended(self, m: int, index: int) -> None:
        """The backward of unit ``index`` of microbatch ``m`` has ended: its positions are free."""
        self._live.get(m, set()).discard(index)

    def release(self, m: int) -> None:
        """Microbatch ``m``'s slabs have gone: its places, and each arena that holds no other slab in use."""
        self._live.pop(m, None)
        for kind, _ in [key for key in self._placed if key[1] == m]:
            arena = self._placed.pop((kind, m))[1].arena
            if all(other.arena != arena for (k, _), (_, other) in self._placed.items() if k is kind):
                for key in [key for key in self._buffers if key[0] is kind and key[2] == arena]:
                    del self._buffers[key]

    def check_room(self, m: int, index: int, offset: int, length: int, kind: Kind = None) -> None:
        """Refuse a write of unit ``index`` of microbatch ``m`` (positions, or rows of a bounded reach ``kind``,
        [offset, offset + length) of its slab) into those of the arena that another microbatch in it still
        uses, at its other end or at the same one (the stage ran its units in an order other than the one it
        announced)."""
        capacity, placed = self._placed.get((kind, m), (0, None))
        if placed is None or placed.arena < 0:
            return
        extents = self.plans[kind][1]
        for (other_kind, other_m), (_, other) in self._placed.items():
            if other_kind is not kind or other_m == m or other.arena != placed.arena:
                continue
            live = self._live.get(other_m)
            theirs = extents[max(live)] if live else 0
            # The same end lays positions on the same cells; the other end, position p on the cell of
            # capacity - 1 - p.
            same_end = other.descending == placed.descending
            if offset < theirs if same_end else offset + length + theirs > capacity:
                raise RuntimeError(
                    f"K/V arena {placed.arena}: subsequence {index} of microbatch {m} would "
                    f"overwrite keys microbatch {other_m} still reads; the stage ran its units in an order other "
                    "than the one given to KVContext.expect"
                )

    def clear(self) -> None:
        """Forget every microbatch and free the arenas (end of step); the plan stays."""
        self._live.clear()
        self._placed.clear()
        self._buffers.clear()

    def buffers_of(self, arena: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Per layer, the K and V of the full slabs' ``arena`` allocated now: (layer id, K, V)."""
        return [(layer, *pair) for (kind, layer, a), pair in self._buffers.items() if kind is None and a == arena]

    def tensors(self) -> list[torch.Tensor]:
        """The K and V of every arena allocated now."""
        return [t for pair in self._buffers.values() for t in pair]
