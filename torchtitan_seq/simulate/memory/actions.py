"""The schedule as the memory model reads it: each rank's compute actions, built once per schedule shape,
and the bookkeeping of what each action saves and frees.

The peak of a schedule whose backwards interleave its forwards is reached within
2p + (N mod p) microbatches, so the action lists are built for at most that many
(BSIPipe's basic unit is 2p) and cached per shape; where a rank runs all its forwards
before any backward (GPipe, TeraPipe) the peak grows with N and is scaled by N / N'.
A shape's lists and bookkeeping are built on its first call and reused by every later one (BSIPipe's
list scheduling is the costliest part at large p).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from torchtitan_seq.runtime.kv_placement import Pass
from torchtitan_seq.schedules.ordering import B, F, I, W, compute_leaves, stage_passes
from torchtitan_seq.simulate.build import SimConfig, build
from torchtitan_seq.simulate.memory.arenas import slab_arena_events
from torchtitan_seq.simulate.memory.chunks import chunk_kinds


@dataclass(frozen=True)
class ActionPlan:
    """A schedule's per-rank compute actions at ``built_microbatches`` (see ``action_plan``)."""

    order: dict[int, tuple]
    chain_length: int
    parameter_copies: int
    built_microbatches: int
    events: dict[tuple[int, int], Events] = field(default_factory=dict, compare=False, repr=False)
    """:func:`pass_events` per (rank, k), filled as :meth:`events_of` is asked for them."""
    merged: dict[int, tuple[Events, np.ndarray]] = field(default_factory=dict, compare=False, repr=False)
    """Per k, every rank's events end to end, and where each rank's begin (see :meth:`merged_events`)."""
    arenas: dict[tuple, np.ndarray] = field(default_factory=dict, compare=False, repr=False)
    """Per subsequence lengths, ``with_own``, ``offload`` and extents, :func:`slab_arena_events` of every rank end
    to end (see :meth:`merged_arenas`)."""
    passes: dict[tuple[int, int], list[tuple[list[int], tuple[Pass, ...]]]] = field(
        default_factory=dict, compare=False, repr=False
    )
    """Per (rank, k), each of its stages' passes where the rank runs them (see :meth:`passes_of`)."""
    forwards: dict[tuple[int, int], dict[int, list[int]]] = field(default_factory=dict, compare=False, repr=False)
    """Per (rank, k), per stage of the rank, its forwards of each unit (see :meth:`forwards_of`)."""
    live: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, compare=False, repr=False)
    """Per (k, layers), the units each rank holds where it holds the most (see :meth:`fullest`)."""
    by_rank: dict[int, list[int]] = field(init=False, compare=False, repr=False)
    """Per rank, its stages, sorted."""
    forwards_first: np.ndarray = field(init=False, compare=False, repr=False)
    """Per rank, whether it runs every forward first (GPipe, TeraPipe): its peak grows with N, so
    :func:`memory_walks` scales it by N / built_microbatches."""

    def __post_init__(self) -> None:
        by_rank = {r: sorted({a.stage_index for a in acts}) for r, acts in self.order.items()}
        object.__setattr__(self, "by_rank", by_rank)
        first = np.array([all_forwards_first(self.order[r]) for r in sorted(self.order)])
        object.__setattr__(self, "forwards_first", first)

    @property
    def stages(self) -> set[int]:
        return {s for stages in self.by_rank.values() for s in stages}

    def stages_of(self, rank: int) -> list[int]:
        return self.by_rank[rank]

    def events_of(self, rank: int, k: int) -> Events:
        """``rank``'s :func:`pass_events` with k subsequences, built once."""
        if (rank, k) not in self.events:
            self.events[rank, k] = pass_events(self.order[rank], k)
        return self.events[rank, k]

    def forwards_of(self, rank: int, k: int) -> dict[int, list[int]]:
        """Per stage of ``rank``, how many forwards of each unit j it runs with k subsequences, counted
        once: the receive buffers of every cut with k units and every rank count them (:func:`buffer_bytes`)."""
        if (rank, k) not in self.forwards:
            e = self.events_of(rank, k)
            self.forwards[rank, k] = {
                s: np.bincount(e.unit[(e.stage == s) & (e.saved == 1)], minlength=k).tolist()
                for s in self.stages_of(rank)
            }
        return self.forwards[rank, k]

    def fullest(self, k: int, n_layers: int) -> tuple[np.ndarray, np.ndarray]:
        """Where each rank holds the most units (its saved activations' events counted, bytes aside),
        per kind of chunk (a chunk's layers and ends, in :func:`chunk_kinds`'s order): per rank, kind
        and unit j the units held, and per rank and kind the stages holding any; found once per k."""
        if (k, n_layers) not in self.live:
            chunks, kind = chunk_kinds(n_layers, self.chain_length)
            kinds = [kind[s % self.chain_length] for s in range(len(self.stages))]
            units, holding = np.zeros((len(self.order), len(chunks), k)), np.zeros((len(self.order), len(chunks)))
            for r in sorted(self.order):
                e = self.events_of(r, k)
                until = int(np.argmax(np.cumsum(e.saved))) + 1
                live = np.zeros((len(self.stages), k))
                np.add.at(live, (e.stage[:until], e.unit[:until]), e.saved[:until])
                np.add.at(units[r], kinds, live)
                np.add.at(holding[r], kinds, live.sum(axis=1) > 0)
            self.live[k, n_layers] = units, holding
        return self.live[k, n_layers]

    def merged_events(self, k: int) -> tuple[Events, np.ndarray]:
        """Every rank's :func:`pass_events` end to end, ranks ascending, and each rank's first index."""
        if k not in self.merged:
            parts = [self.events_of(r, k) for r in sorted(self.order)]
            starts = np.cumsum([0] + [len(e.stage) for e in parts[:-1]])
            self.merged[k] = (Events(*(np.concatenate(f) for f in zip(*parts))), starts)
        return self.merged[k]

    def passes_of(self, rank: int, k: int) -> list[tuple[list[int], tuple[Pass, ...]]]:
        """Per stage of ``rank``, :func:`~torchtitan_seq.schedules.ordering.stage_passes` with k subsequences,
        found once: every cut of the sequence with k units walks the same passes."""
        if (rank, k) not in self.passes:
            actions = self.order[rank]
            found = (stage_passes(actions, stage, k) for stage in self.stages_of(rank))
            self.passes[rank, k] = [(where, tuple(passes)) for where, passes in found]
        return self.passes[rank, k]

    def touches_of(self, rank: int, k: int) -> list[tuple[list[int], tuple[Pass, ...]]]:
        """Per stage of ``rank`` (as :meth:`passes_of`), every pass it announces (F, I, B, W) and where."""
        found = (stage_passes(self.order[rank], stage, k, (F, I, B, W)) for stage in self.stages_of(rank))
        return [(where, tuple(passes)) for where, passes in found]

    def merged_arenas(
        self, lengths: tuple[int, ...], with_own: bool, offload: bool = False, extents: tuple[int, ...] | None = None
    ) -> np.ndarray:
        """Every rank's :func:`slab_arena_events` end to end, ranks ascending, as :meth:`merged_events`;
        ``offload``: with the arenas' spans off the device; ``extents``: a bounded reach's copied slabs'."""
        key = (lengths, with_own, offload, extents)
        if key not in self.arenas:
            k = len(lengths)
            parts = [
                slab_arena_events(
                    len(self.order[r]),
                    self.passes_of(r, k),
                    lengths,
                    with_own,
                    self.touches_of(r, k) if offload else None,
                    extents,
                )
                for r in sorted(self.order)
            ]
            self.arenas[key] = np.concatenate(parts)
        return self.arenas[key]


