"""How far back a layer's queries read: its attention's reach.

Full causal attention reads every earlier key. Two kinds read less, each a property of a layer:

- a sliding window (gpt-oss's every other layer): a query at position p reads keys (p - window, p],
  as torchtitan's ``get_sliding_window_mask_mod`` masks them;
- attention chunks (Llama 4's RoPE layers): a query reads only the keys of its own chunk of
  ``chunk`` positions, [p - p % chunk, p], as ``get_fixed_block_mask_mod`` masks them; a chunk's
  boundaries need not match a unit's.

Both compose with packed documents: a query reads the keys its document, its window and its chunk
all allow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["FULL", "KVContextMode", "Reach"]

KVContextMode = Literal["reach", "full", "latent"]
"""What a layer's K/V context keeps of earlier units: ``"reach"``, only the positions later units can
still read (a window's last positions, the current attention chunk; every position for full attention);
``"full"``, every earlier position; ``"latent"``, an MLA layer's compressed latent and RoPE key of every
earlier position instead of its keys and values (:mod:`~torchtitan_seq.runtime.kv_latent`), other layers
as ``"reach"`` (the ``[sequence_pipeline] kv_context`` setting)."""


@dataclass(frozen=True)
class Reach:
    """A layer's attention reach (hashable: kernel calls are built once per unit shape and reach)."""

    window: int | None = None
    """Keys at most ``window - 1`` positions before the query (the query's own included); None: no window."""
    chunk: int | None = None
    """Keys of the query's own attention chunk, chunks of ``chunk`` positions from 0; None: no chunks."""

    def __post_init__(self) -> None:
        for name in ("window", "chunk"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"attention {name} = {value}: must be at least 1 (or None)")

    @property
    def bounded(self) -> bool:
        """Whether the layer's queries read less than every earlier key."""
        return self.window is not None or self.chunk is not None

    def chunk_starts(self, begin: int, end: int) -> tuple[int, ...]:
        """The first positions of the attention chunks that hold positions [begin, end), in order
        (none without chunks)."""
        if self.chunk is None:
            return ()
        return tuple(range(begin - begin % self.chunk, end, self.chunk))


FULL = Reach()
"""Full causal attention: every earlier key."""
