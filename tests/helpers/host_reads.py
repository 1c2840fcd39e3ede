"""An instrument for host reads of tensors on the unit path (a device sync where the tensor is on a GPU).

Every Python-level way to read a tensor on the host, or to make a tensor whose shape needs its values
there, is counted while one of the given KV contexts runs a unit (forward, recompute or backward).
On the CPU no read syncs anything, so the instrument cannot tell a device tensor from a host one: it
counts every read of any tensor, which is stricter than a GPU needs. ``tests/unit/test_no_sync.py``
steps every schedule under it; the exactness harness (:mod:`harness`) steps every variant under it
(CP, TP, FSDP, AC, compile, packed documents), after the schedule's first step (which infers shapes).
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator

import torch

from torchtitan_seq.runtime.kv_context import KVContext

__all__ = ["reads_during_units"]

# Tensor methods and torch functions that read a tensor on the host, or whose result's shape needs
# its values there (a sync on a GPU).
_TENSOR_READS = (
    "item",
    "tolist",
    "cpu",
    "numpy",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "nonzero",
    "masked_select",
    "unique",
    "unique_consecutive",
    "repeat_interleave",
)
_TORCH_READS = ("nonzero", "masked_select", "unique", "unique_consecutive", "repeat_interleave", "equal", "is_nonzero")
_OWNERS = ((torch.Tensor, _TENSOR_READS), (torch, _TORCH_READS))


@contextlib.contextmanager
def reads_during_units(contexts: list[KVContext]) -> Iterator[list[str]]:
    """Instruments the reads; yields the list of those made while one of ``contexts`` runs a unit."""
    seen: list[str] = []
    originals = [(owner, name, getattr(owner, name)) for owner, names in _OWNERS for name in names]

    def instrument(name: str, original):
        def read(*args, **kwargs):
            if any(c.unit is not None for c in contexts):
                seen.append(f"{name}\n{''.join(traceback.format_stack(limit=8)[:-1])}")
            return original(*args, **kwargs)

        return read

    try:
        for owner, name, original in originals:
            setattr(owner, name, instrument(name, original))
        yield seen
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
