"""The memory model's K/V arenas against the runtime's own: along every rank's actions, the arenas the
model counts (:func:`~torchtitan_seq.simulate.memory.arenas.slab_arena_events`, in slabs) hold the bytes the
KV context (:class:`~torchtitan_seq.runtime.kv_context.KVContext`) allocates when it runs those actions, with
and without context parallelism (CP: slabs hold the last unit's K/V too, ``with_own``)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from torchtitan_seq.runtime.kv_context import KVContext, Unit
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES
from torchtitan_seq.schedules.ordering import stage_passes
from torchtitan_seq.simulate.memory import arenas
from torchtitan_seq.simulate.memory.actions import action_plan

LENGTHS = (5, 3, 4, 2, 2, 1, 3, 1)
"""Uneven unit lengths: the first k are a microbatch's cut."""


def _runtime_arenas(actions: tuple, k: int, lengths: list[int], with_own: bool) -> np.ndarray:
    """Positions of K/V arenas one layer's KV contexts hold after each of a rank's ``actions``: each
    stage's context told its passes, the passes run in the rank's order (one position: one float)."""
    contexts, where = {}, {}
    for stage in {a.stage_index for a in actions}:
        at, passes = stage_passes(actions, stage, k)
        contexts[stage] = KVContext(list(lengths))
        contexts[stage].expect(passes)
        where.update({i: (stage, p) for i, p in zip(at, passes)})
    offsets = [sum(lengths[:j]) for j in range(k)]
    held = np.zeros(len(actions))
    for i in range(len(actions)):
        if i in where:
            stage, (forward, m, j) = where[i]
            context, unit = contexts[stage], Unit(m, j, offsets[j], lengths[j], k)
            if forward:
                with context.running(unit):
                    kv = torch.zeros(1, 1, lengths[j], 1)
                    context.append(0, kv, kv, with_own=with_own)
            else:
                with context.backward(unit):
                    pass
        held[i] = sum(t.numel() / 2 for c in contexts.values() for t in c.arenas.tensors())
    return held


SHAPES = [
    (name, p, n, k, split)
    for name in SEQUENCE_SCHEDULES
    for p, n, k, split in itertools.product((2, 3, 4), (2, 3, 4, 6, 8), (1, 2, 3, 5, 8), (False, True))
    if n <= 2 * p  # the memory model builds the lists of these N itself (beyond: N' = 2p + N mod p)
]


@pytest.mark.parametrize("name", list(SEQUENCE_SCHEDULES))
def test_the_memory_models_arenas_are_the_runtimes(name):
    """p 2-4, N 2-8 (N <= 2p), k 1-8, split or not, uneven lengths, with and without CP."""
    checked = 0
    for _, p, n, k, split in (s for s in SHAPES if s[0] == name):
        try:
            plan = action_plan(name, p, n, k, None, split)
        except ValueError:
            continue  # a shape the schedule does not run
        lengths = LENGTHS[:k]
        for rank, with_own in itertools.product(sorted(plan.order), (False, True)):
            size = sum(lengths[: None if with_own else -1])
            actions = plan.order[rank]
            events = arenas.slab_arena_events(len(actions), plan.passes_of(rank, k), lengths, with_own)
            model = np.cumsum(events) * size
            runtime = _runtime_arenas(actions, k, list(lengths), with_own)
            assert np.allclose(model, runtime), (name, p, n, k, split, rank, with_own, model, runtime)
            checked += 1
    assert checked