@functools.lru_cache(maxsize=256)
def action_plan(schedule: str, p: int, n: int, k: int, v: int | None, split_backward: bool) -> ActionPlan:
    """Compute-only lists of ``schedule`` for min(n, 2p + n mod p) microbatches, cached."""
    built_n = n if n <= 2 * p else 2 * p + n % p
    built = build(SimConfig(schedule, p, built_n, k, stages_per_rank=v, split_backward=split_backward))
    order = {
        r: tuple(leaf for act in acts if act is not None for leaf in compute_leaves(act))
        for r, acts in built.order.items()
    }
    num_stages = p * built.stages_per_rank
    return ActionPlan(order, num_stages // built.parameter_copies, built.parameter_copies, built_n)


class Events(NamedTuple):
    """A rank's actions as indices into stage byte tables (see :func:`memory_walks`), one entry per action."""

    stage: np.ndarray
    unit: np.ndarray
    saved: np.ndarray
    """+1: the unit's activations are saved (F); -1: freed (B, or W)."""
    constant: np.ndarray
    """+1 / -1: the stage's first unit in flight starts / its last ends."""
    grad: np.ndarray
    """+1 / -1: a microbatch's slab gradient is allocated (its first B or I of a unit j > 0) / goes."""
    microbatch: np.ndarray
    """+1 / -1: a microbatch starts on the stage (its first unit's F) / ends (the last backward of its units)."""


def pass_events(actions: tuple, k: int) -> Events:
    """The bookkeeping of :func:`memory_walks`, independent of bytes (what each weighs: :mod:`.stage_bytes`)."""
    live: dict[int, int] = {}  # units in flight per stage
    grads: set[tuple[int, int]] = set()  # (stage, microbatch) with a slab gradient
    ended: dict[tuple[int, int], int] = {}  # (stage, microbatch) -> units whose backward has ended
    rows = []
    for a in actions:
        stage, kind = a.stage_index, a.computation_type
        m, j = divmod(a.microbatch_index, k)
        saved = constant = grad = microbatch = 0
        if kind == F:
            saved, constant, microbatch = 1, int(live.get(stage, 0) == 0), int(j == 0)
            live[stage] = live.get(stage, 0) + 1
        else:
            if kind in (B, I) and j > 0 and (stage, m) not in grads:
                grads.add((stage, m))
                grad = 1
            if kind == B or kind == W:
                live[stage] -= 1
                saved, constant = -1, -int(live[stage] == 0)
                if j == 0 and (stage, m) in grads:
                    grads.discard((stage, m))
                    grad = -1
                ended[stage, m] = ended.get((stage, m), 0) + 1
                microbatch = -int(ended[stage, m] == k)
        rows.append((stage, j, saved, constant, grad, microbatch))
    table = np.array(rows, dtype=np.int64).reshape(-1, 6)
    return Events(*(table[:, i] for i in range(6)))


def all_forwards_first(actions: tuple) -> bool:
    """Whether the rank runs every forward before its first backward (GPipe, TeraPipe)."""
    kinds = [a.computation_type for a in actions]
    last_forward = max(i for i, kind in enumerate(kinds) if kind == F)
    return all(kind == F for kind in kinds[: last_forward + 1])
