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
"""

from __future__ import annotations

import torch

from torchtitan_seq.runtime.kv_placement import ArenaPlan, Pass, SlabPlacement, plan_arenas
from torchtitan_seq.runtime.kv_slab import DescendingRows, KVSlab, new_keys

__all__ = ["KVArenas"]


class KVArenas:
    """Where the slabs of a stage's microbatches lie, the arenas (per layer) they lie in, and which units
    of each microbatch are in flight. ``lengths``: the units' lengths [L_0, ..., L_{k-1}] of every
    microbatch, which size the slabs (None: untold)."""

    def __init__(self, lengths: list[int] | None = None) -> None:
        self.lengths = lengths
        self.plan: ArenaPlan | None = None
        """The placement of every microbatch, planned as the first slab after :meth:`expect` is placed."""
        self._passes: list[Pass] | None = None
        self._placed: dict[int, tuple[int, SlabPlacement]] = {}  # microbatch -> (arena capacity, placement)
        self._buffers: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (layer id, arena) -> K, V
        self._live: dict[int, set[int]] = {}  # microbatch -> units run forward whose backward has not ended
        self._rows: dict[tuple[int, torch.device], DescendingRows] = {}  # kept across steps

    def expect(self, passes: list[Pass]) -> None:
        """The order in which the stage runs its units' passes each step (see
        :data:`~torchtitan_seq.runtime.kv_placement.Pass`); the arenas are planned from it."""
        self._passes = list(passes)
        self.plan = None

    def placement(self, microbatch: int) -> SlabPlacement | None:
        """Where ``microbatch``'s slabs lie (an arena below 0: one of its own); None before its first is placed."""
        placed = self._placed.get(microbatch)
        return None if placed is None else placed[1]

    def place(self, layer_id: int, m: int, k: torch.Tensor, v: torch.Tensor, with_own: bool) -> KVSlab:
        """Microbatch ``m``'s slab for ``layer_id``, for K and V shaped like ``k`` and ``v``, in the arena its
        plan names (allocated by its first slab), or in one of its own: room for the keys later units read,
        the last unit's too if ``with_own``."""
        if self.lengths is None:  # nothing to plan with: a slab of its own that grows
            return KVSlab(new_keys(k, 0), new_keys(v, 0))
        size = sum(self.lengths[: None if with_own else -1])
        if m not in self._placed:
            if self.plan is None:
                self.plan = plan_arenas(self._passes or [], self.lengths, size)
            plan = self.plan
            solo = (size, SlabPlacement(-1 - m, descending=False))
            self._placed[m] = (plan.capacity, plan.slabs[m]) if m in plan.slabs else solo
        capacity, placed = self._placed[m]
        key = (layer_id, placed.arena)
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
        """Microbatch ``m``'s slabs have gone: its place, and its arena when that holds no other slab in use."""
        self._live.pop(m, None)
        placed = self._placed.pop(m, None)
        if placed is not None and all(other.arena != placed[1].arena for _, other in self._placed.values()):
            for key in [key for key in self._buffers if key[1] == placed[1].arena]:  # no slab in it is in use
                del self._buffers[key]

    def check_room(self, m: int, index: int, offset: int, length: int, slab: KVSlab) -> None:
        """Refuse a write of unit ``index`` of microbatch ``m`` (positions [offset, offset + length) of
        ``slab``) into positions of the arena that another microbatch in it still uses, at its other end or
        at the same one (the stage ran its units in an order other than the one it announced)."""
        capacity, placed = self._placed.get(m, (0, None))
        if placed is None or placed.arena < 0:
            return
        for other_m, (_, other) in self._placed.items():
            if other_m == m or other.arena != placed.arena:
                continue
            live = self._live.get(other_m)
            theirs = min(sum(self.lengths[: max(live) + 1]), slab.k.shape[2]) if live else 0
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
        """Per layer, the K and V of ``arena`` allocated now: (layer id, K, V)."""
        return [(layer, *pair) for (layer, a), pair in self._buffers.items() if a == arena]

    def tensors(self) -> list[torch.Tensor]:
        """The K and V of every arena allocated now."""
        return [t for pair in self._buffers.values() for t in pair]
