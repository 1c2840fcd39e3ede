"""The KV context: each layer's K/V threaded across the subsequences of a microbatch.

A pipeline stage runs a microbatch as k units (subsequences) in order. Unit j
of microbatch m attends to its own keys/values and to those of units 0..j-1
of the same microbatch on the same stage. The context keeps, per microbatch and
per layer, one :class:`KVBlock` per finished unit.

Gradients flow backwards through the blocks without joining the units'
autograd graphs (joining them would let the backward of unit j walk into, and
free, the graph of unit j-1):

* a block stores its K/V *detached*;
* when a later unit's attention runs backward, it adds dL/dK and dL/dV of every
  block it read into that block's side buffers (:meth:`KVBlock.accumulate`,
  into :class:`KVGrads`);
* when the block's own unit runs backward, its attention adds the side buffers
  to the gradient of its own K/V, once (:meth:`KVGrads.take`).

This is exact when, per microbatch and stage, backwards run last unit first
(see ``torchtitan_seq.ordering``). It works for full backward and for split
input/weight backward alike, because the side buffers are filled and consumed
inside the attention's own backward, which runs in the input-gradient pass.

Lifetime: the context forgets a microbatch once its last unit has run forward
on the stage; from then on the records of the units that read a block keep it
alive, until their backward. A unit's own record keeps only its side buffers:
its backward recomputes or has saved its K/V. :meth:`KVContext.clear` drops everything at
the end of a step.

Packed documents (block-causal attention): the schedule hands the context each
microbatch's :class:`~torchtitan_seq.documents.Documents`. A unit then reads,
of the prefix, only the blocks that hold keys of the document continuing into
it, and the context lets go of the K/V of documents that ended before the unit:
no later unit of the microbatch reads them. Whole blocks go; a block that ends
with the start of a continuing document is cut to that tail, copied, where the
context's reference is what keeps the K/V alive (``copy_tails``: under
activation checkpointing, and under compile, where blocks are copies anyway);
otherwise autograd keeps the unit's K/V for its backward regardless.

Activation checkpointing re-runs a unit's forward inside its backward. The
stage announces that backward (:meth:`KVContext.backward`), and the attention
then reads the blocks the unit's first forward used (:meth:`KVContext.recorded`)
instead of appending again, so recomputation reproduces the same tensors and
never touches the context's state.
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
    """One (microbatch, subsequence) unit as a stage runs it.

    Attributes:
        microbatch: index m of the microbatch in the step.
        index: index j of the subsequence within the microbatch.
        offset: position of the unit's first token in the full sequence.
        length: number of tokens in the unit.
        num_subsequences: k, the number of units the microbatch is cut into.
    """

    microbatch: int
    index: int
    offset: int
    length: int
    num_subsequences: int

    @property
    def is_last(self) -> bool:
        return self.index == self.num_subsequences - 1


class KVGrads:
    """dL/dK and dL/dV that later units send one unit's block, until the unit's backward."""

    __slots__ = ("k", "v", "_like")

    def __init__(self, like: torch.Tensor) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self._like = like  # a tensor shaped as the unit's K (and V), to start from zeros

    def add(self, grad_k: torch.Tensor, grad_v: torch.Tensor, where: tuple[slice, ...] = ()) -> None:
        """Add the gradient of the whole block, or of the part ``where`` (an index of K)."""
        if where:
            if self.k is None:
                self.k, self.v = torch.zeros_like(self._like), torch.zeros_like(self._like)
            self.k[where] += grad_k
            self.v[where] += grad_v
        elif self.k is None:
            self.k, self.v = grad_k, grad_v
        else:
            self.k = self.k + grad_k
            self.v = self.v + grad_v

    def take(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Hand over (and forget) everything later units sent; ``(None, None)`` if nothing."""
        grads = self.k, self.v
        self.k = self.v = None
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
        self.k = k.detach()
        self.v = v.detach()
        self.offset = offset
        self.grads = grads or KVGrads(self.k)
        self.start = start

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
        k, v = self.k[:, :, cut:].clone(), self.v[:, :, cut:].clone()
        return KVBlock(k, v, first, self.grads, self.start + cut)


