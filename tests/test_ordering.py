import itertools

import pytest

from torchtitan_seq.ordering import B, F, ScheduleOrderError, validate_unit_order
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, _Action


@pytest.mark.parametrize("name", sorted(SEQUENCE_SCHEDULES))
def test_shipped_schedules_follow_the_rules(name):
    cls = SEQUENCE_SCHEDULES[name]
    v = cls.stages_per_rank
    options = {"stages_per_rank": v} if v > 1 else {}
    for p, n, k, split in itertools.product((1, 2, 4), (1, 2, 5), (1, 2, 3, 4), (False, True)):
        validate_unit_order(cls.actions_fn(p, n, k, split_backward=split, **options), k, p * v)


def _one_rank(actions):
    return {0: [_Action(0, kind, uid) for kind, uid in actions]}


def test_rejects_backward_first_subsequence_first():
    order = _one_rank([(F, 0), (F, 1), (B, 0), (B, 1)])
    with pytest.raises(ScheduleOrderError, match=r"rule 2 \(backward last-subsequence-first\).*microbatch 0, subsequence 0"):
        validate_unit_order(order, 2, 2)


def test_rejects_forward_out_of_order():
    with pytest.raises(ScheduleOrderError, match=r"rule 1.*subsequence 1"):
        validate_unit_order(_one_rank([(F, 1), (F, 0), (B, 1), (B, 0)]), 2, 2)


def test_rejects_backward_before_last_forward():
    with pytest.raises(ScheduleOrderError, match=r"rule 2 \(backward after the microbatch's forwards\)"):
        validate_unit_order(_one_rank([(F, 0), (B, 0), (F, 1), (B, 1)]), 2, 2)


def test_last_stage_runs_forwards_in_unit_order():
    # Two microbatches interleaved on the last stage: losses would be filed under the wrong unit.
    order = _one_rank([(F, 0), (F, 2), (F, 1), (F, 3), (B, 3), (B, 2), (B, 1), (B, 0)])
    with pytest.raises(ScheduleOrderError, match=r"rule 3"):
        validate_unit_order(order, 2, 1)
    validate_unit_order(order, 2, 2)  # fine on a stage that is not the last
