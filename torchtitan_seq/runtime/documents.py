"""Packed documents: which tokens of a packed sequence may attend to which.

torchtitan packs documents into each training sequence, each ended by the tokenizer's EOS,
and its block-causal flavors mask attention across documents (``get_document_mask_mod``):
token i belongs to document number "EOS tokens before i", so an EOS belongs to the document
it ends, and a sequence without EOS is one document. :func:`document_ids` numbers tokens so;
:class:`Documents` holds, per batch row of one microbatch, where documents start, which is
all that unit attention (:mod:`torchtitan_seq.attention`) needs, documents being contiguous.

The starts are Python ints, read from the ids once per batch (one copy to the host, a sync where
the ids lie on a GPU): once per step for a sequence schedule (:meth:`Documents.split` hands each
microbatch its rows), once per microbatch for torch's schedules (:meth:`Documents.of_batch` keeps
them for the batch's every layer, forward and backward), never per unit or layer.
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass

import torch

__all__ = ["document_ids", "document_mask", "Documents"]


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Each token's document, numbered as torchtitan's document mask numbers them (the count of EOS
    tokens before it): what a sequence schedule's ``step`` takes as ``attention_masks``.

    Args:
        tokens: (B, S) token ids of packed sequences.
        eos_id: the tokenizer's end-of-sequence id.

    Returns:
        (B, S) int32 document ids, non-decreasing along each row.
    """
    ids = torch.zeros(tokens.shape, dtype=torch.int32, device=tokens.device)
    ids[:, 1:] = (tokens[:, :-1] == eos_id).cumsum(1)
    return ids


def document_mask(ids: torch.Tensor) -> torch.Tensor:
    """(B, S) document ids -> (B, 1, S, S) bool: causal within each document. The dense
    mask, O(S^2): the reference that attention without a mask is checked against."""
    s = ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
    return (ids.unsqueeze(2) == ids.unsqueeze(1)).unsqueeze(1) & causal


@dataclass(frozen=True)
class Documents:
    """Where the documents of one microbatch start: per batch row, the sorted
    positions of their first tokens (0 first)."""

    starts: tuple[tuple[int, ...], ...]

    @classmethod
    def from_ids(cls, ids: torch.Tensor) -> Documents:
        """ids: (b, S) document ids, non-decreasing along the sequence (:func:`document_ids`), read
        on the host (one copy there where they lie on a device)."""
        ids = ids.cpu()
        new = torch.ones(ids.shape, dtype=torch.bool)
        new[:, 1:] = ids[:, 1:] != ids[:, :-1]
        return cls(tuple(tuple(row.nonzero().flatten().tolist()) for row in new))

    @classmethod
    def of_batch(cls, ids: torch.Tensor) -> Documents:
        """:meth:`from_ids` of ``ids``, read once while that tensor lives: every layer of a batch,
        forward and backward, is handed the same tensor of ids (which nothing writes to)."""
        key = id(ids)
        cached = _READ.get(key)
        if cached is not None and cached[0]() is ids:
            return cached[1]
        documents = cls.from_ids(ids)
        _READ[key] = (weakref.ref(ids, lambda _: _READ.pop(key, None)), documents)
        return documents

    def split(self, sections: int) -> list[Documents]:
        """The documents of each of ``sections`` groups of rows, as ``Tensor.tensor_split`` groups them."""
        size, extra = divmod(len(self.starts), sections)
        bounds = [i * size + min(i, extra) for i in range(sections + 1)]
        return [Documents(self.starts[a:b]) for a, b in zip(bounds, bounds[1:])]

    def start_of(self, row: int, position: int) -> int:
        """The first position of the document that holds ``position`` in batch row ``row``."""
        starts = self.starts[row]
        return starts[bisect.bisect_right(starts, position) - 1]

    def first_needed(self, position: int) -> int:
        """The earliest position any row's document at ``position`` reaches back to: keys
        before it are never read again by queries at ``position`` or later."""
        return min(self.start_of(row, position) for row in range(len(self.starts)))

    def pieces(self, row: int, begin: int, end: int) -> list[tuple[int, int]]:
        """The documents' pieces within [begin, end) of row ``row``, as [start, stop)
        relative to ``begin``, in order."""
        bounds = [0, *(p - begin for p in self.starts[row] if begin < p < end), end - begin]
        return list(zip(bounds, bounds[1:]))


# id of an ids tensor -> (a weak reference to it, its documents), forgotten when the tensor goes
_READ: dict[int, tuple[weakref.ref, Documents]] = {}
