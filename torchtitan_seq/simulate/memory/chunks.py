"""Model chunks: which layers and ends each chunk of a chain holds, and which chunks each rank's stages run.

A chunk is the part of the model a stage runs: torchtitan's ``generate_llm_fqn_per_model_part`` split
(embeddings and norm + output weighted as one layer each; :func:`~torchtitan_seq.titan.flavors.chunk_split`
computes it without torchtitan), or, when that split has an empty chunk (more chunks than layers), an
even real-valued share of the layers, embeddings on the first chunk and the output on the last.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from torchtitan_seq.schedules import SEQUENCE_SCHEDULES
from torchtitan_seq.simulate.build import stages_by_rank
from torchtitan_seq.titan.flavors import chunk_split


@functools.lru_cache(maxsize=256)
def memory_chunk_split(n_layers: int, num_chunks: int) -> tuple[tuple[float, bool, bool], ...]:
    """Per chunk: (transformer layers, holds the embeddings, holds norm + output), as torchtitan cuts it."""
    split = chunk_split(n_layers, num_chunks)
    if split is None:  # more chunks than layers: an even real-valued share
        share = n_layers / num_chunks
        return tuple((share, i == 0, i == num_chunks - 1) for i in range(num_chunks))
    return split


Chunks = tuple[tuple[float, bool, bool], ...]
"""Per chunk of a chain: (transformer layers, holds the embeddings, holds norm + output)."""


class ChunkLayout(NamedTuple):
    """Which model chunks each rank's stages run, counted per kind of chunk (a chunk's layers and ends)."""

    chunks: list[tuple[float, bool, bool]]
    """The kinds of chunk."""
    count: np.ndarray
    """(ranks, kinds): the rank's stages of each kind."""
    primary: np.ndarray
    """(ranks, kinds): those of chain A (the copies that hold optimizer states)."""
    per_chain: np.ndarray
    """(ranks, chains, kinds): the rank's stages of each kind per chain."""
    copies: int
    kind: list[int]
    """Per chunk of a chain, in order, its kind."""


@functools.lru_cache(maxsize=256)
def chunk_layout(schedule: str, pp: int, stages_per_rank: int | None, n_layers: int) -> ChunkLayout:
    """:func:`~.floor.memory_floor`'s view of where a schedule places its stages
    (:func:`~torchtitan_seq.simulate.build.stages_by_rank`)."""
    copies = getattr(SEQUENCE_SCHEDULES.get(schedule), "parameter_copies", 1)
    by_rank = stages_by_rank(schedule, pp, stages_per_rank)
    chain_length = pp * len(by_rank[0]) // copies
    chunks, kind = chunk_kinds(n_layers, chain_length)
    per_chain = np.zeros((pp, copies, len(chunks)))
    for r, stages in enumerate(by_rank):
        for s in stages:
            per_chain[r, s // chain_length, kind[s % chain_length]] += 1
    return ChunkLayout(chunks, per_chain.sum(axis=1), per_chain[:, 0], per_chain, copies, kind)


@functools.lru_cache(maxsize=256)
def chunk_kinds(n_layers: int, chain_length: int) -> tuple[list[tuple[float, bool, bool]], list[int]]:
    """The kinds of chunk of a chain (a chunk's layers and ends, sorted) and, per chain position, its kind."""
    of_position = memory_chunk_split(n_layers, chain_length)
    chunks = sorted(set(of_position))
    return chunks, [chunks.index(chunk) for chunk in of_position]
