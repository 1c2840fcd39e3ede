"""The K/V arenas' overwrite guard against a brute-force replay, over every schedule's pass orders.

:meth:`KVArenas.check_room <torchtitan_seq.runtime.kv_arena.KVArenas.check_room>` refuses a unit's K/V write that
would land on keys another microbatch still reads: the stage ran its units in an order other than
the one it announced (:meth:`KVContext.expect`). The replay here keeps, per arena cell, which
microbatch's key lies there, and calls a write an overwrite when it covers a key of a microbatch
with a unit in flight (forward run, backward not ended: that unit, or a later one of its
microbatch, will read every key up to the end of its last unit in flight). The property: run in
the announced order or in orders that differ from it by a few swaps of neighbouring passes of two
microbatches (each microbatch's own passes in their order, so some are part-way through their
units), the guard refuses the first write the replay calls an overwrite, and no write before it.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import pytest
import torch

from torchtitan_seq.runtime.kv_context import KVContext, Unit
from torchtitan_seq.runtime.kv_placement import Pass, plan_arenas, slab_extents
from torchtitan_seq.runtime.reach import FULL, Reach
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, ScheduleShape
from torchtitan_seq.schedules.ordering import stage_passes

LENGTHS = (5, 3, 4, 2, 2, 1, 3, 1)
"""Uneven unit lengths: the first k are a microbatch's cut."""
SWAPS = (1, 6)
"""The perturbed orders: this many random swaps of neighbouring passes of two microbatches each."""


def _shapes() -> Iterator[tuple[str, int, int, int, bool]]:
    """(schedule, p, N, k, split) over p 2-4, N 2-8, k 1-8 where the schedule runs the shape."""
    for name, cls in SEQUENCE_SCHEDULES.items():
        for p, n, k, split in itertools.product((2, 3, 4), (2, 3, 5, 8), (1, 2, 3, 5, 8), (False, True)):
            if split and cls.parameter_copies > 1:
                continue  # BSIPipe and Chimera: full backward only
            try:
                cls.check_shape(ScheduleShape(p, n, k, split))
            except ValueError:
                continue
            yield name, p, n, k, split


SHAPES = list(_shapes())


def _stage_orders(name: str, p: int, n: int, k: int, split: bool) -> Iterator[list[Pass]]:
    order = SEQUENCE_SCHEDULES[name].compute_order(ScheduleShape(p, n, k, split))
    for actions in order.values():
        for stage in sorted({a.stage_index for a in actions if a is not None}):
            yield stage_passes(actions, stage, k)[1]


def _perturbed(passes: list[Pass], swaps: int, rng: random.Random) -> list[Pass]:
    """``passes`` with ``swaps`` neighbours of two microbatches exchanged (each microbatch's order kept)."""
    out = list(passes)
    for _ in range(swaps):
        i = rng.randrange(len(out) - 1)
        if out[i][1] != out[i + 1][1]:
            out[i], out[i + 1] = out[i + 1], out[i]
    return out


WINDOW = Reach(window=3)
"""A bounded reach whose copied slabs lie in arenas of their own, planned and guarded by rows."""


class _Replay:
    """The arena cells, each with the (microbatch, position) whose key it holds, from the plan alone; under
    a bounded ``reach`` positions are its rows (those of positions later units read, in order)."""

    def __init__(self, announced: list[Pass], lengths: list[int], with_own: bool, reach: Reach | None) -> None:
        ends = list(itertools.accumulate(lengths))
        if reach is None:
            self.size = sum(lengths) if with_own else sum(lengths[:-1])
            self.extents = slab_extents(lengths, self.size)
            self.rows = [(offset, end) for offset, end in zip([0, *ends], ends)]
        else:  # a row per position some later unit reads: at most the window's last positions before it
            read = sorted({p for end in ends[:-1] for p in range(max(0, end - reach.window + 1), end)})
            self.size = len(read)
            self.extents = [sum(p < end for p in read) for end in ends]
            self.rows = [
                (sum(p < offset for p in read), sum(p < end for p in read)) for offset, end in zip([0, *ends], ends)
            ]
        self.plan = plan_arenas(announced, lengths, self.size, extents=self.extents)
        self.cells: dict[tuple[int, int], tuple[int, int]] = {}
        self.live: dict[int, set[int]] = {}

    def _cell(self, m: int, position: int) -> tuple[int, int]:
        placed = self.plan.slabs[m]
        return placed.arena, self.plan.capacity - 1 - position if placed.descending else position

    def _needed(self, m: int, position: int) -> bool:
        live = self.live.get(m)
        return bool(live) and position < self.extents[max(live)]

    def overwrites(self, m: int, start: int, stop: int) -> bool:
        """Whether writing positions [start, stop) of ``m`` covers a key another microbatch still reads."""
        for position in range(start, stop):
            owner = self.cells.get(self._cell(m, position))
            if owner is not None and owner[0] != m and self._needed(*owner):
                return True
        return False

    def write(self, m: int, start: int, stop: int) -> None:
        for position in range(start, stop):
            self.cells[self._cell(m, position)] = (m, position)


def _check_order(announced, run, lengths, with_own, reach=None) -> int | None:
    """Replay ``run`` through a context told ``announced``; assert the guard refuses exactly the first
    write the brute force calls an overwrite. Returns the index of that pass, None if there is none."""
    k = len(lengths)
    offsets = [sum(lengths[:j]) for j in range(k)]
    context, replay = KVContext(list(lengths)), _Replay(announced, list(lengths), with_own, reach)
    context.expect(announced)
    for t, (forward, m, j) in enumerate(run):
        unit = Unit(m, j, offsets[j], lengths[j], k)
        if not forward:
            with context.backward(unit):
                pass
            replay.live[m].discard(j)
            continue
        first, stop = replay.rows[j]
        writes = (j < k - 1 or with_own) and stop > first
        expected = writes and replay.overwrites(m, first, stop)
        kv = torch.zeros(1, 1, lengths[j], 1)
        with context.running(unit):
            try:
                context.append(0, kv, kv, with_own, reach or FULL)  # a bounded reach's slab: a copy
                refused = False
            except RuntimeError as e:
                assert "would overwrite keys" in str(e), e
                refused = True
        assert refused == expected, (t, (forward, m, j), "refused" if refused else "let through")
        if refused:
            return t
        replay.live.setdefault(m, set()).add(j)
        if writes:
            replay.write(m, first, stop)
    return None


@pytest.mark.parametrize("name", list(SEQUENCE_SCHEDULES))
def test_the_guard_refuses_exactly_the_writes_that_overwrite_keys_in_flight(name):
    """Every shape of the grid, every stage, the announced order (never refused) and perturbed ones;
    slabs sized for the keys later units read or, under CP (``with_own``), the last unit's too, and a
    windowed layer's copied slabs (the rows later units read)."""
    rng = random.Random(0)
    refusals = 0
    for shape in (s for s in SHAPES if s[0] == name):
        k = shape[3]
        lengths = LENGTHS[:k]
        kinds = ((False, None), (True, None), (False, WINDOW))
        for passes, (with_own, reach) in itertools.product(_stage_orders(*shape), kinds):
            assert _check_order(passes, passes, lengths, with_own, reach) is None, shape
            for swaps in SWAPS:
                refused = _check_order(passes, _perturbed(passes, swaps, rng), lengths, with_own, reach)
                refusals += refused is not None
    # The perturbed orders do reach the guard, except TeraPipe's: all its slabs are whole at once, so
    # no arena is shared (test_kv_placement.test_terapipe_holds_whole_microbatches).
    assert refusals > 0 or name == "TeraPipe"
