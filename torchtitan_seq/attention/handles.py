"""A bound attention layer's handle: what its op reads at run time (:class:`LayerBinding`), found by the
address of a small host tensor the layer passes (custom ops take no Python objects)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from torch import Tensor

from torchtitan_seq.attention.kernels import AttentionKernel
from torchtitan_seq.runtime.kv_context import KVContext
from torchtitan_seq.runtime.reach import FULL, Reach


@dataclass(eq=False)
class LayerBinding:
    """What a bound attention layer's custom op reads at run time: the stage's context and kernel,
    the layer's id in the context and its attention's reach."""

    context: KVContext
    kernel: AttentionKernel
    layer_id: int
    reach: Reach = FULL


# Custom ops take no Python objects: a bound layer passes a small host tensor of its own, ``ids``,
# and its binding is found by that tensor's address, a Python int read without reading the tensor
# (its values are never read on the unit path: a read of a tensor is a device sync where it lies on
# one). The graphs that saved ``ids`` keep it alive, so its address names no other binding meanwhile.
BINDINGS: weakref.WeakValueDictionary[int, LayerBinding] = weakref.WeakValueDictionary()


def binding_of(ids: Tensor) -> LayerBinding:
    """The binding behind a layer's ``ids``."""
    binding = BINDINGS.get(ids.data_ptr())
    if binding is None:
        raise RuntimeError(
            "unit attention: its SequenceAttention module is gone or rebound; "
            "keep the model alive (and bound) until its graphs have run backward"
        )
    return binding
