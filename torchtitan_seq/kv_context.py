"""The KV context: each layer's K/V threaded across the subsequences of a microbatch.

A pipeline stage runs a microbatch as k units (subsequences) in order; unit j attends to its
own K/V and to those of units 0..j-1 of its microbatch on the stage. The context keeps, per
microbatch and layer, one :class:`KVBlock` per finished unit.

Gradients flow backwards through the blocks without joining the units' autograd graphs
(joining them would let the backward of unit j walk into, and free, the graph of unit j-1):
a block stores its K/V *detached*; a later unit's attention backward adds dL/dK and dL/dV of
every block it read into that block's side buffers (:class:`KVGrads`); the block's own
unit's attention backward adds them to the gradient of its own K/V, once. This is exact
when, per microbatch and stage, backwards run last unit first (``torchtitan_seq.ordering``),
for full and split input/weight backward alike: the side buffers are filled and consumed
inside the attention's own backward, in the input-gradient pass.

Lifetime: the context forgets a microbatch once its last unit has run forward on the stage;
from then on the records of the units that read a block keep it alive, until their backward.
A unit's own record keeps only its side buffers: its backward recomputes or has saved its
K/V. :meth:`KVContext.clear` ends a step.

Packed documents (:attr:`KVContext.documents`): a unit reads only the prefix blocks holding
keys of the document continuing into it, and the context lets go of the K/V of documents
that ended: whole blocks, and a block's ended head, keeping a copy of its tail, where the
context's reference is what keeps the K/V alive (``copy_tails``: under activation
checkpointing and compile; otherwise autograd keeps them for the backward).

Activation checkpointing re-runs a unit's forward inside its backward
(:meth:`KVContext.backward`); the attention then reads the blocks the unit's first forward
used (:meth:`KVContext.recorded`) instead of appending again, so recomputation reproduces
the same tensors and never touches the context's state.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from .documents import Documents

__all__ = ["Unit", "KVGrads", "KVBlock", "KVContext"]


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


class KVGrads:
    """dL/dK and dL/dV that later units send one unit's block, until the unit's backward."""

    __slots__ = ("k", "v", "_shape")

    def __init__(self, shape: torch.Size) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self._shape = shape  # the unit's K (and V) shape, not K: the buffers must not keep K alive

    def add(self, grad_k: torch.Tensor, grad_v: torch.Tensor, where: tuple[slice, ...] = ()) -> None:
        """Add the gradient of the whole block, or of the part ``where`` (an index of K)."""
        if where:
            if self.k is None:
                self.k, self.v = grad_k.new_zeros(self._shape), grad_v.new_zeros(self._shape)
            self.k[where] += grad_k
            self.v[where] += grad_v
        else:
            self.k, self.v = (grad_k, grad_v) if self.k is None else (self.k + grad_k, self.v + grad_v)

    def take(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Hand over (and forget) everything later units sent; ``(None, None)`` if nothing."""
        grads, self.k, self.v = (self.k, self.v), None, None
        return grads


class KVBlock:
    """K/V of one unit in one layer, with the gradient later units send it.

    ``k`` and ``v`` are detached, shaped (batch, kv_heads, length, head_dim);
    ``offset`` is the position of the block's first key in the sequence. A
    block cut to its tail (:meth:`tail`) keeps its unit's ``grads``; ``start``
    is where its keys begin among the unit's.
    """

    __slots__ = ("k", "v", "offset", "grads", "start")

    def __init__(
        self, k: torch.Tensor, v: torch.Tensor, offset: int = 0, grads: KVGrads | None = None, start: int = 0
    ):
        self.k, self.v, self.offset, self.start = k.detach(), v.detach(), offset, start
        self.grads = grads or KVGrads(self.k.shape)

    @property
    def end(self) -> int:
        """Position after the block's last key."""
        return self.offset + self.k.shape[2]

    def accumulate(self, grad_k: torch.Tensor, grad_v: torch.Tensor, where: tuple[slice, ...] = ()) -> None:
        """Add the gradient that a later unit's attention sends into this block, or into
        the part ``where`` (an index of k) of it."""
        if self.start:
            rows, heads, keys = where or (slice(None), slice(None), slice(0, self.k.shape[2]))
            where = (rows, heads, slice(keys.start + self.start, keys.stop + self.start))
        self.grads.add(grad_k, grad_v, where)

    def tail(self, first: int) -> KVBlock:
        """A copy of the keys from position ``first`` on, sending its gradient to this block's unit."""
        cut = first - self.offset
        return KVBlock(self.k[:, :, cut:].clone(), self.v[:, :, cut:].clone(), first, self.grads, self.start + cut)


