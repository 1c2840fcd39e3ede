"""The KV context: each layer's K/V threaded across the subsequences of a microbatch.

A pipeline stage runs a microbatch as k units (subsequences) in order; unit j attends to its
own K/V and to those of units 0..j-1 of its microbatch on the stage. The context keeps, per
microbatch and layer, one :class:`~torchtitan_seq.runtime.kv_slab.KVSlab`: K and V of the microbatch's
keys that later units read, each unit's written at its offset as it runs forward (one copy of the unit's own K/V,
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
start, the two growing toward each other (:mod:`torchtitan_seq.runtime.kv_arena`), so the arenas hold
about the K/V of the units in flight rather than room for whole microbatches; a write into
positions the other microbatch still reads is refused. :meth:`KVContext.clear` ends a step.

MLA's latent (``mode = "latent"``, :mod:`torchtitan_seq.runtime.kv_latent`): an MLA layer keeps each earlier
unit's compressed latent and RoPE key instead of its K/V (:attr:`KVContext.latents`), from which a unit
expands its prefix's keys and values itself; its slabs go with the microbatch's K/V slabs.

Offload (:attr:`KVContext.offload`, :mod:`torchtitan_seq.runtime.kv_offload`): an arena no pass of the stage
reads for a while goes to host memory and comes back before the pass that reads it, as each pass starts.

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
import dataclasses
import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from torchtitan_seq.runtime.context_parallel import ContextShard
from torchtitan_seq.runtime.documents import Documents
from torchtitan_seq.runtime.kv_arena import KVArenas
from torchtitan_seq.runtime.kv_latent import LatentSlabs
from torchtitan_seq.runtime.kv_offload import KVOffload
from torchtitan_seq.runtime.kv_placement import Pass
from torchtitan_seq.runtime.kv_reach import ReachSlab, ReachViews, reach_rows
from torchtitan_seq.runtime.kv_slab import KVSlab, Stored
from torchtitan_seq.runtime.reach import FULL, KVContextMode, Reach
from torchtitan_seq.runtime.torch_internals import top_saved_tensors_hooks

__all__ = ["Unit", "Phase", "UnitCalls", "KVContext"]


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


@dataclass(slots=True)
class UnitCalls:
    """What the attention layers derive from the running unit once for all of them, kept while it runs:
    its kernel calls (:func:`torchtitan_seq.attention.calls.kernel_calls`' (causal calls, prefix calls)),
    per kind of call: whether the unit reads its prefix and own keys in one causal call or in two, and
    the layer's reach (layers of a model may differ: windowed and full, chunked and global)."""

    calls: dict[tuple[bool, Reach], tuple] = dataclasses.field(default_factory=dict)

    def of(self, one_call: bool, reach: Reach) -> tuple | None:
        """The calls kept for that kind; None until the first layer to ask builds them."""
        return self.calls.get((one_call, reach))

    def keep(self, one_call: bool, reach: Reach, calls: tuple) -> tuple:
        """Keep ``calls`` as those for that kind; returns them."""
        self.calls[one_call, reach] = calls
        return calls

    def clear(self) -> None:
        """Drop them (the unit has ended)."""
        self.calls.clear()


class KVMeter(Protocol):
    """What samples the K/V a context holds (:class:`~torchtitan_seq.instrumentation.kv_memory.KVMemory`)."""

    def sample(self) -> None: ...


class KVContext:
    """Per-stage K/V state of the microbatches in flight. The stage (model chunk) binds it to
    the chunk's attention layers and announces each unit it runs, forward (:meth:`running`) or
    backward (:meth:`backward`); outside a unit the layers compute plain full-sequence causal
    attention. ``lengths``: the units' lengths [L_0, ..., L_{k-1}] of every microbatch, which size
    the slabs; without them a slab grows, a copy of its prefix, as units reach past its end. Told
    the order of the stage's passes (:meth:`expect`), the context places the slabs in arenas
    shared by microbatches (:func:`~torchtitan_seq.runtime.kv_placement.plan_arenas`); otherwise each
    microbatch's slab is an arena of its own."""

    def __init__(
        self, lengths: list[int] | None = None, shard: ContextShard | None = None, mode: KVContextMode = "reach"
    ) -> None:
        self.shard = shard or ContextShard()
        """This rank's share of every unit under context parallelism (the whole unit without)."""
        self.mode = mode
        """What a layer keeps (:data:`~torchtitan_seq.runtime.reach.KVContextMode`): under ``"reach"``, told
        the lengths and without CP, a layer of bounded reach a :class:`~.kv_reach.ReachSlab` (only what later
        units read); under ``"latent"`` an MLA layer its latent (:mod:`.kv_latent`); else a full slab."""
        self.unit: Unit | None = None
        """The unit being run, forward (:meth:`running`) or backward (:meth:`backward`), or None."""
        self.documents: list[Documents] | None = None
        """Per microbatch, its packed documents (block-causal attention); None: causal."""
        self.per_unit = UnitCalls()
        """What the attention layers derive from the running unit once for all of them (their kernel calls),
        dropped when the unit ends."""
        self._backward = False  # whether ``unit`` runs backward
        self._slabs: dict[int, dict[int, KVSlab]] = {}  # microbatch -> layer id -> slab
        self._backwards: dict[int, int] = {}  # microbatch -> units whose backward has ended
        self.arenas = KVArenas(lengths)
        """Where the microbatches' slabs lie, and the guard against overwriting keys in use."""
        self.latents = LatentSlabs(lengths)  # under mode "latent", the MLA layers' (:mod:`.kv_latent`)
        self.offload: KVOffload | None = None  # what takes the arenas to host memory and back, as passes start
        self.trains = True  # whether the units' backwards follow their forwards (False in eval: nothing is saved)
        self.meter: KVMeter | None = None
        """Sampled as each unit starts and as a microbatch's last backward ends, while set (a metered step)."""

    @property
    def lengths(self) -> list[int] | None:
        """The units' lengths [L_0, ..., L_{k-1}] of every microbatch (None: not told); set them to size
        the slabs of the units that follow."""
        return self.arenas.lengths

    @lengths.setter
    def lengths(self, lengths: list[int] | None) -> None:
        self.arenas.lengths = self.latents.lengths = lengths

    def expect(self, passes: list[Pass]) -> None:
        """The order in which the stage runs its units' passes each step (see
        :data:`~torchtitan_seq.runtime.kv_placement.Pass`); the arenas are planned from it."""
        self.arenas.expect(passes)

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
        if self.offload is not None:
            self.offload.before(not backward, unit.microbatch, unit.index)
        self.unit, self._backward = unit, backward
        try:
            yield
        finally:
            self.unit, self._backward = None, False
            self.per_unit.clear()

    def running(self, unit: Unit) -> contextlib.AbstractContextManager[None]:
        """Run the forward of ``unit`` inside this context (phase FORWARD)."""
        self.arenas.unit_started(unit.microbatch, unit.index)  # once per unit, not per layer
        if self.meter is not None:
            self.meter.sample()
        return self._running(unit, backward=False)

    @contextlib.contextmanager
    def backward(self, unit: Unit, last_pass: bool = True) -> Iterator[None]:
        """Run a backward pass of ``unit`` (phase BACKWARD, its recomputations RECOMPUTE);
        ``last_pass``: the unit's backward ends with it."""
        if self.meter is not None:
            self.meter.sample()
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
        self.arenas.unit_ended(m, unit.index)
        done = self._backwards[m] = self._backwards.get(m, 0) + 1
        if done < unit.num_subsequences:
            return
        if self.meter is not None:
            self.meter.sample()
        self._slabs.pop(m, None)
        self.latents.release(m)
        del self._backwards[m]
        self.arenas.release(m)

    def recorded(self, layer_id: int) -> KVSlab:
        """The slab that ``layer_id`` wrote in the forward of the unit in backward (phases RECOMPUTE
        and BACKWARD)."""
        unit = self.unit if self._backward else None
        slab = self._slabs.get(unit.microbatch, {}).get(layer_id) if unit is not None else None
        if slab is None or slab.filled < unit.offset:
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
        return slab.stored(*slab.keys(unit.offset, unit.offset + unit.length))

    def append(
        self, layer_id: int, k: torch.Tensor, v: torch.Tensor, with_own: bool = False, reach: Reach = FULL,
        saves_given: bool = False,
    ) -> tuple[KVSlab | ReachSlab, Stored | None]:  # fmt: skip
        """Write the current unit's K/V (B, Hkv, L, D) for ``layer_id`` into its microbatch's slab, unless the
        unit is the last and not ``with_own`` (no later unit reads its keys, and its kernel reads them apart
        from the prefix; under CP other ranks' queries read them as their prefix). The first unit places the
        slab: room for the keys later units read, the last unit's too if ``with_own``; for a layer of bounded
        ``reach`` under :attr:`mode` ``"reach"``, only the positions later units read: views of the units' K/V
        where their attention saves ``k``, ``v`` as given (``saves_given``, :attr:`trains`, no saved-tensor
        hook such as checkpointing's), else a copy (:mod:`~torchtitan_seq.runtime.kv_reach`). Returns the
        slab, and the unit's K/V in it as :meth:`own` gives them (None: not written whole)."""
        unit = self.unit
        if unit is None or self._backward:
            raise RuntimeError("KVContext.append called outside a unit's forward")
        layers = self._slabs.setdefault(unit.microbatch, {})
        slab = layers.get(layer_id)
        if (slab.filled if slab is not None else 0) != unit.offset or (slab is None) != (unit.index == 0):
            raise RuntimeError(
                f"layer {layer_id}: subsequence {unit.index} of microbatch {unit.microbatch} ran forward after "
                f"{slab.filled if slab is not None else 0} positions; forwards must run in subsequence order, each once"
            )
        if slab is None:
            slab = layers[layer_id] = self._place(layer_id, unit.microbatch, k, v, with_own, reach, saves_given)
        if isinstance(slab, ReachSlab):  # guarded by rows (views lie in no arena: never refused)
            self.arenas.check_room(unit.microbatch, unit.index, *slab.rows.of(unit.offset, unit.length), slab.rows)
            slab.write(unit.offset, k, v)
            return slab, None
        if not unit.is_last or with_own:
            self.arenas.check_room(unit.microbatch, unit.index, unit.offset, unit.length)
            return slab, slab.stored(*slab.write(unit.offset, k, v))
        return slab, None

    def _place(
        self, layer_id: int, m: int, k: torch.Tensor, v: torch.Tensor, with_own: bool, reach: Reach, saves_given: bool
    ) -> KVSlab | ReachSlab:
        """Microbatch ``m``'s slab for ``layer_id``: of its reach (see :meth:`append`), else in an arena."""
        if self.mode != "full" and reach.bounded and self.lengths is not None and not with_own:
            rows = reach_rows(tuple(self.lengths), reach)
            if saves_given and self.trains and top_saved_tensors_hooks(False) is None:
                return ReachViews(rows, k, v)
            return ReachSlab(rows, self.arenas.place(layer_id, m, k, v, False, rows))
        return self.arenas.place(layer_id, m, k, v, with_own)

    def clear(self) -> None:
        """Forget every microbatch (end of step)."""
        self.unit, self._backward = None, False
        self.per_unit.clear()
        self._slabs.clear()
        self.latents.clear()
        self._backwards.clear()
        self.arenas.clear()

    def held_storages(self) -> dict[int, int]:
        """The storages of the K/V the context keeps alive (its arenas and slabs): data_ptr -> bytes."""
        slabs = [t for layers in self._slabs.values() for s in layers.values() for t in (s.k, s.v)]
        arenas = self.arenas.tensors() + self.latents.tensors()
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in slabs + arenas}

    def __len__(self) -> int:
        """Number of microbatches whose K/V (or latents) the context still holds."""
        return len(self._slabs) + len(self.latents)
