"""Offload of the K/V context: a stage's arenas copied to host memory while none of the stage's passes
reads them, and back before the pass that does (``[sequence_pipeline] kv_offload``).

A microbatch's slabs are read from its first forward until its last backward on the stage, but between its
last forward and first backward (and between the units of interleaved and bidirectional schedules) they may
lie unread for many passes while other microbatches compute. The stage's pass order is known (every F, I,
B and W of the stage, :meth:`KVOffload.expect`), and so is the arena each microbatch's slabs lie in (the
arena plan, :mod:`~torchtitan_seq.runtime.kv_placement`): an arena, all its layers, is touched by every pass
of a microbatch in it. Where an arena that holds K/V in use is touched at passes t1 and t2 and by none of the
at least :data:`MIN_GAP` passes between (an :class:`OffloadSpan`), as the stage's passes start:

* t1 + 1: its storages are copied to host memory (pinned on CUDA) on a side stream, after what the compute
  stream has queued (the writes of pass t1);
* t1 + 2: the compute stream waits for that copy (done by then unless the link is slower than a pass) and
  the device storages are freed: resized to 0 bytes in place, so the views autograd saved of them stay;
* t2 - 1: the storages are allocated again on the compute stream and copied back on the side stream;
* t2: the compute stream waits for the copy back.

No host synchronisation in the unit path: the side stream and the compute stream meet only at events. On a
CPU device there is no side stream: the copies run when issued, otherwise alike, so the mechanism (and its
exactness) runs on the CPU. The bytes copied back are the bytes copied out: exact. Only the arenas go (slabs
of bounded reach, MLA latents and gradient slabs stay on the device). The memory model
(:mod:`torchtitan_seq.simulate.memory`) and the simulator's copy link (:mod:`torchtitan_seq.simulate.offload`)
take the same spans from :func:`offload_spans`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from torchtitan_seq.runtime.kv_arena import KVArenas
from torchtitan_seq.runtime.kv_placement import ArenaPlan, Pass

__all__ = [
    "MIN_GAP",
    "OffloadSpan",
    "offload_spans",
    "arena_of",
    "HostCopies",
    "StreamCopies",
    "copies_for",
    "KVOffload",
]

MIN_GAP = 3
"""Passes an arena must go unread for to be offloaded: one to copy it out, one off the device, one to copy
it back."""


class OffloadSpan(NamedTuple):
    """An arena off the device between two passes of the stage that touch it (indices into its passes)."""

    arena: int
    last: int
    """The pass before: the copy out starts as pass ``last + 1`` starts, the device copy goes as ``last + 2`` does."""
    next: int
    """The pass after: the copy back starts as pass ``next - 1`` starts and is waited for as ``next`` starts."""

    @property
    def out(self) -> int:
        return self.last + 1

    @property
    def drop(self) -> int:
        return self.last + 2

    @property
    def back(self) -> int:
        return self.next - 1


def arena_of(plan: ArenaPlan) -> Callable[[int], int]:
    """Microbatch -> the arena its slabs lie in, as :class:`~torchtitan_seq.runtime.kv_arena.KVArenas` places
    them (one of its own, -1 - m, where the plan has none)."""
    return lambda m: plan.slabs[m].arena if m in plan.slabs else -1 - m


def offload_spans(
    microbatches: Sequence[int], arena: Callable[[int], int], min_gap: int = MIN_GAP
) -> list[OffloadSpan]:
    """Where each arena goes off the device: between two consecutive passes touching it with at least
    ``min_gap`` passes between, while a microbatch in it is in flight (its first pass before, its last
    after: an arena holds nothing between microbatches).

    Args:
        microbatches: the microbatch of each pass of the stage (every F, I, B and W), in order.
        arena: microbatch -> its arena (:func:`arena_of`).
        min_gap: the fewest passes between (at least :data:`MIN_GAP`).

    Returns:
        The spans, by pass of the copy out.
    """
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    touches: dict[int, list[int]] = {}
    for t, m in enumerate(microbatches):
        first.setdefault(m, t)
        last[m] = t
        touches.setdefault(arena(m), []).append(t)
    members: dict[int, list[int]] = {}
    for m in first:
        members.setdefault(arena(m), []).append(m)
    spans = []
    for a, ts in touches.items():
        for t1, t2 in zip(ts, ts[1:]):
            held = any(first[m] <= t1 and last[m] >= t2 for m in members[a])
            if t2 - t1 - 1 >= max(min_gap, MIN_GAP) and held:
                spans.append(OffloadSpan(a, t1, t2))
    return sorted(spans, key=lambda s: (s.out, s.arena))


class HostCopies:
    """Copies between the device and host memory where there is no side stream (a CPU device): each runs
    when issued."""

    def host(self, nbytes: int) -> torch.UntypedStorage:
        """Host memory for ``nbytes`` of an arena."""
        return torch.empty(nbytes, dtype=torch.uint8).untyped_storage()

    def copy(self, pairs: list[tuple[torch.UntypedStorage, torch.UntypedStorage]]) -> Any:
        """Copy each (into, source) pair; returns what :meth:`wait` waits for (nothing: done)."""
        for into, source in pairs:
            into.copy_(source)
        return None

    def wait(self, done: Any) -> None:
        """Nothing to wait for: the copies ran when issued."""


class StreamCopies:
    """Copies on a side stream of ``device`` (CUDA): each after what the compute stream queued before it, and
    waited for by the compute stream at an event, not by the host."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device)

    def host(self, nbytes: int) -> torch.UntypedStorage:
        """Pinned host memory for ``nbytes`` of an arena (an asynchronous copy needs it)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()

    def copy(self, pairs: list[tuple[torch.UntypedStorage, torch.UntypedStorage]]) -> Any:
        """Copy each (into, source) pair on the side stream after what the compute stream queued; returns
        the event that marks them done."""
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            for into, source in pairs:
                into.copy_(source, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.side)
        return done

    def wait(self, done: Any) -> None:
        """The compute stream waits for ``done`` (the host does not)."""
        torch.cuda.current_stream(self.device).wait_event(done)


def copies_for(device: torch.device) -> HostCopies | StreamCopies:
    """How arenas on ``device`` are copied: on a side stream on CUDA, when issued elsewhere."""
    return StreamCopies(device) if device.type == "cuda" else HostCopies()


class KVOffload:
    """Offload of a stage's K/V arenas (see the module's docstring), driven by the passes the stage announces.

    Args:
        arenas: the stage's arenas (its :class:`~torchtitan_seq.runtime.kv_context.KVContext`'s).
        copies: how the arenas are copied; None: as their device takes them (:func:`copies_for`).
    """

    def __init__(self, arenas: KVArenas, copies: HostCopies | StreamCopies | None = None) -> None:
        self.arenas = arenas
        self._passes: list[Pass] | None = None
        self._actions: dict[int, list[tuple[str, int]]] | None = None  # pass -> (what, arena), as it starts
        self._cursor = 0  # the index of the next pass
        self._host: dict[tuple[int, ...], torch.UntypedStorage] = {}  # (layer, K or V, arena, bytes): kept across steps
        self._away: dict[int, list[tuple[torch.UntypedStorage, torch.UntypedStorage]]] = {}  # arena -> (device, host)
        self._copies: dict[int, Any] = {}  # arena -> its copy in flight
        self._link = copies

    def expect(self, passes: Sequence[Pass]) -> None:
        """The order of every pass of the stage each step, F, I, B and W, as (forward, microbatch,
        subsequence); without it nothing is offloaded."""
        self._passes = list(passes)
        self._actions = None

    def spans(self) -> list[OffloadSpan]:
        """Where the arenas go off the device; none before the arenas are planned (the stage's first write)."""
        plan = self.arenas.plan
        if self._passes is None or plan is None:
            return []
        return offload_spans([m for _, m, _ in self._passes], arena_of(plan))

    def before(self, forward: bool, microbatch: int, index: int) -> None:
        """The stage starts a pass of unit ``index`` of ``microbatch`` (forward or a backward pass): its
        arena is on the device once this returns (or the compute stream waits for it), and the copies the
        plan puts here are issued. A pass other than the one expected (a forward-only ``eval`` step runs
        none of the backwards) brings every arena back and pauses the offload until the next step."""
        if self._passes is None:
            return
        announced = (forward, microbatch, index)
        t = self._cursor
        if t >= len(self._passes) or (self._passes[t] != announced == self._passes[0]):
            self.clear()  # a step begins (after the last one ended, was paused, or was cut short)
            t = 0
        if self._passes[t] != announced:
            self._pause()
            return
        self._cursor += 1
        if self._actions is None:
            if self.arenas.plan is None:
                return
            self._actions = {}
            for s in self.spans():
                for when, what in ((s.next, "wait"), (s.drop, "drop"), (s.out, "out"), (s.back, "back")):
                    self._actions.setdefault(when, []).append((what, s.arena))
            for acts in self._actions.values():  # waits, then drops, then copies out, then copies back
                acts.sort(key=lambda a: ("wait", "drop", "out", "back").index(a[0]))
        for what, arena in self._actions.get(t, ()):
            getattr(self, f"_{what}")(arena)

    def _link_for(self, device: torch.device) -> HostCopies | StreamCopies:
        if self._link is None:
            self._link = copies_for(device)
        return self._link

    def _out(self, arena: int) -> None:
        """Copy ``arena``'s storages (every layer's K and V) to host memory."""
        pairs = []
        for layer, *kv in self.arenas.buffers_of(arena):
            link = self._link_for(kv[0].device)
            for which, tensor in enumerate(kv):
                device = tensor.untyped_storage()
                key = (layer, which, arena, device.nbytes())
                if key not in self._host:
                    self._host[key] = link.host(device.nbytes())
                pairs.append((device, self._host[key]))
        if pairs:
            self._away[arena] = pairs
            self._copies[arena] = self._copy(pairs, out=True)

    def _copy(self, pairs: list[tuple[torch.UntypedStorage, torch.UntypedStorage]], out: bool) -> Any:
        """Copy (device, host) ``pairs`` ``out`` to the host or back; returns what marks them done."""
        return self._link.copy([(host, device) if out else (device, host) for device, host in pairs])

    def _drop(self, arena: int) -> None:
        """Free ``arena``'s device storages, once their copy out is done."""
        if arena not in self._away:
            return
        self._link.wait(self._copies.pop(arena))
        for device, _ in self._away[arena]:
            device.resize_(0)

    def _back(self, arena: int) -> None:
        """Allocate ``arena``'s storages again and copy them back."""
        pairs = self._away.get(arena)
        if pairs is None:
            return
        for device, host in pairs:
            device.resize_(host.nbytes())
        self._copies[arena] = self._copy(pairs, out=False)

    def _wait(self, arena: int) -> None:
        """The compute stream waits for ``arena``'s copy back."""
        if self._away.pop(arena, None) is not None:
            self._link.wait(self._copies.pop(arena))

    def _pause(self) -> None:
        """Bring every arena back and offload nothing more this step."""
        for arena in list(self._away):
            if self._away[arena][0][0].nbytes() == 0:  # dropped: not yet on its way back
                self._back(arena)
            self._wait(arena)
        self._cursor = len(self._passes)

    def clear(self) -> None:
        """Start the next step at its first pass (its arenas are new; the host buffers stay)."""
        self._cursor = 0
        self._away.clear()
        self._copies.clear()

    def host_bytes(self) -> int:
        """Bytes of host memory kept for the arenas' copies."""
        return sum(h.nbytes() for h in self._host.values())
