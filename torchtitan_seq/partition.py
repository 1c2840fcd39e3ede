"""Cutting a sequence into k subsequences.

``even``: equal lengths. ``compute``: lengths that give every unit the same
forward + backward cost under the causal mask. A unit of s tokens after a
prefix of P tokens costs ``a * s + b * (s * P + s**2 / 2)`` (:class:`UnitCost`):
projections, MLP and output layer grow with s, attention with the number of
(query, key) pairs it scores. Later units have longer prefixes, so they get
fewer tokens. Lengths are whole multiples of ``multiple`` (at least the TP
degree, so sequence-parallel shards stay whole).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["UnitCost", "PARTITIONS", "partition_sequence"]

PARTITIONS = ("even", "compute")


@dataclass(frozen=True)
class UnitCost:
    """Cost of a unit of ``s`` tokens after a prefix of ``P`` tokens, per pass.

    forward = linear * s + attention * pairs, with pairs = s * P + s^2 / 2 the
    (query, key) pairs scored under the causal mask; the input-gradient pass
    (I) costs linear * s + 2.5 * attention * pairs (flash backward recomputes
    the scores), the weight-gradient pass (W) linear * s. A full backward is
    I + W.

    Attributes:
        linear: forward cost per token of everything but attention scores.
        attention: forward cost per (query, key) pair.
    """

    linear: float
    attention: float

    @classmethod
    def from_model_args(cls, args) -> "UnitCost":
        """Forward FLOPs of a Llama-style model (torchtitan ``TransformerModelArgs``).

        Per layer and token: 2 * dim * (q, k, v, o widths) + 2 * 3 * dim * ffn
        matmul FLOPs (the output layer spread over the layers), and
        4 * heads * head_dim per attended key.
        """
        dim, n_heads = args.dim, args.n_heads
        n_kv = args.n_kv_heads or n_heads
        head_dim = dim // n_heads
        hidden = int(2 * 4 * dim / 3)
        if args.ffn_dim_multiplier is not None:
            hidden = int(args.ffn_dim_multiplier * hidden)
        hidden = args.multiple_of * math.ceil(hidden / args.multiple_of)
        proj = 2 * dim * head_dim * (2 * n_heads + 2 * n_kv)
        ffn = 2 * 3 * dim * hidden
        output = 2 * dim * args.vocab_size / args.n_layers
        return cls(linear=proj + ffn + output, attention=4 * n_heads * head_dim)

    @staticmethod
    def pairs(length: float, prefix: float) -> float:
        return length * prefix + length * length / 2

    def forward(self, length: float, prefix: float) -> float:
        return self.linear * length + self.attention * self.pairs(length, prefix)

    def backward_input(self, length: float, prefix: float) -> float:
        return self.linear * length + 2.5 * self.attention * self.pairs(length, prefix)

    def backward_weight(self, length: float, prefix: float) -> float:
        return self.linear * length

    def __call__(self, length: float, prefix: float) -> float:
        """Forward + backward cost, what the ``compute`` partition balances."""
        return 3 * self.linear * length + 3.5 * self.attention * self.pairs(length, prefix)


def _balanced_lengths(seq_len: int, k: int, cost: UnitCost) -> list[float]:
    """Real-valued lengths of equal cost, solved unit by unit from the start."""
    target = cost(seq_len, 0) / k
    a, b = 3 * cost.linear, 3.5 * cost.attention
    lengths, prefix = [], 0.0
    for _ in range(k - 1):
        lin = a + b * prefix
        s = 2 * target / (lin + math.sqrt(lin * lin + 2 * b * target)) if b else target / a
        lengths.append(s)
        prefix += s
    lengths.append(seq_len - prefix)
    return lengths


def partition_sequence(
    seq_len: int,
    num_subsequences: int,
    method: str = "compute",
    *,
    multiple: int = 1,
    cost: UnitCost | None = None,
) -> list[int]:
    """Lengths [L_0, ..., L_{k-1}] summing to ``seq_len``.

    Args:
        seq_len: tokens per sequence.
        num_subsequences: k >= 1.
        method: ``"even"`` or ``"compute"`` (needs ``cost``).
        multiple: every length is a multiple of this.
        cost: the unit cost model for ``"compute"``.
    """
    k = num_subsequences
    if method not in PARTITIONS:
        raise ValueError(
            f"sequence_pipeline.partition = {method!r} is unknown: use one of {list(PARTITIONS)}"
        )
    if k < 1:
        raise ValueError(f"sequence_pipeline.num_subsequences = {k}: it must be at least 1")
    if multiple < 1:
        raise ValueError(f"length multiple {multiple} must be at least 1")
    if seq_len % multiple:
        raise ValueError(
            f"training.seq_len = {seq_len} is not a multiple of {multiple} (the subsequence "
            "length multiple, at least the TP degree): change seq_len or "
            "sequence_pipeline.length_multiple"
        )
    blocks = seq_len // multiple
    if blocks < k:
        raise ValueError(
            f"sequence_pipeline.num_subsequences = {k} is more than the {blocks} pieces of "
            f"{multiple} tokens that training.seq_len = {seq_len} can be cut into: lower "
            "num_subsequences (or length_multiple)"
        )
    if method == "even":
        real = [seq_len / k] * k
    else:
        if cost is None:
            raise ValueError("the 'compute' partition needs a UnitCost")
        real = _balanced_lengths(seq_len, k, cost)
    # Round the cut points, not the lengths, so rounding errors do not add up;
    # keep every unit at least one multiple long.
    cuts, acc = [0], 0.0
    for j, length in enumerate(real[:-1]):
        acc += length
        lo, hi = cuts[-1] + 1, blocks - (k - 1 - j)
        cuts.append(min(max(round(acc / multiple), lo), hi))
    cuts.append(blocks)
    return [(cuts[j + 1] - cuts[j]) * multiple for j in range(k)]