class KVContext:
    """Per-stage K/V state of the microbatches in flight. The stage (model chunk) binds it to
    the chunk's attention layers and announces each unit with :meth:`running`; outside a
    unit the layers compute plain full-sequence causal attention."""

    def __init__(self, copy_tails: bool = False) -> None:
        self.copy_tails = copy_tails
        """Cut blocks to the tail later units read, copied (see the module docstring)."""
        self.unit: Unit | None = None
        """The unit being run forward (:meth:`running`; not a recomputation), or None."""
        self.backward_unit: Unit | None = None
        """The unit whose backward (:meth:`backward`), with any recomputation, is running, or None."""
        self.documents: list[Documents] | None = None
        """Per microbatch, its packed documents (block-causal attention); None: causal."""
        # microbatch -> layer id -> blocks of units 0..j-1, in order; None for a
        # block no later unit reads
        self._blocks: dict[int, dict[int, list[KVBlock | None]]] = {}
        # (microbatch, subsequence) -> layer id -> (prefix read, own side buffers) of its
        # forward, kept until the unit's backward is over, for recomputation
        self._records: dict[tuple[int, int], dict[int, tuple[list[KVBlock], KVGrads]]] = {}

    def documents_of(self, unit: Unit | None) -> Documents | None:
        """The packed documents of ``unit``'s microbatch; None under causal attention or outside a unit."""
        return None if self.documents is None or unit is None else self.documents[unit.microbatch]

    @contextlib.contextmanager
    def running(self, unit: Unit) -> Iterator[None]:
        """Run the forward of ``unit`` inside this context."""
        if self.unit is not None:
            raise RuntimeError(f"KVContext: {unit} started while {self.unit} is running")
        self.unit = unit
        try:
            yield
        finally:
            self.unit = None
            if unit.is_last:
                self._blocks.pop(unit.microbatch, None)

    @contextlib.contextmanager
    def backward(self, unit: Unit, last_pass: bool = True) -> Iterator[None]:
        """Run a backward pass of ``unit``; ``last_pass``: the unit's backward ends with it."""
        self.backward_unit = unit
        try:
            yield
        finally:
            self.backward_unit = None
            if last_pass:
                self._records.pop((unit.microbatch, unit.index), None)

    def recorded(self, layer_id: int) -> tuple[list[KVBlock], KVGrads]:
        """The prefix that ``layer_id`` read in the forward of the unit in backward, and the
        side buffers of the unit's own block."""
        unit = self.backward_unit
        try:
            return self._records[(unit.microbatch, unit.index)][layer_id]
        except (KeyError, TypeError):
            raise RuntimeError(f"layer {layer_id} recomputed outside the backward of a unit it ran forward") from None

    def append(
        self, layer_id: int, k: torch.Tensor, v: torch.Tensor, copy: bool = False
    ) -> tuple[list[KVBlock], KVGrads]:
        """Record the current unit's K/V for ``layer_id``, copied if ``copy`` (a compiled graph may
        reuse its intermediates' buffers once the attention returns), cut blocks then copied too.
        Returns the earlier units' blocks the unit reads (with packed documents, those holding
        keys of the document continuing into it) and the side buffers of the unit's new block."""
        unit = self.unit
        if unit is None:
            raise RuntimeError("KVContext.append called outside a unit")
        blocks = self._blocks.setdefault(unit.microbatch, {}).setdefault(layer_id, [])
        if len(blocks) != unit.index:
            raise RuntimeError(
                f"layer {layer_id}: subsequence {unit.index} of microbatch {unit.microbatch} "
                f"ran forward after {len(blocks)} subsequences; forwards must run in "
                "subsequence order, each once"
            )
        documents = self.documents_of(unit)
        first = documents.first_needed(unit.offset) if documents is not None else 0
        for i, b in enumerate(blocks):
            if b is not None and b.end <= first:
                blocks[i] = None
            elif b is not None and b.offset < first and (copy or self.copy_tails):
                blocks[i] = b.tail(first)
        prefix = [b for b in blocks if b is not None]
        block = KVBlock(k.clone() if copy else k, v.clone() if copy else v, unit.offset)
        if not unit.is_last:
            blocks.append(block)
        self._records.setdefault((unit.microbatch, unit.index), {})[layer_id] = (prefix, block.grads)
        return prefix, block.grads

    def clear(self) -> None:
        """Forget every microbatch (end of step)."""
        self.unit = self.backward_unit = None
        self._blocks.clear()
        self._records.clear()

    def held_storages(self) -> dict[int, int]:
        """The storages of the K/V the context keeps alive (blocks and records): data_ptr -> bytes."""
        blocks = [b for layers in self._blocks.values() for bs in layers.values() for b in bs if b is not None]
        blocks += [b for rec in self._records.values() for prefix, _ in rec.values() for b in prefix]
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for b in blocks for t in (b.k, b.v)}

    def held_bytes(self) -> int:
        """Bytes of K/V the context keeps alive, each storage once."""
        return sum(self.held_storages().values())

    def __len__(self) -> int:
        """Number of microbatches and units whose K/V the context still holds."""
        return len(self._blocks) + len(self._records)
