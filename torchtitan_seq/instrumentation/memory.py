"""Activation memory, measured: the bytes autograd keeps alive for backward.

Every tensor that autograd saves for backward passes through a saved-tensor hook;
:class:`ActivationMemory` counts each distinct storage once while any saved reference to it lives,
and keeps the peak. Parameters (and views of them) are left out. The figure is the same on CPU and
GPU, so schedules compare across devices and against torch's own schedules. Under activation
checkpointing, torch's checkpoint replaces these hooks inside each region: the region's inputs are
counted, but not the outputs that op-level selective AC caches (the figure then equals full AC's).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["ActivationMemory"]


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind ``t``; a wrapper subclass (DTensor) owns its inner tensors'."""
    if not isinstance(t, torch.Tensor):
        return []
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        return [s for a in t.__tensor_flatten__()[0] for s in _storages(getattr(t, a))]
    return [t.untyped_storage()]


class ActivationMemory:
    """Live and peak bytes of saved activations on this process."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self._live: dict[int, list[int]] = {}  # storage address -> [live saved references, bytes]

    def saves(self, storage_ptr: int) -> bool:
        """Whether autograd keeps the storage at ``storage_ptr`` (its data_ptr) for backward."""
        return storage_ptr in self._live

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Count saved activations inside the block; the peak restarts at the current level."""
        self.peak = self.current
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t
        keys = []
        for storage in _storages(t):
            keys.append(key := storage.data_ptr())
            if key not in self._live:
                self._live[key] = [0, storage.nbytes()]
                self.current += storage.nbytes()
            self._live[key][0] += 1
        self.peak = max(self.peak, self.current)
        # A detached alias, so the saved object holds no grad_fn (no cycle for saved
        # outputs); its death marks the release of the saved reference.
        saved = t.detach()
        weakref.finalize(saved, self._release, keys)
        return saved

    def _release(self, keys: list[int]) -> None:
        for key in keys:
            entry = self._live[key]
            entry[0] -= 1
            if entry[0] == 0:
                self.current -= entry[1]
                del self._live[key]
