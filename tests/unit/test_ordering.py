import itertools

import pytest
from torch.distributed.pipelining.schedules import _Action

from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, ScheduleShape
from torchtitan_seq.schedules.ordering import B, F, ScheduleOrderError, validate_unit_order


@pytest.mark.parametrize("name", sorted(SEQUENCE_SCHEDULES))
def test_shipped_schedules_follow_the_rules(name):
    cls = SEQUENCE_SCHEDULES[name]
    for p, n, k, split in itertools.product((1, 2, 4), (1, 2, 5, 6), (1, 2, 3, 4), (False, True)):
        try:
            order = cls.compute_order(ScheduleShape(p, n, k, split))
        except ValueError:  # a shape the schedule refuses (BSIPipe, Chimera: odd p or N, split backward)
            assert cls.parameter_copies == 2 and (p % 2 or n % 2 or split), (p, n, k, split)
            continue
        validate_unit_order(order, k)


def _one_rank(actions):
    return {0: [_Action(0, kind, uid) for kind, uid in actions]}


def test_rejects_backward_first_subsequence_first():
    order = _one_rank([(F, 0), (F, 1), (B, 0), (B, 1)])
    with pytest.raises(
        ScheduleOrderError, match=r"rule 2 \(backward last-subsequence-first\).*microbatch 0, subsequence 0"
    ):
        validate_unit_order(order, 2)


def test_rejects_forward_out_of_order():
    with pytest.raises(ScheduleOrderError, match=r"rule 1.*subsequence 1"):
        validate_unit_order(_one_rank([(F, 1), (F, 0), (B, 1), (B, 0)]), 2)


def test_rejects_backward_before_last_forward():
    with pytest.raises(ScheduleOrderError, match=r"rule 2 \(backward after the microbatch's forwards\)"):
        validate_unit_order(_one_rank([(F, 0), (B, 0), (F, 1), (B, 1)]), 2)
