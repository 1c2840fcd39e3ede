"""Where each microbatch's K/V slab lies on a stage: arenas shared by microbatches growing toward
each other, planned from the order in which the stage runs its units.

A slab (:class:`~torchtitan_seq.runtime.kv_slab.KVSlab`) must be one range of memory, so that a unit
reads its whole prefix as one view; a slab of its own per microbatch, allocated whole by the first
unit, holds room for units not yet run and for units whose backward has ended. A stage runs its
units in the order its schedule fixed, and in that order a microbatch in backward frees its
positions from the end (last unit first) while the next one, in forward, fills its own from the
start. The two can share one buffer, an *arena*, if they grow toward each other: one slab from the
arena's bottom, position p at p, the other from the arena's top, position p at the top's p-th place
below it (positions descending). The arena then needs room for what both hold at once, about the
units in flight, not two microbatches' worth.

Any positions [a, b) of a descending slab are still one range, last position first: right for an
unmasked call (attention sums over its keys in any order), which is how torch's kernels (causal
masks aligned top-left) read a prefix, a whole one or a packed document's part; a unit's causal call
over its own keys reads them as the unit computed them. A kernel that aligns masks bottom-right
reads prefix and own keys in one causal call from an ascending slab, and from a descending one
makes the two calls a top-left kernel makes, so the slabs lie alike whatever the kernel
(``alternate=False``, ascending slabs only, is what the plan is compared with).

The plan is pure Python over the stage's passes, so the runtime (:class:`~torchtitan_seq.runtime.kv_context.KVContext`)
and the memory model (:mod:`torchtitan_seq.simulate.memory`) place slabs alike.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Pass", "SlabPlacement", "ArenaPlan", "plan_arenas", "slab_extents"]

Pass = tuple[bool, int, int]
"""(forward, microbatch, subsequence): a unit's forward, or the pass that ends its backward on the
stage (B, or W where backward is split: a unit's K/V may be read until then)."""


@dataclass(frozen=True)
class SlabPlacement:
    """A microbatch's slab: in arena ``arena``, from its bottom (units ascending) or top (descending)."""

    arena: int
    descending: bool


@dataclass(frozen=True)
class ArenaPlan:
    """Every microbatch's slab placement on a stage, in arenas of ``capacity`` positions each."""

    capacity: int
    slabs: dict[int, SlabPlacement]
    busy: tuple[tuple[int, int], ...]
    """When arenas are allocated: the indices of the passes that write into an empty arena and that
    free the last slab in use in it (an arena goes whenever it holds none)."""

    @property
    def peak(self) -> int:
        """The most positions the arenas hold at once."""
        return _peak(self.busy, self.capacity)


def slab_extents(lengths: Sequence[int], size: int) -> list[int]:
    """Per subsequence j, the positions [0, e_j) of a slab of ``size`` positions that stay in use
    while unit j is the last one in flight: its keys' end, at most the slab's ``size``."""
    ends = list(itertools.accumulate(lengths))
    return [min(end, size) for end in ends]


class _Timeline:
    """A microbatch's slab extent (positions in use) after each pass that changes it."""

    __slots__ = ("steps", "start", "end")

    def __init__(self, changes: list[tuple[int, int]]) -> None:
        self.start = changes[0][0]
        self.end = changes[-1][0]
        """The pass after which the slab holds nothing."""
        self.steps = [(t, extent - before) for (t, extent), (_, before) in zip(changes, [(0, 0), *changes])]
        """(pass index, change of the extent there)."""


@functools.lru_cache(maxsize=1024)
def _levels(passes: tuple[Pass, ...]) -> dict[int, list[tuple[int, int]]]:
    """Per microbatch, (pass index, its last unit in flight, -1 for none) at each pass that changes
    it: unit j in flight from its forward to the end of its backward. The lengths only map a unit to
    its extent, so this part is built once per pass order (the memory model asks for the same passes
    at several cuts of the sequence, and with one pass order on several stages)."""
    live: dict[int, set[int]] = {}
    levels: dict[int, list[tuple[int, int]]] = {}
    for t, (forward, m, j) in enumerate(passes):
        units = live.get(m)
        if units is None:
            units = live[m] = set()
            levels[m] = []
        if forward:
            units.add(j)
        else:
            units.discard(j)
        level = max(units) if units else -1
        line = levels[m]
        if not line or line[-1][1] != level:
            line.append((t, level))
    return levels


def _timelines(passes: tuple[Pass, ...], extents: list[int]) -> dict[int, _Timeline]:
    """Per microbatch, its slab's extent over the passes: a slab holds up to the end of its last unit
    in flight (:func:`_levels`, a change kept where the extent changes: two units may end alike)."""
    of_level = [*extents, 0]  # level -1: nothing in flight
    lines: dict[int, _Timeline] = {}
    for m, levels in _levels(passes).items():
        changes: list[tuple[int, int]] = []
        for t, level in levels:
            extent = of_level[level]
            if not changes or changes[-1][1] != extent:
                changes.append((t, extent))
        lines[m] = _Timeline(changes)
    return lines


def _joint_peak(a: _Timeline, b: _Timeline) -> int:
    """The most positions the slabs of ``a`` and ``b`` (two microbatches) use at once: their extents'
    sum after each change, in pass order (a pass is one microbatch's: no two changes coincide)."""
    return max(itertools.accumulate(map(operator.itemgetter(1), sorted(a.steps + b.steps))))


class _Arena:
    def __init__(self) -> None:
        self.ends: tuple[list[int], list[int]] = ([], [])  # microbatches at the bottom, at the top


class _Greedy:
    """Placement at one arena capacity (see :func:`plan_arenas`)."""

    def __init__(self, lines: dict[int, _Timeline], peaks: dict[tuple[int, int], int]) -> None:
        self.lines = lines
        self.peaks = peaks  # (a, b) -> _joint_peak of a and b, shared between capacities

    def _beside(self, o: int, m: int, capacity: int) -> bool:
        """Whether ``m`` fits at the other end of an arena from ``o``."""
        if self.lines[o].end < self.lines[m].start:
            return True
        if (o, m) not in self.peaks:
            self.peaks[o, m] = _joint_peak(self.lines[o], self.lines[m])
        return self.peaks[o, m] <= capacity

    def _fits(self, arena: _Arena, side: int, m: int, capacity: int) -> bool:
        """Whether ``m`` may take ``side`` of ``arena``: its last slab there is gone before ``m`` starts,
        and the slabs at the other end never leave ``m`` too little room."""
        same, other = arena.ends[side], arena.ends[1 - side]
        if same and self.lines[same[-1]].end >= self.lines[m].start:
            return False
        # An end's slabs follow one another, so those that end before ``m`` starts are a prefix.
        start = self.lines[m].start
        for o in reversed(other):
            if self.lines[o].end < start:
                return True
            if not self._beside(o, m, capacity):
                return False
        return True

    def place(self, capacity: int, alternate: bool) -> list[_Arena]:
        """Each microbatch, in the order its first forward runs, at the first arena end it fits."""
        arenas: list[_Arena] = []
        sides = (0, 1) if alternate else (0,)
        for m in sorted(self.lines, key=lambda m: self.lines[m].start):
            free = next(((a, s) for a in arenas for s in sides if self._fits(a, s, m, capacity)), None)
            if free is None:
                arenas.append(_Arena())
                free = arenas[-1], 0
            free[0].ends[free[1]].append(m)
        return arenas


def _busy(arena: _Arena, lines: dict[int, _Timeline]) -> list[tuple[int, int]]:
    """The pass intervals in which ``arena`` holds a slab in use."""
    spans = sorted((lines[m].start, lines[m].end) for side in arena.ends for m in side)
    merged = [list(spans[0])]
    for start, end in spans[1:]:
        if start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _peak(busy: list[tuple[int, int]], capacity: int) -> int:
    """The most positions the arenas hold at once."""
    events = sorted([(start, 1) for start, _ in busy] + [(end + 1, -1) for _, end in busy])
    live = most = 0
    for _, delta in events:
        live += delta
        most = max(most, live)
    return most * capacity


def plan_arenas(
    passes: Sequence[Pass],
    lengths: Sequence[int],
    size: int,
    alternate: bool = True,
    extents: Sequence[int] | None = None,
) -> ArenaPlan:
    """Place the slabs (``size`` positions each; units of ``lengths``) of the microbatches a stage
    runs in the order of ``passes``, in arenas of one capacity, to hold the fewest positions at once.

    Each arena holds one slab at its bottom and, with ``alternate``, one at its top at a time; a
    slab moves into an arena end once the end's last slab is gone. Capacities tried: ``size`` (no
    sharing) and what each two microbatches starting one after the other hold at once.

    The plan is kept for the same arguments (the caller must not change it): the memory model asks
    for one pass order and cut again and again (ranks and stages running alike, the planner's
    configurations sharing a schedule's lists).

    Args:
        passes: the stage's passes (:data:`Pass`) in the order its rank runs them.
        lengths: the subsequence lengths [L_0, ..., L_{k-1}].
        size: positions of one slab.
        alternate: let two slabs share an arena from its two ends; False: ascending slabs only.
        extents: per unit j, the positions of a slab in use while j is the last unit in flight (None: the
            keys' ends, :func:`slab_extents`; a slab of bounded reach's rows,
            :attr:`~torchtitan_seq.runtime.kv_reach.ReachRows.extents`).

    Returns:
        The arenas' capacity, each microbatch's slab placement and when the arenas are in use.
    """
    return _plan_arenas(tuple(passes), tuple(extents or slab_extents(lengths, size)), size, alternate)


@functools.lru_cache(maxsize=4096)
def _plan_arenas(passes: tuple[Pass, ...], extents: tuple[int, ...], size: int, alternate: bool) -> ArenaPlan:
    """:func:`plan_arenas` on tuples, which its cache can key on."""
    lines = _timelines(passes, list(extents))
    if not lines:
        return ArenaPlan(size, {}, ())
    order = sorted(lines, key=lambda m: lines[m].start)
    peaks: dict[tuple[int, int], int] = {}
    candidates = {size}
    if alternate:
        for a, b in zip(order, order[1:]):
            peaks[a, b] = _joint_peak(lines[a], lines[b])
            if size < peaks[a, b] < 2 * size:
                candidates.add(peaks[a, b])
    best, greedy = None, _Greedy(lines, peaks)
    for capacity in sorted(candidates):
        arenas = greedy.place(capacity, alternate)
        busy = [span for arena in arenas for span in _busy(arena, lines)]
        held = _peak(list(busy), capacity)
        if best is None or held < best[0]:
            best = held, capacity, arenas, busy
    _, capacity, arenas, busy = best
    slabs = {m: SlabPlacement(i, bool(side)) for i, a in enumerate(arenas) for side in (0, 1) for m in a.ends[side]}
    return ArenaPlan(capacity, slabs, tuple(busy))
