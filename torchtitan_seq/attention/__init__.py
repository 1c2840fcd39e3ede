"""Chunk-aware causal attention for one unit of a subsequence pipeline, a module a concept: the
attention op and its autograd (:mod:`.unit_op`), the kernel calls it makes (:mod:`.calls`) and the
layouts of what it returns (:mod:`.layouts`), the whole-sequence document path (:mod:`.whole_sequence`),
binding a model's attention to a stage's KV context (:mod:`.binding`) and the handle by which the op
finds that binding (:mod:`.handles`). The block kernels it calls are in :mod:`torchtitan_seq.attention.kernels`.

A unit's queries cover positions [s, s+L) of the sequence; its keys are the
prefix [0, s) and its own [s, s+L), all in its microbatch's K/V slab (written by the
:class:`~torchtitan_seq.runtime.kv_context.KVContext`, the unit's own first), read as views.
A kernel that aligns causal masks at the bottom right (flash-attn's, torch's CUDA flash
kernel) reads slab[0 : s+L] in one causal call where the slab is ascending and holds the
unit's own keys; elsewhere, and with the kernels that align them top-left (torch's CPU and
cuDNN kernels), a unit makes two calls: the prefix unmasked and the square diagonal causally,
merged once by log-sum-exp. Backward makes the same calls with
the *merged* output and log-sum-exp, which is exact (the ring-attention identity): dq
once (one add of two calls), dK/dV of the prefix added in place into the slab's gradient,
which the earlier units' backward reads. The unit saves only views of the slab, q, its
output and the log-sum-exp: no concatenated K/V and no mask are ever built.

What a call does is the context's phase (:class:`~torchtitan_seq.runtime.kv_context.Phase`), which the
op asks for: FORWARD writes the unit's K/V into the slab and reads the prefix; RECOMPUTE (the
forward again inside the unit's backward, under activation checkpointing) reads the slab and
writes nothing; BACKWARD reads the slab and sends the prefix its dK/dV. Outside a unit a bound
layer attends causally over the sequence it is given.

Packed documents (block-causal attention, :mod:`torchtitan_seq.runtime.documents`) keep
this shape: per batch row, each piece of a document within the unit is a causal
diagonal block, and only the queries of the document that continues into the
unit read the prefix, from that document's first key on, in one call (or in the
piece's own call, bottom-right aligned). An unbound layer (no pipeline, torch's schedules)
attends over whole packed sequences with the same calls at offset 0
(``torchtitan_seq::whole_sequence_attention``), causal ones by torch's SDPA.

A bound layer's attention is the custom op ``torchtitan_seq::unit_attention`` with a
backward op of its own: torch.compile keeps it out of the compiled graph, so the KV
context (Python state) is read and changed when the op runs, never traced; under a dispatch
mode (selective checkpointing) it is one op. In eager mode the same functions run as an
autograd function (:class:`UnitAttention`), without the custom op's dispatch on the host, given the
layer's binding itself. To the custom op a layer names its context by a small host tensor, a graph
input, so one compiled graph serves every layer of a model; the op finds the binding by the tensor's
address, never reading the tensor.

Nothing on a unit's path reads a tensor on the host (``item``, ``tolist``, a tensor-valued ``if``):
handles, offsets and document starts are Python values, the starts read once per step by the
schedule (once per batch on the whole-sequence path,
:meth:`~torchtitan_seq.runtime.documents.Documents.of_batch`), so on a GPU the host never waits for the
device between units. Every add is in place and every merge writes into the kernel's own output.
"""

from __future__ import annotations

from torchtitan_seq.attention.binding import SequenceAttention, bind_kv_context
from torchtitan_seq.attention.unit_op import UnitAttention

__all__ = ["SequenceAttention", "UnitAttention", "bind_kv_context"]
