"""K/V context memory, measured: the bytes a rank's KV contexts hold.

A stage's :class:`~torchtitan_seq.runtime.kv_context.KVContext` holds each microbatch's K/V for the units
that read it later (its arenas and slabs; a layer of bounded reach only what it can still read).
:class:`KVMemory` samples what the rank's contexts hold, each storage once, as each unit starts and as
a microbatch's last backward ends, and keeps the peak: the K/V a step holds at most grows only in
forwards and is sampled as the next pass starts. Gradient slabs are not counted (they live inside
backward passes, with the activations' gradients).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from torchtitan_seq.runtime.kv_context import KVContext

__all__ = ["KVMemory"]


class KVMemory:
    """Peak bytes of K/V held by a rank's KV contexts (one per pipeline stage on the rank).

    Args:
        contexts: the rank's stages' contexts.
    """

    def __init__(self, contexts: Sequence[KVContext]) -> None:
        self.contexts = list(contexts)
        self.peak = 0

    def held(self) -> int:
        """Bytes the contexts hold now, each storage once."""
        return sum({ptr: n for c in self.contexts for ptr, n in c.held_storages().items()}.values())

    def sample(self) -> None:
        """Take what the contexts hold now into the peak."""
        self.peak = max(self.peak, self.held())

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Sample the contexts inside the block; the peak restarts at what they hold now."""
        self.peak = self.held()
        for c in self.contexts:
            c.meter = self
        try:
            yield
        finally:
            for c in self.contexts:
                c.meter = None