class KVContext:
    """Per-stage K/V state of the microbatches in flight.

    One context belongs to one pipeline stage (model chunk); the stage binds it
    to the chunk's attention layers and announces each unit with
    :meth:`running`. Outside :meth:`running` the layers compute plain
    full-sequence causal attention.
    """

    def __init__(self, copy_tails: bool = False) -> None:
        self.copy_tails = copy_tails
        """Cut blocks to the tail later units read, copied (see the module docstring)."""
        self._unit: Unit | None = None
        self._backward_unit: Unit | None = None
        self.documents: list[Documents] | None = None
        """Per microbatch, its packed documents (block-causal attention); None: causal."""
        # microbatch -> layer id -> blocks of units 0..j-1, in order; None for a
        # block no later unit reads
        self._blocks: dict[int, dict[int, list[KVBlock | None]]] = {}
        # (microbatch, subsequence) -> layer id -> (prefix read, own side buffers) of its
        # forward, kept until the unit's backward is over, for recomputation
        self._records: dict[tuple[int, int], dict[int, tuple[list[KVBlock], KVGrads]]] = {}

    @property
    def unit(self) -> Unit | None:
        """The unit being run forward, or None outside a unit."""
        return self._unit

    @property
    def in_backward(self) -> bool:
        """Whether a unit's backward pass is running."""
        return self._backward_unit is not None

    @property
    def active_unit(self) -> Unit | None:
        """The unit whose forward, recomputation or backward is running."""
        return self._unit or self._backward_unit

    def documents_of(self, unit: Unit) -> Documents | None:
        """The packed documents of ``unit``'s microbatch; None under causal attention."""
        return None if self.documents is None else self.documents[unit.microbatch]

    @property
    def recomputing(self) -> bool:
        """Whether a forward now is a recomputation inside a unit's backward."""
        return self._unit is None and self._backward_unit is not None

    @contextlib.contextmanager
    def running(self, unit: Unit) -> Iterator[None]:
        """Run the forward of ``unit`` inside this context."""
        if self._unit is not None:
            raise RuntimeError(f"KVContext: {unit} started while {self._unit} is running")
        self._unit = unit
        try:
            yield
        finally:
            self._unit = None
            if unit.is_last:
                # The unit graphs keep what backward needs; the context lets go.
                self._blocks.pop(unit.microbatch, None)

    @contextlib.contextmanager
    def backward(self, unit: Unit, last_pass: bool = True) -> Iterator[None]:
        """Run a backward pass of ``unit``; ``last_pass``: the unit's backward ends with it."""
        self._backward_unit = unit
        try:
            yield
        finally:
            self._backward_unit = None
            if last_pass:
                self._records.pop((unit.microbatch, unit.index), None)

    def recorded(self, layer_id: int) -> tuple[list[KVBlock], KVGrads]:
        """The prefix that ``layer_id`` read in the forward of the unit in backward, and the
        side buffers of the unit's own block."""
        unit = self._backward_unit
        try:
            return self._records[(unit.microbatch, unit.index)][layer_id]
        except (KeyError, TypeError):
            raise RuntimeError(
                f"layer {layer_id} recomputed outside the backward of a unit it ran forward"
            ) from None

    def append(
        self, layer_id: int, k: torch.Tensor, v: torch.Tensor, copied: bool = False
    ) -> tuple[list[KVBlock], KVGrads]:
        """Record the current unit's K/V for ``layer_id``; ``copied``: k and v are the
        context's own copies (no one else keeps them), so cut blocks are copied too.

        Returns the blocks of the earlier units that the unit reads (with packed
        documents, those holding keys of the document that continues into it) and
        the side buffers of the current unit's new block.
        """
        unit = self._unit
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
            elif b is not None and b.offset < first and (copied or self.copy_tails):
                blocks[i] = b.tail(first)
        prefix = [b for b in blocks if b is not None]
        block = KVBlock(k, v, unit.offset)
        if not unit.is_last:
            blocks.append(block)
        self._records.setdefault((unit.microbatch, unit.index), {})[layer_id] = (prefix, block.grads)
        return prefix, block.grads

    def clear(self) -> None:
        """Forget every microbatch (end of step)."""
        self._unit = self._backward_unit = None
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
