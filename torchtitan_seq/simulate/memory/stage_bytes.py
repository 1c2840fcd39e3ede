"""What a stage's units and microbatches weigh: the units' saved activations, the KV context's slabs and
their gradients, under context parallelism too (notation: the package's docstring).

**KV context** (:mod:`torchtitan_seq.runtime.kv_context`): per stage, microbatch and layer of full
attention one K/V slab of the keys later units read, S - L_{k-1} tokens at 2 Hkv hd a / t bytes each
(MLA: H x (192 + 128) in the 671B; whatever the kernel: the last unit keeps its own K/V), in arenas the
context plans from the stage's pass order as the runtime does
(:func:`~torchtitan_seq.runtime.kv_placement.plan_arenas`: a microbatch in backward and the next in
forward share one arena from its two ends), each allocated by a write into it while it holds no
slab in use and let go at the end of the last backward (B, or W where backward is split) of a
slab in it:

* without checkpointing the units' attention saves views of the arenas, so they are among the
  saved activations (the own K/V of units 0..k-2 then are not: their per-unit bytes
  (:mod:`.activations`) less 2 Hkv hd a / t a layer);
* under checkpointing (``full``, op-level ``selective``, and the checkpointed 1/n of
  layer-level ``selective``) the context alone keeps it;
* in every mode, the slab's gradient (:meth:`~torchtitan_seq.runtime.kv_slab.KVSlab.accumulate`):
  the keys before the last unit, S - L_{k-1} tokens, from the microbatch's first backward
  (its input-gradient pass) to the slab's end.

**Layers of bounded reach** (a sliding window, attention chunks; :mod:`.reach`) under ``kv_context =
"reach"`` and without CP: the slab holds only the positions later units read, R tokens
(:func:`~.reach.reach_positions`: fewer than k x window). Its units' attention saves their own K/V
(2 Hkv hd a / t a token and layer of units 0..k-2 back in their per-unit bytes, where the layer is not
recomputed). Where the layer is not recomputed the slab is views of those saved K/V and adds nothing;
where it is, a copy of R tokens that the context alone keeps, in arenas of their own planned as the
runtime plans them (from the rows each unit keeps in use, :attr:`~torchtitan_seq.runtime.kv_reach.ReachRows.extents`;
under torch.compile the copy is made in every mode, which this model does not see). Its gradient holds R
tokens. Under ``"full"``
such a layer keeps the whole slab as a layer of full attention does.

**MLA's latent** (``kv_context = "latent"``, :mod:`torchtitan_seq.runtime.kv_latent`): an MLA model's layers
keep, outside the arenas, the latent and RoPE key of the keys later units read, S - L_{k-1} tokens at
(kv_lora_rank + qk_rope_head_dim) a bytes each, from the microbatch's first forward to its last backward
(the context alone keeps it, as a bounded layer's slab), and a gradient alike; their units' attention saves
their own K/V (back in their per-unit bytes).

**Context parallelism** (the shape's ``cp`` = c, :mod:`torchtitan_seq.runtime.context_parallel`): a rank
computes 1/c of every unit's tokens, so every per-token figure (activations, workspace, receive
buffers) counts b L_j / c tokens, but its slab holds the whole sequence's K/V, S tokens (the last
unit's too: other CP ranks' queries read it as their prefix), as does the slab's gradient; the
units' attention saves views of it for their own K/V, the last unit's included; every layer keeps
the whole slab. FSDP shards over ``dp_shard`` x c ranks.

``kv_context`` is what these add to the peak: the largest activations + context over the
rank's actions, less the activation peak (so activations + kv_context is that sum's peak).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from torchtitan_seq.runtime.model_counts import kv_values, rope_width
from torchtitan_seq.simulate.memory.activations import recomputed_fraction, saved_per_token
from torchtitan_seq.simulate.memory.config import MemoryConfig
from torchtitan_seq.simulate.memory.reach import bounded_layers, reach_positions

if TYPE_CHECKING:  # torchtitan is imported where a flavor is looked up, not with this module
    from torchtitan.models.llama3 import TransformerModelArgs


class StageBytes(NamedTuple):
    """What a stage's units and microbatches weigh (bytes)."""

    saved: list[float]
    """Per unit j, saved activations from the unit's forward to its backward, the slab apart."""
    slab: float = 0.0
    """A microbatch's K/V slab where autograd saves it (layers not recomputed)."""
    held: float = 0.0
    """A microbatch's K/V slab where the context alone keeps it (recomputed layers)."""
    grad: float = 0.0
    """A microbatch's slab gradient."""
    constant: float = 0.0
    """Saved once while any unit of the stage is (the RoPE table)."""
    latents: float = 0.0
    """A microbatch's latents (MLA layers under ``kv_context = "latent"``; the context alone keeps them), from
    its first forward to its last backward."""
    reach_held: float = 0.0
    """A microbatch's copied slabs of the layers that keep only their reach (where recomputed), in arenas of
    their own."""


