"""Cutting a sequence into k subsequences.

``even``: equal lengths. ``compute``: lengths that give every unit the same forward +
backward cost (Seq1F1B's solver). ``latency``: TeraPipe's slicing, the lengths that
minimise the pipeline's latency. Costs are :class:`UnitCost`'s: projections, MLP and
output layer grow with a unit's tokens, attention with the (query, key) pairs it scores,
so later units, with longer prefixes, get fewer tokens. With packed documents of
expected length D a query reaches back about D keys however far into the sequence it
is, so the cut tends to even as D shrinks. Lengths are whole multiples of ``multiple``
(of the TP degree, so sequence-parallel shards stay whole, and under context parallelism of 2 x CP x TP).
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:  # the plain-torch core does not import torchtitan
    from torchtitan.models.llama3 import TransformerModelArgs

    from torchtitan_seq.runtime.layer_shapes import AttentionReach

__all__ = ["UnitCost", "PARTITIONS", "partition_sequence"]

Partition = Literal["even", "compute", "latency"]
PARTITIONS: tuple[str, ...] = get_args(Partition)


@dataclass(frozen=True)
class UnitCost:
    """Cost of a unit of ``s`` tokens after a prefix of ``P`` tokens, per pass.

    forward = linear * s + attention * pairs, with pairs = s * P + s^2 / 2 the (query, key)
    pairs scored under the causal mask (per layer, on average over the layers: those of bounded
    ``reach`` score fewer); the input-gradient pass (I) costs linear * s + 2.5 * attention * pairs
    (flash backward recomputes the scores), the weight-gradient pass (W) linear * s. A full
    backward is I + W.
    """

    linear: float  # forward cost per token of everything but attention scores
    attention: float  # forward cost per (query, key) pair
    # expected tokens per packed document (block-causal attention); None: one document (causal)
    document_length: float | None = None
    reach: AttentionReach | None = None
    """How far the bounded layers' queries reach (a window, a chunk); None: every layer reads its prefix."""
    bounded: float = 0.0
    """Share of the layers whose queries read only ``reach`` (their pairs ignore packed documents, which
    would only cut them further)."""

    @classmethod
    def from_model_args(cls, args: TransformerModelArgs, document_length: float | None = None) -> UnitCost:
        """Forward FLOPs of a model (torchtitan ``TransformerModelArgs`` or a model shape of any family,
        :mod:`.model_counts`): per layer and token, 2 x the attention projections' weights (q, k, v, o;
        MLA's latent ones) + 2 * 3 * dim * the MLP width a token runs through (an MoE layer's ``top_k``
        routed and shared experts, its router's 2 * dim * experts; averaged over the layers, dense
        leading ones included), the output layer spread over the layers; per attended key, q.k and
        the weighted value of every head (4 * heads * head_dim; MLA: 2 * heads * (192 + 128) in the
        671B), the layers of bounded reach (sliding window, chunked attention) reading fewer keys."""
        # Imported where a model is costed: cutting a sequence by a given cost (runtime.shape) reads no model.
        from torchtitan_seq.runtime.model_counts import attention_weights, mlp_width, moe_share, pair_flops

        linear = (
            2 * attention_weights(args)
            + 2 * 3 * args.dim * mlp_width(args)
            + 2 * args.dim * args.vocab_size / args.n_layers
        )
        if (moe := getattr(args, "moe", None)) is not None:
            linear += 2 * args.dim * moe.experts * moe_share(args)
        reach = getattr(args, "reach", None)
        bounded = reach.bounded_layers(args.n_layers) / args.n_layers if reach is not None else 0.0
        return cls(linear, pair_flops(args), document_length, reach, bounded)

    def pairs(self, length: float, prefix: float) -> float:
        """(query, key) pairs scored by ``length`` queries after ``prefix`` tokens, per layer on average:
        the whole prefix's (:meth:`prefix_pairs`) on the layers that read it, the bounded layers'
        (:meth:`~.layer_shapes.AttentionReach.pairs`) on the others."""
        whole = self.prefix_pairs(length, prefix)
        if not self.bounded:
            return whole
        return (1 - self.bounded) * whole + self.bounded * self.reach.pairs(length, prefix)

    def prefix_pairs(self, length: float, prefix: float) -> float:
        """(query, key) pairs of a layer that reads the whole prefix. Causal: the integral of p over
        [P, P + s). With documents whose boundaries fall at random, D tokens apart on average, a query
        at p reaches back D (1 - exp(-p / D)) keys; its integral is written to stay exact for large D."""
        if self.document_length is None:
            return length * prefix + length * length / 2
        d = self.document_length
        x, y = length / d, prefix / d
        return -d * length * math.expm1(-y) + d * d * math.exp(-y) * (math.expm1(-x) + x)

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
    """Real-valued lengths of equal cost, solved unit by unit from the start (by
    bisection: a unit's cost grows with its length)."""
    target = cost(seq_len, 0) / k
    lengths, prefix = [], 0.0
    for _ in range(k - 1):
        low, high = 0.0, seq_len - prefix
        while high - low > 1e-9 * seq_len:
            mid = (low + high) / 2
            low, high = (mid, high) if cost(mid, prefix) < target else (low, mid)
        lengths.append(low)
        prefix += low
    lengths.append(seq_len - prefix)
    return lengths


