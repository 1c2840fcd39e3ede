"""The KV context: each layer's K/V threaded across the subsequences of a microbatch.

A pipeline stage runs a microbatch as k units (subsequences) in order; unit j attends to its
own K/V and to those of units 0..j-1 of its microbatch on the stage. The context keeps, per
microbatch and layer, one :class:`KVSlab`: K and V of the microbatch's keys that later units
read, each unit's written at its offset as it runs forward (one copy of the unit's own K/V,
never of the prefix), so a unit reads its whole prefix, or prefix and own keys together, as
one view. The last unit's keys are read by no later unit: it writes them only under context
parallelism (``with_own``), where other ranks' queries read them as their prefix.

Context parallelism (:attr:`KVContext.shard`, :mod:`torchtitan_seq.runtime.context_parallel`): a CP rank
computes a share of each unit's queries (:attr:`Unit.queries`) and writes the unit's whole K/V,
gathered over the CP group, so the slab holds the same positions as without CP.

Gradients flow backwards through the slab without joining the units' autograd graphs
(joining them would let the backward of unit j walk into, and free, the graph of unit j-1):
the slab holds K/V *detached*; a later unit's attention backward adds dL/dK and dL/dV of the
prefix it read into the slab's gradient slab (the first sender's own gradient where it covers
every position later units read, else zeros allocated once per microbatch and layer; added to in
place); a unit's own attention backward adds the part at its own positions to the
gradient of its own K/V, once. This is exact when, per microbatch and stage, backwards run
last unit first (``torchtitan_seq.schedules.ordering``), for full and split input/weight backward
alike: the gradient slab is filled and read inside the attention's own backward, in the
input-gradient pass.

Lifetime: a microbatch's slabs live from its first unit's forward until the last of its
units' backwards has ended on the stage (its first unit's, in the order that is exact); the
attention of a unit whose K/V are in the slab saves views of the slab for its backward (not
K/V of its own), so the slab is the one copy of K/V, counted once by
:class:`~torchtitan_seq.instrumentation.memory.ActivationMemory`.
A slab lies in an *arena*, placed whole by the first unit: told the order of its stage's passes
(:meth:`KVContext.expect`), the context shares each arena between a microbatch in backward, which
frees positions from its slab's end, and the next in forward, which fills its own from the
start, the two growing toward each other (:mod:`torchtitan_seq.runtime.kv_placement`), so the arenas hold
about the K/V of the units in flight rather than room for whole microbatches; a write into
positions the other microbatch still reads is refused. :meth:`KVContext.clear` ends a step.

Packed documents (:attr:`KVContext.documents`): a unit reads only the keys of the document
continuing into it (one range of positions, one view in either order); the K/V of documents
that ended stay in the slab until it goes.

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

from torchtitan_seq.runtime.context_parallel import ContextShard
from torchtitan_seq.runtime.documents import Documents
from torchtitan_seq.runtime.kv_placement import ArenaPlan, Pass, SlabPlacement, plan_arenas

__all__ = ["Unit", "Phase", "KVSlab", "KVContext"]


@dataclass(frozen=True)
class Unit:
    """One (microbatch, subsequence) unit as a stage runs it."""

    microbatch: int  # m, the microbatch's index in the step
    index: int  # j, the subsequence's index within the microbatch
    offset: int  # position of the unit's first token in the full sequence
    length: int  # tokens in the unit
    num_subsequences: int  # k, the units the microbatch is cut into
    queries: tuple[tuple[int, int], ...] | None = None
    """Positions [start, stop) of the unit's queries this rank computes, in the order its tensors lay them
    out: a CP rank's share (:meth:`~torchtitan_seq.runtime.context_parallel.ContextShard.segments`); None: all."""

    @property
    def is_last(self) -> bool:
        return self.index == self.num_subsequences - 1

    @property
    def segments(self) -> tuple[tuple[int, int], ...]:
        """The positions of this rank's queries, [start, stop) ranges in their tensors' order."""
        return self.queries or ((self.offset, self.offset + self.length),)


class Phase(enum.Enum):
    """What an attention call does for the unit the stage runs (:meth:`KVContext.phase`)."""

    FORWARD = "forward"  # the unit's forward: writes its K/V into the slab, reads the prefix
    RECOMPUTE = "recompute"  # its forward again inside its backward (activation checkpointing): reads, writes nothing
    BACKWARD = "backward"  # the unit's backward: reads the slab, sends the prefix's dK/dV to the gradient slab


