"""What a stage's units and microbatches weigh: the units' saved activations, the KV context's slab and its
gradient, under context parallelism too (notation: the package's docstring).

**KV context** (:mod:`torchtitan_seq.runtime.kv_context`): per stage, microbatch and layer one K/V
slab of the keys later units read, S - L_{k-1} tokens at 2 Hkv hd a / t bytes each (MLA: H x (192 +
128) in the 671B; whatever the kernel: the last unit keeps its own K/V; layers of bounded reach keep
the whole prefix too, :func:`slab_tokens`), in arenas the
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

**Context parallelism** (the shape's ``cp`` = c, :mod:`torchtitan_seq.runtime.context_parallel`): a rank
computes 1/c of every unit's tokens, so every per-token figure (activations, workspace, receive
buffers) counts b L_j / c tokens, but its slab holds the whole sequence's K/V, S tokens (the last
unit's too: other CP ranks' queries read it as their prefix), as does the slab's gradient; the
units' attention saves views of it for their own K/V, the last unit's included. FSDP shards over
``dp_shard`` x c ranks.

``kv_context`` is what these add to the peak: the largest activations + context over the
rank's actions, less the activation peak (so activations + kv_context is that sum's peak).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from torchtitan_seq.runtime.model_counts import kv_values, rope_width
from torchtitan_seq.simulate.memory.activations import recomputed_fraction, saved_per_token
from torchtitan_seq.simulate.memory.config import MemoryConfig

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


def slab_tokens(tokens: list[int], cp: int) -> int:
    """Tokens of a microbatch's K/V slab on one layer: the keys later units read (under CP, other CP ranks'
    queries: the last unit's too). Every layer keeps them all, those of bounded reach (a sliding window,
    chunked attention) too; what such a layer need keep, the keys its later queries reach, would be counted
    here."""
    return sum(tokens) - (tokens[-1] if cp == 1 else 0)


def bytes_of_stage(
    args: TransformerModelArgs,
    c: MemoryConfig,
    a: int,
    chunk: tuple[float, bool, bool],
    tokens: list[int],
    is_sequence: bool,
) -> StageBytes:
    """What units of ``tokens`` tokens weigh on a stage running ``chunk`` (under CP a rank computes 1/c of
    each unit's tokens and its slab holds the whole sequence's K/V, the last unit's too)."""
    layers, first, last = chunk
    per_token = saved_per_token(args, c, a, layers, first, last, is_sequence)
    recomputed = recomputed_fraction(c)
    # The whole RoPE table (complex64, seq_len x hd / 2) is saved once per stage where layers
    # get it whole: torch's schedules slice it, checkpointed blocks take it as an input.
    table = 4 * c.seq_len * rope_width(args) if layers and (not is_sequence or recomputed) else 0
    if not is_sequence:  # torch's schedules: K/V are the unit's own, no context
        return StageBytes([n * per_token for n in tokens], constant=table)
    kv = kv_values(args) / c.tp * a * layers  # K and V, a token
    slab = slab_tokens(tokens, c.cp) * kv
    saved_kv = kv * (1 - recomputed)  # in the per-token bytes: where the slab holds them, its views
    own = [n / c.cp * (per_token - saved_kv) for n in tokens]  # K/V in the slab: units 0..k-2, all under CP
    return StageBytes(
        own[:-1] + [tokens[-1] * per_token if c.cp == 1 else own[-1]],
        slab * (1 - recomputed),
        slab * recomputed,
        slab,
        table,
    )
