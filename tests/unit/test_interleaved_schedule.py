"""InterleavedSeq1F1B's action lists: ordered and deadlock-free in every shape, its placement,
stages per rank as torchtitan picks them, small bubbles."""

import itertools

import pytest
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import _add_send_recv, _simulate_comms_compute, _validate_schedule

from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, ScheduleShape, interleaved_seq1f1b_actions
from torchtitan_seq.schedules.ordering import validate_unit_order


def _lower_and_run(order, p, v, n_units):
    """torch's lowering and its step simulator: raise on a deadlock; returns stage -> rank."""
    stage_to_rank = _validate_schedule(order, p, p * v, n_units)
    comms = _add_send_recv({r: list(a) for r, a in order.items()}, stage_to_rank.__getitem__, p * v)
    _simulate_comms_compute(comms, stage_to_rank.__getitem__, p * v)
    return stage_to_rank


def _parallelism(schedule, layers_per_stage):
    from types import SimpleNamespace

    par = SimpleNamespace(
        pipeline_parallel_schedule=schedule,
        pipeline_parallel_layers_per_stage=layers_per_stage,
        pipeline_parallel_first_stage_less_layers=1,
        pipeline_parallel_last_stage_less_layers=1,
    )
    return par


@pytest.mark.parametrize("p,v", [(2, 2), (3, 2), (4, 2), (8, 2), (4, 3)])
def test_every_shape_is_ordered_and_deadlock_free(p, v):
    """Every N <= 16, k <= 8, with and without split backward: the ordering rules, loop
    placement, and torch's lowering and simulator (the released Seq1F1B-I fails (4, 2, 3))."""
    loop = generate_stage_to_rank_mapping(p, p * v, style="loop")
    for n, k, split in itertools.product(range(1, 17), range(1, 9), (False, True)):
        order = interleaved_seq1f1b_actions(ScheduleShape(p, n, k, split, v))
        validate_unit_order(order, k)
        assert _lower_and_run(order, p, v, n * k) == loop, (p, n, k)


def test_schedule_class_describes_its_placement():
    cls = SEQUENCE_SCHEDULES["InterleavedSeq1F1B"]
    assert cls.stage_placement == "loop" and cls.stages_per_rank == 2
    assert SEQUENCE_SCHEDULES["Seq1F1B"].stages_per_rank == 1


@pytest.mark.parametrize(
    "schedule,layers_per_stage,v",
    [
        ("InterleavedSeq1F1B", None, 2),
        ("Seq1F1B", None, 1),
        ("InterleavedSeq1F1B", 2, 2),
        ("InterleavedSeq1F1B", 1, 4),
        ("Seq1F1B", 4, 1),
    ],
)
def test_stages_per_rank_as_torchtitan_picks_them(schedule, layers_per_stage, v):
    """6 layers + embeddings + output on 2 ranks: torchtitan's pipeline_llm arithmetic."""
    from torchtitan_seq.titan.pipeline_core import stages_per_rank

    assert stages_per_rank(_parallelism(schedule, layers_per_stage), 6, 2) == v


@pytest.mark.parametrize(
    "schedule,layers_per_stage,pp", [("Seq1F1B", 2, 2), ("InterleavedSeq1F1B", 4, 2), ("InterleavedSeq1F1B", 1, 3)]
)
def test_stages_per_rank_rejects_a_layout_the_schedule_cannot_run(schedule, layers_per_stage, pp):
    from torchtitan_seq.titan.pipeline_core import stages_per_rank

    with pytest.raises(ValueError, match="parallelism.pipeline_parallel_layers_per_stage"):
        stages_per_rank(_parallelism(schedule, layers_per_stage), 6, pp)


@pytest.mark.parametrize("p,n,k", [(2, 4, 2), (4, 4, 1), (4, 4, 4), (4, 8, 2), (8, 8, 4), (4, 6, 3), (4, 9, 1)])
def test_bubble_ratio(p, n, k):
    """Uniform unit costs: (p-1)/(vNk+p-1) when p divides N, and no worse with a remainder."""
    from torchtitan_seq.simulate import SimConfig, simulate

    r = simulate(SimConfig("InterleavedSeq1F1B", p, n, k, seq_len=840))  # 840: even units for k <= 8
    assert r.deadlock is None
    assert r.bubble_ratio <= (p - 1) / (2 * n * k + p - 1) + 1e-9, r.bubble_ratio