EVERY = slice(None)
"""Every batch row (an index of dim 0)."""


def _new_keys(like: torch.Tensor, n: int, zeros: bool = False) -> torch.Tensor:
    """Room for K/V (or their gradient) of ``n`` positions shaped like ``like`` (B, H, _, D), laid out as
    (B, n, H, D) in memory, as a model's projections lay out K/V and torch's kernels their gradients:
    a unit's K/V are then copied into the slab as they lie, and a kernel's dK/dV of slab keys come
    back laid out as the model takes them (cuDNN's follow the keys' layout: a copy each, else)."""
    b, h, _, d = like.shape
    return (like.new_zeros if zeros else like.new_empty)(b, n, h, d).transpose(1, 2)


def _whole(t: torch.Tensor) -> bool:
    """Whether ``t`` spans its storage (a kernel's output, not a part of one)."""
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


Stored = tuple[torch.Tensor, torch.Tensor, bool]
"""Views of a slab where a unit's K/V (B, Hkv, L, D) lie, and whether they run last position first: what
the unit's attention saves for its backward (:func:`_saved`)."""


def _saved(slab: KVSlab, k: torch.Tensor, v: torch.Tensor) -> Stored:
    """Views ``k``, ``v`` of ``slab`` as a unit's attention saves them, and whether they run last position
    first: aliases with a version counter of their own, since later units (and other microbatches in
    the arena) write other positions, which autograd would otherwise take for a change of what the unit
    saved."""
    return k.data, v.data, slab.descending


class _DescendingRows:
    """The rows of a descending slab of ``size`` positions (position p at row size - 1 - p), an int64
    (size,) index on the slab's device, and views of it by position range, kept: the same few units
    run every step, and a view costs the host a few µs."""

    __slots__ = ("rows", "_views")

    def __init__(self, size: int, device: torch.device) -> None:
        self.rows = torch.arange(size - 1, -1, -1, device=device)
        self._views: dict[tuple[int, int], torch.Tensor] = {}

    def of(self, start: int, n: int) -> torch.Tensor:
        """The rows of positions [start, start + n): size - 1 - start, ..., size - start - n."""
        view = self._views.get((start, n))
        if view is None:
            view = self._views[start, n] = self.rows.narrow(0, start, n)
        return view


