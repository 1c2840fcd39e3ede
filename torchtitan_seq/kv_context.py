"""The KV context: each layer's K/V threaded across the subsequences of a microbatch.

A pipeline stage runs a microbatch as k units (subsequences) in order; unit j attends to its
own K/V and to those of units 0..j-1 of its microbatch on the stage. The context keeps, per
microbatch and layer, one :class:`KVSlab`: K and V of the microbatch's keys that later units
read, each unit's written at its offset as it runs forward (one copy of the unit's own K/V,
never of the prefix), so a unit reads its whole prefix, or prefix and own keys together, as
one view. The last unit's keys are read by no later unit: it writes them only where its
kernel reads prefix and own keys in one call (``with_own``).

Gradients flow backwards through the slab without joining the units' autograd graphs
(joining them would let the backward of unit j walk into, and free, the graph of unit j-1):
the slab holds K/V *detached*; a later unit's attention backward adds dL/dK and dL/dV of the
prefix it read into the slab's gradient slab (allocated once per microbatch and layer, added
to in place); a unit's own attention backward adds the part at its own positions to the
gradient of its own K/V, once. This is exact when, per microbatch and stage, backwards run
last unit first (``torchtitan_seq.ordering``), for full and split input/weight backward
alike: the gradient slab is filled and read inside the attention's own backward, in the
input-gradient pass.

Lifetime: a microbatch's slabs live from its first unit's forward until the last of its
units' backwards has ended on the stage (its first unit's, in the order that is exact); the
attention of a unit whose K/V are in the slab saves views of the slab for its backward (not
K/V of its own), so the slab is the one copy of K/V, counted once by
:class:`~torchtitan_seq.memory.ActivationMemory`.
A slab is allocated whole by the first unit, so until the later units have run it holds
room for their K/V (the cost of reading the prefix as one view). :meth:`KVContext.clear`
ends a step.

Packed documents (:attr:`KVContext.documents`): a unit reads only the keys of the document
continuing into it; the K/V of documents that ended stay in the slab until it goes.

Phases (:class:`Phase`): the stage announces each unit it runs, forward with
:meth:`KVContext.running`, backward with :meth:`KVContext.backward`, and the attention op asks
:meth:`KVContext.phase` what its call is: the unit's FORWARD (it writes its K/V into the slab
and reads the prefix), a RECOMPUTE (activation checkpointing re-runs the unit's forward inside
its backward: the attention reads the slab the unit's first forward wrote,
:meth:`KVContext.recorded`, and writes nothing, so recomputation reproduces the same tensors and
never touches the context's state) or the unit's BACKWARD (it reads the slab and sends the
prefix its dK/dV). Outside a unit there is no phase: attention is plain causal attention over
the whole sequence it is given (torch's shape inference runs a stage so).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .documents import Documents

__all__ = ["Unit", "Phase", "KVSlab", "KVContext"]


@dataclass(frozen=True)
class Unit:
    """One (microbatch, subsequence) unit as a stage runs it."""

    microbatch: int  # m, the microbatch's index in the step
    index: int  # j, the subsequence's index within the microbatch
    offset: int  # position of the unit's first token in the full sequence
    length: int  # tokens in the unit
    num_subsequences: int  # k, the units the microbatch is cut into

    @property
    def is_last(self) -> bool:
        return self.index == self.num_subsequences - 1


class Phase(enum.Enum):
    """What an attention call does for the unit the stage runs (:meth:`KVContext.phase`)."""

    FORWARD = "forward"  # the unit's forward: writes its K/V into the slab, reads the prefix
    RECOMPUTE = "recompute"  # its forward again inside its backward (activation checkpointing): reads, writes nothing
    BACKWARD = "backward"  # the unit's backward: reads the slab, sends the prefix's dK/dV to the gradient slab


class KVSlab:
    """K/V of one microbatch in one layer, and the gradient later units send earlier positions.

    ``k`` and ``v``: (batch, kv_heads, capacity, head_dim), allocated by the first write,
    positions [0, ``filled``) written so far (units 0..j in order); ``grad_k`` and ``grad_v``:
    dL/dK and dL/dV of positions [0, n) sent by later units' backward, None until the first is
    sent.
    """

    __slots__ = ("k", "v", "filled", "grad_k", "grad_v")

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.filled = 0
        self.grad_k: torch.Tensor | None = None
        self.grad_v: torch.Tensor | None = None

    def write(self, offset: int, k: torch.Tensor, v: torch.Tensor, capacity: int = 0) -> None:
        """Write a unit's K/V (B, Hkv, L, D) at positions [offset, offset + L), into a slab of
        ``capacity`` positions where this write allocates it."""
        stop = offset + k.shape[2]
        if self.k is None or stop > self.k.shape[2]:  # a context told no lengths grows (copies the prefix)
            b, h, _, d = k.shape
            grown = [k.new_empty(b, h, max(capacity, stop), d) for _ in range(2)]
            if self.k is not None:
                grown[0][:, :, : self.filled], grown[1][:, :, : self.filled] = self.keys(0, self.filled)
            self.k, self.v = grown
        self.k[:, :, offset:stop] = k.detach()
        self.v[:, :, offset:stop] = v.detach()
        self.filled = stop

    def holds(self, stop: int) -> bool:
        """Whether the slab holds the keys before position ``stop``."""
        return self.filled >= stop

    def keys(self, start: int, stop: int, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [start, stop) of batch rows ``rows``, views."""
        return self.k[rows, :, start:stop], self.v[rows, :, start:stop]

    def accumulate(self, grad_k: torch.Tensor, grad_v: torch.Tensor, rows: slice, start: int) -> None:
        """Add the gradient a later unit's attention sends the keys [start, start + n) of batch
        rows ``rows`` (grad_k, grad_v: (rows, Hkv, n, D)), in place."""
        stop = start + grad_k.shape[2]
        if self.grad_k is None or self.grad_k.shape[2] < stop:
            # Once per microbatch and layer when backwards run last unit first (the first sends most).
            old = self.grad_k.shape[2] if self.grad_k is not None else 0
            grad_k_new, grad_v_new = (self.k.new_zeros(*self.k.shape[:2], stop, self.k.shape[3]) for _ in range(2))
            if old:
                grad_k_new[:, :, :old], grad_v_new[:, :, :old] = self.grad_k, self.grad_v
            self.grad_k, self.grad_v = grad_k_new, grad_v_new
        self.grad_k[rows, :, start:stop] += grad_k
        self.grad_v[rows, :, start:stop] += grad_v

    def take(self, offset: int, length: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What later units sent positions [offset, offset + length), views; ``(None, None)`` if nothing."""
        if self.grad_k is None or self.grad_k.shape[2] <= offset:
            return None, None
        stop = min(offset + length, self.grad_k.shape[2])
        return self.grad_k[:, :, offset:stop], self.grad_v[:, :, offset:stop]


class KVContext:
    """Per-stage K/V state of the microbatches in flight. The stage (model chunk) binds it to
    the chunk's attention layers and announces each unit it runs, forward (:meth:`running`) or
    backward (:meth:`backward`); outside a unit the layers compute plain full-sequence causal
    attention. ``lengths``: the units' lengths [L_0, ..., L_{k-1}] of every microbatch, which size
    the slabs; without them a slab grows, a copy of its prefix, as units reach past its end."""

    def __init__(self, lengths: list[int] | None = None) -> None:
        self.lengths = lengths
        self.unit: Unit | None = None
        """The unit being run, forward (:meth:`running`) or backward (:meth:`backward`), or None."""
        self.documents: list[Documents] | None = None
        """Per microbatch, its packed documents (block-causal attention); None: causal."""
        self._backward = False  # whether ``unit`` runs backward
        self._slabs: dict[int, dict[int, KVSlab]] = {}  # microbatch -> layer id -> slab
        self._backwards: dict[int, int] = {}  # microbatch -> units whose backward has ended

    def phase(self, *, forward: bool) -> Phase | None:
        """The phase of an attention op's call now, ``forward`` for the op's forward, else for its
        backward: inside :meth:`running` FORWARD; inside :meth:`backward` the forward is a
        RECOMPUTE (activation checkpointing) and the backward BACKWARD; None outside a unit (and for
        a backward outside :meth:`backward`): attention over the whole sequence, causal."""
        if self.unit is None:
            return None
        if not self._backward:
            return Phase.FORWARD if forward else None
        return Phase.RECOMPUTE if forward else Phase.BACKWARD

    def documents_of(self, unit: Unit) -> Documents | None:
        """The packed documents of ``unit``'s microbatch; None under causal attention."""
        return None if self.documents is None else self.documents[unit.microbatch]

    @contextlib.contextmanager
    def _running(self, unit: Unit, backward: bool) -> Iterator[None]:
        """Run ``unit``, forward or ``backward``; one unit at a time."""
        if self.unit is not None:
            raise RuntimeError(f"KVContext: {unit} started while {self.unit} is running")
        self.unit, self._backward = unit, backward
        try:
            yield
        finally:
            self.unit, self._backward = None, False

    def running(self, unit: Unit) -> contextlib.AbstractContextManager[None]:
        """Run the forward of ``unit`` inside this context (phase FORWARD)."""
        return self._running(unit, backward=False)

    @contextlib.contextmanager
    def backward(self, unit: Unit, last_pass: bool = True) -> Iterator[None]:
        """Run a backward pass of ``unit`` (phase BACKWARD, its recomputations RECOMPUTE);
        ``last_pass``: the unit's backward ends with it."""
        with self._running(unit, backward=True):
            try:
                yield
            finally:
                if last_pass:
                    done = self._backwards[unit.microbatch] = self._backwards.get(unit.microbatch, 0) + 1
                    if done == unit.num_subsequences:  # the microbatch's last backward on the stage
                        self._slabs.pop(unit.microbatch, None)
                        del self._backwards[unit.microbatch]

    def recorded(self, layer_id: int) -> KVSlab:
        """The slab that ``layer_id`` wrote in the forward of the unit in backward (phases RECOMPUTE
        and BACKWARD)."""
        unit = self.unit if self._backward else None
        slab = self._slabs.get(unit.microbatch, {}).get(layer_id) if unit is not None else None
        if slab is None or not slab.holds(unit.offset):
            raise RuntimeError(f"layer {layer_id} recomputed outside the backward of a unit it ran forward")
        return slab

    def own(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Views of ``layer_id``'s slab at the positions of the unit running forward (or
        recomputed), where its K/V lie; None outside a unit or where the slab holds none of them."""
        unit = self.unit
        slab = self._slabs[unit.microbatch][layer_id] if unit is not None else None
        if slab is None or not slab.holds(unit.offset + unit.length):
            return None
        # Aliases with a version counter of their own: later units write other positions of the
        # slab, which autograd would otherwise take for a change of what the unit saved.
        return tuple(t.data for t in slab.keys(unit.offset, unit.offset + unit.length))

    def append(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, with_own: bool = False) -> KVSlab:
        """Write the current unit's K/V (B, Hkv, L, D) for ``layer_id`` into its microbatch's slab,
        unless the unit is the last and not ``with_own`` (no later unit reads its keys, and its
        kernel reads them apart from the prefix). The first unit allocates the slab: room for the
        keys later units read, the last unit's too if ``with_own``. Returns the slab."""
        unit = self.unit
        if unit is None or self._backward:
            raise RuntimeError("KVContext.append called outside a unit's forward")
        layers = self._slabs.setdefault(unit.microbatch, {})
        slab = layers.get(layer_id)
        if (slab.filled if slab is not None else 0) != unit.offset or (slab is None) != (unit.index == 0):
            raise RuntimeError(
                f"layer {layer_id}: subsequence {unit.index} of microbatch {unit.microbatch} "
                f"ran forward after {slab.filled if slab is not None else 0} positions; forwards must run in "
                "subsequence order, each once"
            )
        if slab is None:
            slab = layers[layer_id] = KVSlab()
        if not unit.is_last or with_own:
            capacity = sum(self.lengths[: None if with_own else -1]) if self.lengths else 0
            slab.write(unit.offset, k, v, capacity)
        return slab

    def clear(self) -> None:
        """Forget every microbatch (end of step)."""
        self.unit, self._backward = None, False
        self._slabs.clear()
        self._backwards.clear()

    def held_storages(self) -> dict[int, int]:
        """The storages of the K/V the context keeps alive (its slabs): data_ptr -> bytes."""
        tensors = [t for layers in self._slabs.values() for s in layers.values() for t in (s.k, s.v) if t is not None]
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}

    def held_bytes(self) -> int:
        """Bytes of K/V the context keeps alive, each storage once."""
        return sum(self.held_storages().values())

    def __len__(self) -> int:
        """Number of microbatches whose K/V the context still holds."""
        return len(self._slabs)