def _latency_lengths(seq_len: int, k: int, multiple: int, cost: UnitCost) -> list[int]:
    """TeraPipe's slicing (ICML'21, section 3.3) on the grid of ``multiple``-token blocks.

    TeraPipe minimises the latency of K pipeline stages, sum_j t_j + (K - 1) * max_j t_j,
    t_j the unit's forward + backward time. Under :class:`UnitCost` the sum is the same
    for every cut into k units (each token and causal (query, key) pair counts once), so
    the optimum, for every K, is the cut whose costliest unit costs least: found exactly
    by bisection on that cap, since the greedy cut that makes every unit as long as the
    cap allows fits under the cap whenever any cut does (a unit's cost grows as it is
    extended at either end). About 50 greedy passes of k binary searches.
    """
    blocks = seq_len // multiple

    def unit(a: int, b: int) -> float:
        """Cost of the unit made of blocks [a, b)."""
        return cost((b - a) * multiple, a * multiple)

    def greedy_cuts(cap: float) -> list[int] | None:
        """Block cut points [0, ..., blocks] with every unit under ``cap``, or None if there are none."""
        cuts = [0]
        for j in range(k - 1):
            a = cuts[-1]
            ends = range(a + 1, blocks - (k - 2 - j))  # leave a block for each later unit
            b = a + bisect.bisect_right(ends, cap, key=lambda end: unit(a, end))
            if b == a:
                return None
            cuts.append(b)
        return cuts + [blocks] if unit(cuts[-1], blocks) <= cap else None

    def peak(cuts: list[int]) -> float:
        return max(unit(a, b) for a, b in zip(cuts, cuts[1:]))

    best = greedy_cuts(unit(0, blocks))  # no unit costs more than the whole sequence
    low, high = 0.0, peak(best)  # no cut fits under ``low``; ``best`` fits under ``high``
    while high - low > 1e-12 * high:
        cap = (low + high) / 2
        cuts = greedy_cuts(cap)
        if cuts is None:
            low = cap
        else:
            best, high = cuts, peak(cuts)
    return [(b - a) * multiple for a, b in zip(best, best[1:])]


def partition_sequence(
    seq_len: int,
    num_subsequences: int,
    method: Partition = "compute",
    *,
    multiple: int = 1,
    cost: UnitCost | None = None,
) -> list[int]:
    """Cut a sequence into k subsequences (see the module docstring).

    Args:
        seq_len: S, tokens per sequence.
        num_subsequences: k, at least 1.
        method: ``"even"``, ``"compute"`` or ``"latency"``.
        multiple: what every length is a whole multiple of (``seq_len`` must be one too).
        cost: the model's unit cost, which ``"compute"`` and ``"latency"`` balance; unused by ``"even"``.

    Returns:
        [L_0, ..., L_{k-1}], each a positive multiple of ``multiple``, summing to ``seq_len``.

    Raises:
        ValueError: naming the setting, for a cut that cannot be made.
    """
    k = num_subsequences
    if method not in PARTITIONS:
        raise ValueError(f"sequence_pipeline.partition = {method!r} is unknown: use one of {list(PARTITIONS)}")
    if k < 1:
        raise ValueError(f"sequence_pipeline.num_subsequences = {k}: it must be at least 1")
    if multiple < 1:
        raise ValueError(f"length multiple {multiple} must be at least 1")
    if seq_len % multiple:
        raise ValueError(
            f"training.seq_len = {seq_len} is not a multiple of {multiple} (the subsequence length "
            "multiple: of sequence_pipeline.length_multiple, the TP degree and, under CP, 2 x CP x TP): change "
            "seq_len or sequence_pipeline.length_multiple"
        )
    blocks = seq_len // multiple
    if blocks < k:
        raise ValueError(
            f"sequence_pipeline.num_subsequences = {k} is more than the {blocks} pieces of "
            f"{multiple} tokens that training.seq_len = {seq_len} can be cut into: lower "
            "num_subsequences (or length_multiple)"
        )
    if method != "even" and cost is None:
        raise ValueError(f"the {method!r} partition needs a UnitCost")
    if method == "latency":
        return _latency_lengths(seq_len, k, multiple, cost)
    real = [seq_len / k] * k if method == "even" else _balanced_lengths(seq_len, k, cost)
    # Round the cut points, not the lengths, so rounding errors do not add up;
    # keep every unit at least one multiple long.
    cuts = [0]
    for j, end in enumerate(itertools.accumulate(real[:-1])):
        cuts.append(min(max(round(end / multiple), cuts[-1] + 1), blocks - (k - 1 - j)))
    return [(b - a) * multiple for a, b in zip(cuts, cuts[1:] + [blocks])]