class KVSlab:
    """K/V of one microbatch in one layer, and the gradient later units send earlier positions.

    ``k`` and ``v``: (batch, kv_heads, size, head_dim) views of a range of an arena
    (:mod:`torchtitan_seq.runtime.kv_placement`), laid out (batch, size, kv_heads, head_dim) in memory
    (:func:`_new_keys`), positions [0, ``filled``) written so far (units 0..j in order). Ascending,
    position p lies at p; ``descending``, at size - 1 - p, so that the slab fills from the range's
    end: any positions [a, b) are still one range, last position first.
    ``grad_k`` and ``grad_v``: dL/dK and dL/dV of the positions later units read, laid out alike,
    sent by their backward; None until the first is sent.
    """

    __slots__ = ("k", "v", "descending", "filled", "grad_k", "grad_v", "_views", "_rows")

    def __init__(self, k: torch.Tensor, v: torch.Tensor, rows: _DescendingRows | None = None) -> None:
        self.k, self.v = k, v
        self.descending = rows is not None
        self._rows = rows  # descending: each position's row, for indexed copies and adds
        self.filled = 0
        self.grad_k: torch.Tensor | None = None
        self.grad_v: torch.Tensor | None = None
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (start, stop) -> K, V

    def _pair(
        self, k: torch.Tensor, v: torch.Tensor, start: int, stop: int, rows: slice = EVERY
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``k``, ``v`` (the slab's keys, or their gradients: (B, H, _, D)) at positions [start, stop) of batch
        rows ``rows``, views where the slab lays those positions out. One call for the pair, and ``narrow``
        for all rows, where an index is parsed first: each call and view costs the host a µs or more, a
        few times per unit and layer."""
        if self.descending:
            size = self.k.shape[2]
            start, stop = size - stop, size - start
        if rows == EVERY:
            return k.narrow(2, start, stop - start), v.narrow(2, start, stop - start)
        return k[rows, :, start:stop], v[rows, :, start:stop]

    def write(self, offset: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write K/V (B, Hkv, L, D) of positions [offset, offset + L); returns the views written, as
        :meth:`keys` gives them."""
        stop = offset + k.shape[2]
        if stop > self.k.shape[2]:  # a context told no lengths grows the slab (copies the prefix)
            grown = [_new_keys(t, stop) for t in (self.k, self.v)]
            grown[0][:, :, : self.filled], grown[1][:, :, : self.filled] = self.keys(0, self.filled)
            self.k, self.v = grown
            self._views.clear()
        into_k, into_v = self._pair(self.k, self.v, offset, stop)
        # Read, not differentiated through: the slab holds K/V detached. Inside the attention's forward
        # grad mode is off and the copy records nothing; an alias through .data would cost a tensor each.
        if torch.is_grad_enabled():
            k, v = k.data, v.data
        if self.descending:  # one indexed copy each: a flipped copy would be a kernel and a tensor more
            rows = self._rows.of(offset, stop - offset)
            self.k.index_copy_(2, rows, k)
            self.v.index_copy_(2, rows, v)
        else:
            into_k.copy_(k)
            into_v.copy_(v)
        self.filled = stop
        return into_k, into_v

    def holds(self, stop: int) -> bool:
        """Whether the slab holds the keys before position ``stop``."""
        return self.filled >= stop

    def keys(self, start: int, stop: int, rows: slice = EVERY) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [start, stop) of batch rows ``rows``, views as the slab lays them out
        (a descending slab's last position first: right for an unmasked kernel call). Those of every row
        are kept: a unit reads its prefix forward and again backward (a view costs the host ~2 µs)."""
        if rows != EVERY:
            return self._pair(self.k, self.v, start, stop, rows)
        views = self._views.get((start, stop))
        if views is None:
            views = self._views[start, stop] = self._pair(self.k, self.v, start, stop)
        return views

    def accumulate(self, grad_k: torch.Tensor, grad_v: torch.Tensor, rows: slice, start: int) -> None:
        """Add the gradient a later unit's attention sends the keys [start, start + n) of batch
        rows ``rows`` (grad_k, grad_v: (rows, Hkv, n, D), laid out as :meth:`keys` gave them), in place."""
        if self.grad_k is None:  # once per microbatch and layer: every position a later unit reads
            readable = self.k.shape[2] if self.descending else self.filled
            covers = start == 0 and grad_k.shape[2] == readable and grad_k.shape[0] == self.k.shape[0]
            if covers and _whole(grad_k) and _whole(grad_v):
                # The first sender (the last unit, whose prefix is every readable position) covers the
                # whole gradient slab: a kernel's fresh output, nothing else in its storage, which
                # becomes the gradient slab itself (no zeros, no add).
                self.grad_k, self.grad_v = grad_k, grad_v
                return
            self.grad_k, self.grad_v = (_new_keys(t, readable, zeros=True) for t in (self.k, self.v))
        into_k, into_v = self._pair(self.grad_k, self.grad_v, start, start + grad_k.shape[2], rows)
        into_k.add_(grad_k)  # into the view: ``+=`` on an index copies the sum back
        into_v.add_(grad_v)

    def add_sent(self, dk: torch.Tensor, dv: torch.Tensor, offset: int) -> None:
        """Add what later units sent positions [offset, offset + L) to ``dk``, ``dv`` (B, Hkv, L, D, in
        position order: the unit's own gradients), in place; from a descending slab by an indexed add
        (its positions run the other way), not a flipped copy and an add."""
        readable = self.grad_k.shape[2] if self.grad_k is not None else 0
        n = min(readable - offset, dk.shape[2])
        if n <= 0:
            return
        grad_k, grad_v = self._pair(self.grad_k, self.grad_v, offset, offset + n)
        if n < dk.shape[2]:
            dk, dv = dk.narrow(2, 0, n), dv.narrow(2, 0, n)
        if self.descending:
            # n - 1, ..., 0 (the rows of the last n positions): where each sent row's position lies in dk
            rows = self._rows.of(self.k.shape[2] - n, n)
            dk.index_add_(2, rows, grad_k)
            dv.index_add_(2, rows, grad_v)
        else:
            dk.add_(grad_k)
            dv.add_(grad_v)


class KVContext:
    """Per-stage K/V state of the microbatches in flight. The stage (model chunk) binds it to
    the chunk's attention layers and announces each unit it runs, forward (:meth:`running`) or
    backward (:meth:`backward`); outside a unit the layers compute plain full-sequence causal
    attention. ``lengths``: the units' lengths [L_0, ..., L_{k-1}] of every microbatch, which size
    the slabs; without them a slab grows, a copy of its prefix, as units reach past its end. Told
    the order of the stage's passes (:meth:`expect`), the context places the slabs in arenas
    shared by microbatches (:func:`~torchtitan_seq.runtime.kv_placement.plan_arenas`); otherwise each
    microbatch's slab is an arena of its own."""

    def __init__(self, lengths: list[int] | None = None, shard: ContextShard | None = None) -> None:
        self.lengths = lengths
        self.shard = shard or ContextShard()
        """This rank's share of every unit under context parallelism (the whole unit without)."""
        self.unit: Unit | None = None
        """The unit being run, forward (:meth:`running`) or backward (:meth:`backward`), or None."""
        self.documents: list[Documents] | None = None
        """Per microbatch, its packed documents (block-causal attention); None: causal."""
        self.per_unit: dict[object, object] = {}
        """What the attention layers derive from the running unit once for all of them (their kernel calls),
        dropped when the unit ends."""
        self._backward = False  # whether ``unit`` runs backward
        self._slabs: dict[int, dict[int, KVSlab]] = {}  # microbatch -> layer id -> slab
        self._backwards: dict[int, int] = {}  # microbatch -> units whose backward has ended
        self._live: dict[int, set[int]] = {}  # microbatch -> units run forward whose backward has not ended
        self._passes: list[Pass] | None = None
        self.action_plan: ArenaPlan | None = None  # the placement of every microbatch
        self._placed: dict[int, tuple[int, SlabPlacement]] = {}  # microbatch -> (arena capacity, placement)
        self._arenas: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (layer id, arena) -> K, V
        self._rows: dict[tuple[int, torch.device], _DescendingRows] = {}  # kept across steps

    def expect(self, passes: list[Pass]) -> None:
        """The order in which the stage runs its units' passes each step (see
        :data:`~torchtitan_seq.runtime.kv_placement.Pass`); the arenas are planned from it."""
        self._passes = list(passes)
        self.action_plan = None

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
            self.per_unit.clear()

    def running(self, unit: Unit) -> contextlib.AbstractContextManager[None]:
        """Run the forward of ``unit`` inside this context (phase FORWARD)."""
        self._live.setdefault(unit.microbatch, set()).add(unit.index)  # once per unit, not per layer
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
                    self._end(unit)

    def _end(self, unit: Unit) -> None:
        """The backward of ``unit`` has ended: its positions are free, and with the microbatch's last
        backward on the stage its slabs go (and their arena, when it holds no other slab in use)."""
        m = unit.microbatch
        self._live.get(m, set()).discard(unit.index)
        done = self._backwards[m] = self._backwards.get(m, 0) + 1
        if done < unit.num_subsequences:
            return
        self._slabs.pop(m, None)
        del self._backwards[m]
        self._live.pop(m, None)
        placed = self._placed.pop(m, None)
        if placed is not None and all(other.arena != placed[1].arena for _, other in self._placed.values()):
            for key in [key for key in self._arenas if key[1] == placed[1].arena]:  # no slab in it is in use
                del self._arenas[key]

    def recorded(self, layer_id: int) -> KVSlab:
        """The slab that ``layer_id`` wrote in the forward of the unit in backward (phases RECOMPUTE
        and BACKWARD)."""
        unit = self.unit if self._backward else None
        slab = self._slabs.get(unit.microbatch, {}).get(layer_id) if unit is not None else None
        if slab is None or not slab.holds(unit.offset):
            raise RuntimeError(f"layer {layer_id} recomputed outside the backward of a unit it ran forward")
        return slab

    def own(self, layer_id: int) -> Stored | None:
        """Views of ``layer_id``'s slab at the positions of the unit running forward (or
        recomputed), where its K/V lie, and whether they run last position first (a descending
        slab); None outside a unit or where the slab holds none of them."""
        unit = self.unit
        slab = self._slabs[unit.microbatch][layer_id] if unit is not None else None
        if slab is None or not slab.holds(unit.offset + unit.length):
            return None
        return _saved(slab, *slab.keys(unit.offset, unit.offset + unit.length))

    def append(
        self, layer_id: int, k: torch.Tensor, v: torch.Tensor, with_own: bool = False
    ) -> tuple[KVSlab, Stored | None]:
        """Write the current unit's K/V (B, Hkv, L, D) for ``layer_id`` into its microbatch's slab,
        unless the unit is the last and not ``with_own`` (no later unit reads its keys, and its
        kernel reads them apart from the prefix; under CP other ranks' queries read them as their
        prefix). The first unit places the slab: room for the keys later units read, the last unit's
        too if ``with_own``. Returns the slab, and the unit's K/V in it as :meth:`own` gives them
        (None: not written)."""
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
            slab = layers[layer_id] = self._place(layer_id, unit.microbatch, k, with_own)
        if not unit.is_last or with_own:
            self._check_room(unit, slab)
            return slab, _saved(slab, *slab.write(unit.offset, k, v))
        return slab, None

    def _place(self, layer_id: int, m: int, k: torch.Tensor, with_own: bool) -> KVSlab:
        """Microbatch ``m``'s slab for ``layer_id``, in the arena its plan names (allocated by its
        first slab), or in one of its own."""
        if self.lengths is None:  # nothing to plan with: a slab of its own that grows
            return KVSlab(_new_keys(k, 0), _new_keys(k, 0))
        size = sum(self.lengths[: None if with_own else -1])
        if m not in self._placed:
            if self.action_plan is None:
                self.action_plan = plan_arenas(self._passes or [], self.lengths, size)
            plan = self.action_plan
            solo = (size, SlabPlacement(-1 - m, descending=False))
            self._placed[m] = (plan.capacity, plan.slabs[m]) if m in plan.slabs else solo
        capacity, placed = self._placed[m]
        key = (layer_id, placed.arena)
        if key not in self._arenas:
            self._arenas[key] = (_new_keys(k, capacity), _new_keys(k, capacity))
        region = slice(capacity - size, capacity) if placed.descending else slice(0, size)
        arena_k, arena_v = self._arenas[key]
        rows = self._descending_rows(size, k.device) if placed.descending else None
        return KVSlab(arena_k[:, :, region], arena_v[:, :, region], rows)

    def _descending_rows(self, size: int, device: torch.device) -> _DescendingRows:
        """A descending slab's rows, made once per size."""
        rows = self._rows.get((size, device))
        if rows is None:
            rows = self._rows[size, device] = _DescendingRows(size, device)
        return rows

    def _check_room(self, unit: Unit, slab: KVSlab) -> None:
        """Refuse a write into positions of the arena that another microbatch in it still uses, at its
        other end or at the same one (the stage ran its units in an order other than the one it announced)."""
        capacity, placed = self._placed.get(unit.microbatch, (0, None))
        if placed is None or placed.arena < 0:
            return
        for m, (_, other) in self._placed.items():
            if m == unit.microbatch or other.arena != placed.arena:
                continue
            live = self._live.get(m)
            theirs = min(sum(self.lengths[: max(live) + 1]), slab.k.shape[2]) if live else 0
            # The same end lays positions on the same cells; the other end, position p on the cell of
            # capacity - 1 - p.
            same_end = other.descending == placed.descending
            if unit.offset < theirs if same_end else unit.offset + unit.length + theirs > capacity:
                raise RuntimeError(
                    f"K/V arena {placed.arena}: subsequence {unit.index} of microbatch {unit.microbatch} would "
                    f"overwrite keys microbatch {m} still reads; the stage ran its units in an order other "
                    "than the one given to KVContext.expect"
                )

    def clear(self) -> None:
        """Forget every microbatch (end of step)."""
        self.unit, self._backward = None, False
        self.per_unit.clear()
        self._slabs.clear()
        self._backwards.clear()
        self._live.clear()
        self._placed.clear()
        self._arenas.clear()

    def held_storages(self) -> dict[int, int]:
        """The storages of the K/V the context keeps alive (its arenas and slabs): data_ptr -> bytes."""
        slabs = [t for layers in self._slabs.values() for s in layers.values() for t in (s.k, s.v)]
        arenas = [t for pair in self._arenas.values() for t in pair]
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in slabs + arenas}

    def held_bytes(self) -> int:
        """Bytes of K/V the context keeps alive, each storage once."""
        return sum(self.held_storages().values())

    def __len__(self) -> int:
        """Number of microbatches whose K/V the context still holds."""
        return len(self._slabs)
