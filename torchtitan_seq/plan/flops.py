"""Cost-model FLOPs of what a step runs: one microbatch's units, the fill and drain a rank cannot
overlap, and one microbatch's longest chain of passes; what the search's bounds and the FLOP rate
of calibration files are made of."""

from __future__ import annotations

import itertools

from torchtitan_seq.plan.choices import ScheduleChoice
from torchtitan_seq.runtime.layer_shapes import MLAShape
from torchtitan_seq.runtime.partition import UnitCost


def unit_flops(cost: UnitCost, lengths: list[int], recompute: float) -> list[tuple[float, float]]:
    """Per unit, cost-model FLOPs of its forward and of its backward (``recompute`` forwards
    included) on one layer."""
    prefixes = [sum(lengths[:j]) for j in range(len(lengths))]
    return [
        (cost.forward(n, p), recompute * cost.forward(n, p) + cost.backward_input(n, p) + cost.backward_weight(n, p))
        for n, p in zip(lengths, prefixes)
    ]


def latent_flops(mla: MLAShape, heads: int, lengths: list[int], recompute: float) -> float:
    """Cost-model FLOPs of MLA's prefix expansion under ``kv_context = "latent"`` for one microbatch on one
    layer (:mod:`torchtitan_seq.attention.latent`): unit j at offset s_j expands its s_j prefix positions with
    wkv_b, 2 s_j r H (nope + v), in its forward, in each recomputation (``recompute`` forwards) and again in
    its backward, whose input- and weight-gradient products cost as much each."""
    per_key = 2 * mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    return (4 + recompute) * per_key * sum(itertools.accumulate(lengths[:-1]))


def step_flops(units: list[tuple[float, float]], n_layers: int, pp: int) -> float:
    """Cost-model FLOPs of one microbatch's passes (``units``: :func:`unit_flops`) on 1/pp of the layers."""
    return n_layers / pp * sum(f + b for f, b in units)


def stage_layers(choice: ScheduleChoice, n_layers: int, pp: int) -> float:
    """Layers of one of ``choice``'s stages on pp ranks: a chain holds the model over p v / copies stages."""
    return n_layers * choice.parameter_copies / (pp * choice.stages_per_rank)


def fill_flops(choice: ScheduleChoice, units: list[tuple[float, float]], n_layers: int, pp: int) -> float:
    """FLOPs the busiest-placed rank cannot overlap (``units``: :func:`unit_flops`): its first forward
    waits for a unit's forward to cross the stages before its first position in a chain, and after its
    last backward that unit's backward crosses them again (stages of n_layers / chain length layers).
    One chain: rank p-1, p-1 stages. Two chains start on both ends: a rank at position q holds
    positions q and p-1-q of the chains (in a V also 2p-1-q and p+q), so the middle ranks wait
    (p-1) // 2 stages."""
    hops = (pp - 1) // choice.parameter_copies
    return hops * stage_layers(choice, n_layers, pp) * (min(f for f, _ in units) + min(b for _, b in units))


def path_flops(choice: ScheduleChoice, units: list[tuple[float, float]], n_layers: int, pp: int) -> float:
    """FLOPs of one microbatch's longest chain of passes, which no schedule runs in parallel: unit 0's
    forward through the chain's every stage, units 1..k-1's forwards on the last (each reads the K/V
    of the one before), unit k-1's backward back through every stage, and units k-2..0's backwards on
    the first (each takes its dK/dV from the ones after). What bounds a step with few microbatches
    on many stages."""
    (f0, _), (_, b_last) = units[0], units[-1]
    return n_layers * (f0 + b_last) + stage_layers(choice, n_layers, pp) * (
        sum(f for f, _ in units[1:]) + sum(b for _, b in units[:-1])
    )
