"""The ordering rules that make a sequence schedule exact, and their validator.

Within one microbatch on one stage (k subsequences, unit id = m * k + j):

1. forward: F(m, j) runs after F(m, j - 1), since unit j attends to the K/V
   of units 0..j-1;
2. backward: the pass that runs a unit's attention backward (B, or I, or W on
   the first stage, where torch defers the whole backward to W) runs for
   (m, j) after it ran for (m, j + 1) and after F(m, k - 1), since unit j + 1
   sends gradient into the K/V of units 0..j.

torch's own ``_validate_schedule`` checks neither.
"""

from __future__ import annotations

from torch.distributed.pipelining.schedules import FULL_BACKWARD as B
from torch.distributed.pipelining.schedules import F, I, W

from torchtitan_seq.runtime.kv_placement import Pass
from torchtitan_seq.runtime.torch_internals import Action, ComputationType

__all__ = [
    "B",
    "F",
    "I",
    "W",
    "ScheduleOrderError",
    "compute_leaves",
    "validate_unit_order",
    "stage_passes",
    "chain_neighbour",
    "feeds",
    "fed_by",
]


class ScheduleOrderError(ValueError):
    """A schedule breaks one of the ordering rules of this module."""


def compute_leaves(action: Action) -> tuple[Action, ...]:
    """The compute actions ``action`` runs: a compound action's parts (torch's OVERLAP_F_B), else itself."""
    return action.sub_actions or (action,)


def validate_unit_order(order: dict[int, list[Action | None]], num_subsequences: int) -> None:
    """Check rules 1 and 2 on per-rank compute-only action lists.

    Args:
        order: per rank, its compute actions in order (None: an idle slot).
        num_subsequences: k, units per microbatch (unit id = m * k + j).

    Raises:
        ScheduleOrderError: naming the rule, the rank, the step and the unit of the first break.
    """
    k = num_subsequences
    for rank, actions in order.items():
        # (stage, unit) pairs run, per kind: plain int tuples hash in C, an enum member in Python.
        done: dict[ComputationType, set[tuple[int, int]]] = {kind: set() for kind in (F, B, I, W)}
        forwards = done[F]
        for t, action in enumerate(actions):
            if action is None:
                continue
            for a in compute_leaves(action):
                kind, stage, uid = a.computation_type, a.stage_index, a.microbatch_index
                if kind not in done:
                    continue
                m, j = divmod(uid, k)
                if kind == F and j > 0 and (stage, uid - 1) not in forwards:
                    broken = f"rule 1 (forward in subsequence order): {{}} runs before subsequence {j - 1}"
                elif kind != F and (stage, m * k + k - 1) not in forwards:
                    broken = (
                        "rule 2 (backward after the microbatch's forwards): {} runs before the forward of "
                        f"subsequence {k - 1}"
                    )
                elif kind != F and j < k - 1 and (stage, uid + 1) not in done[kind]:
                    broken = (
                        "rule 2 (backward last-subsequence-first): {} runs before its "
                        f"{kind.value} of subsequence {j + 1}"
                    )
                else:
                    done[kind].add((stage, uid))
                    continue
                # The action is named only when a rule is broken: formatting it costs more than checking it.
                where = f"rank {rank} step {t}: {a} (microbatch {m}, subsequence {j}) on stage {stage}"
                raise ScheduleOrderError(broken.format(where))


def stage_passes(
    actions: list[Action | None] | tuple, stage: int, k: int, kinds: tuple[ComputationType, ...] = (F, B, W)
) -> tuple[list[int], list[Pass]]:
    """The passes of ``stage`` among a rank's compute ``actions`` in order, as the KV context places
    slabs by them (:data:`~torchtitan_seq.runtime.kv_placement.Pass`): each unit's forward, and the pass its
    backward ends with, B or W (the first stage's W runs the whole backward where torch defers it); with
    ``kinds`` (F, I, B, W) every pass the stage announces, as its K/V offload follows them.
    Returns each pass's position in ``actions`` and the passes."""
    where: list[int] = []
    passes: list[Pass] = []
    for i, action in enumerate(actions):
        for a in compute_leaves(action) if action is not None else ():
            if a.stage_index == stage and a.computation_type in kinds:
                where.append(i)
                passes.append((a.computation_type == F, *divmod(a.microbatch_index, k)))
    return where, passes


# Stages form chains of ``chain_length`` consecutive indices (one chain of all stages, or BSIPipe's and
# Chimera's two): a forward feeds the next stage of its chain, an input-gradient pass the previous one,
# and nothing crosses a chain's end. The lowering and the simulator both follow these three functions.
_DOWNSTREAM = {F: 1, B: -1, I: -1}


def chain_neighbour(stage: int, step: int, chain_length: int) -> int | None:
    """The stage ``step`` places along ``stage``'s chain, or None past the chain's end."""
    n = stage + step
    return n if n >= 0 and n // chain_length == stage // chain_length else None


def feeds(action: Action, chain_length: int) -> int | None:
    """The stage that receives what compute ``action`` makes (activations of F, input
    gradients of B and I); None for W and at a chain's end."""
    step = _DOWNSTREAM.get(action.computation_type)
    return None if step is None else chain_neighbour(action.stage_index, step, chain_length)


def fed_by(action: Action, chain_length: int) -> int | None:
    """The stage whose output compute ``action`` consumes; None for W and at a chain's start."""
    step = _DOWNSTREAM.get(action.computation_type)
    return None if step is None else chain_neighbour(action.stage_index, -step, chain_length)
