"""K/V offload in the timing model: each rank's host link, a resource its offload copies queue on, and the
compute it delays.

Under ``kv_offload`` a stage takes an arena off the device over an
:class:`~torchtitan_seq.runtime.kv_offload.OffloadSpan` of its passes
(:func:`~torchtitan_seq.runtime.kv_offload.offload_spans`, on the arenas planned as the runtime plans them):
the copy out starts as pass ``out`` starts and is waited for as ``drop`` starts, the copy back starts as
``back`` starts and is waited for as ``next`` starts. A rank's copies, every stage's, queue one after the
other on its host link (a side stream per stage, one link under them). A copy that ends after the pass
waiting for it would start holds that pass, and every later pass of the rank, back by the difference: the
rank's delay, which the simulated step (timed without copies) grows by where it is the largest. A delay does
not reach other ranks' passes through their inputs here, so a rank's delay counts once, not per rank it
holds up: copies overlap compute where the link keeps up, and the delay is an estimate of the step's growth
where it does not.
"""

from __future__ import annotations

from torchtitan_seq.runtime.kv_offload import arena_of, offload_spans
from torchtitan_seq.runtime.kv_placement import plan_arenas
from torchtitan_seq.schedules.ordering import F, I
from torchtitan_seq.simulate.result import SimResult

__all__ = ["offload_delays"]


def _copies(result: SimResult, rank: int, position_time: float, latency: float) -> list[tuple[float, float, float]]:
    """``rank``'s copies as (issued, time it takes, start of the pass that waits for it), from its timeline."""
    k, lengths = result.subsequences, result.lengths
    size = sum(lengths[:-1])
    intervals = sorted(result.timeline.get(rank, []), key=lambda iv: iv[0])
    copies = []
    for stage in sorted({a.stage_index for _, _, a in intervals}):
        own = [(start, a) for start, _, a in intervals if a.stage_index == stage]
        starts = [start for start, _ in own]
        passes = [(a.computation_type == F, *divmod(a.microbatch_index, k)) for _, a in own if a.computation_type != I]
        plan = plan_arenas(passes, lengths, size)
        for span in offload_spans([a.microbatch_index // k for _, a in own], arena_of(plan)):
            took = latency + (plan.capacity if span.arena >= 0 else size) * position_time
            copies.append((starts[span.out], took, starts[span.drop]))
            copies.append((starts[span.back], took, starts[span.next]))
    return sorted(copies)


def offload_delays(result: SimResult, position_time: float, latency: float = 0.0) -> list[float]:
    """Per rank, how long its offload copies hold its passes back (the module's docstring), in the time
    units of ``result``.

    Args:
        result: the step simulated without copies.
        position_time: time to copy the K/V of one position of one stage (all its layers) over the host link.
        latency: time from a copy's start to its first byte.

    Returns:
        Per rank, ascending, its delay.
    """
    if result.subsequences < 2 or not result.timeline:
        return [0.0 for _ in result.timeline]
    delays = []
    for rank in sorted(result.timeline):
        delay = link_free = 0.0
        for issued, took, needed in _copies(result, rank, position_time, latency):
            link_free = max(issued + delay, link_free) + took
            delay += max(0.0, link_free - (needed + delay))
        delays.append(delay)
    return delays