def slab_tokens(tokens: list[int], cp: int) -> int:
    """Tokens of a microbatch's K/V slab on one layer of full attention (or of any layer under ``kv_context =
    "full"`` or CP): the keys later units read (under CP, other CP ranks' queries: the last unit's too)."""
    return sum(tokens) - (tokens[-1] if cp == 1 else 0)


def bytes_of_stage(
    args: TransformerModelArgs,
    c: MemoryConfig,
    a: int,
    chunk: tuple[float, bool, bool],
    tokens: list[int],
    is_sequence: bool,
    bounded: float = 0.0,
) -> StageBytes:
    """What units of ``tokens`` tokens weigh on a stage running ``chunk``, ``bounded`` of whose layers have a
    bounded reach (under CP a rank computes 1/c of each unit's tokens and its slab holds the whole
    sequence's K/V, the last unit's too)."""
    layers, first, last = chunk
    per_token = saved_per_token(args, c, a, layers, first, last, is_sequence)
    recomputed = recomputed_fraction(c)
    # The whole RoPE table (complex64, seq_len x hd / 2) is saved once per stage where layers
    # get it whole: torch's schedules slice it, checkpointed blocks take it as an input.
    table = 4 * c.seq_len * rope_width(args) if layers and (not is_sequence or recomputed) else 0
    if not is_sequence:  # torch's schedules: K/V are the unit's own, no context
        return StageBytes([n * per_token for n in tokens], constant=table)
    per_layer = kv_values(args) / c.tp * a  # K and V, a token and layer
    reaching = bounded if c.kv_context != "full" and c.cp == 1 else 0.0  # layers whose slab holds their reach
    mla = getattr(args, "mla", None)
    latent = layers - reaching if c.kv_context == "latent" and mla is not None else 0.0  # layers keeping latents
    kv = per_layer * (layers - reaching - latent)  # K and V, a token, of the layers whose slab holds every key
    slab = slab_tokens(tokens, c.cp) * kv
    held = reach_positions(tuple(c.shape.lengths), args.reach) * c.microbatch_size if reaching else 0
    rows = held * per_layer * reaching  # the bounded layers' slab rows: their gradient's
    kept = slab_tokens(tokens, c.cp) * (mla.kv_lora_rank + mla.qk_rope_head_dim) * a * latent if latent else 0.0
    saved_kv = kv * (1 - recomputed)  # in the per-token bytes: where the slab holds them, its views
    own = [n / c.cp * (per_token - saved_kv) for n in tokens]  # K/V in the slab: units 0..k-2, all under CP
    return StageBytes(
        own[:-1] + [tokens[-1] * per_token if c.cp == 1 else own[-1]],
        slab * (1 - recomputed),
        slab * recomputed,
        slab + rows + kept,
        table,
        kept,
        rows * recomputed,  # copied where the layer is recomputed, else views of saved K/V
    )


def chain_bytes(
    args: TransformerModelArgs, c: MemoryConfig, a: int, chunks: tuple, tokens: list[int], is_sequence: bool
) -> list[StageBytes]:
    """:func:`bytes_of_stage` of each chunk of a chain, in order, each alike chunk weighed once.

    Args:
        args: the model's arguments or shape.
        c: the job.
        a: bytes of the compute dtype.
        chunks: the chain's chunks (:func:`~.chunks.memory_chunk_split`).
        tokens: b L_j, tokens of each unit of a microbatch.
        is_sequence: whether a sequence schedule runs them (a KV context threads the units).

    Returns:
        Per chunk, what its stage's units and microbatches weigh.
    """
    kinds = list(zip(chunks, bounded_layers(args, chunks)))
    weighed = {
        (chunk, bounded): bytes_of_stage(args, c, a, chunk, tokens, is_sequence, bounded)
        for chunk, bounded in set(kinds)
    }
    return [weighed[kind] for kind in kinds]
