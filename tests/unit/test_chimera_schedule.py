"""Chimera's layout, refusals, and its simulated bubbles (closed forms) and memory."""

import json

import pytest

from torchtitan_seq.schedules import (
    SEQUENCE_SCHEDULES,
    BidirectionalLayout,
    ScheduleShape,
    chimera_actions,
    lower_chains,
)
from torchtitan_seq.schedules.ordering import validate_unit_order
from torchtitan_seq.simulate import SimConfig, simulate

CHIMERA = SEQUENCE_SCHEDULES["Chimera"]
SEQ_LEN = 840  # every k tested cuts it into equal subsequences


def test_layout_runs_the_chains_straight_in_opposite_directions():
    lay = BidirectionalLayout(4, "linear", stages_per_rank=2)
    assert lay.chain_length == 4 and lay.stages_per_rank == 2
    for i in range(4):
        assert lay.rank_of_stage(i) == i  # down: chain A's stage i on rank i
        assert lay.rank_of_stage(4 + i) == 3 - i  # up: chain B's stage i on rank D-1-i
    for q in range(4):
        # Rank q holds chunk q of A and chunk p-1-q of B; its mirror the same two, roles swapped.
        assert [lay.chunk(s) for s in lay.stages_of_rank(q)] == [q, 3 - q]
        assert lay.mirror(q) == 3 - q
    paired = BidirectionalLayout(4, stages_per_rank=2)
    assert all(abs(r - paired.mirror(r)) == 1 for r in range(4))  # pairs are neighbours
    assert "rank 1: position 3, chunks A [3] B [0], mirrored with rank 0" in paired.describe()
    assert CHIMERA.place_stages(4, 4, placement="linear") == [
        [(0, 0), (7, 3)],
        [(1, 1), (6, 2)],
        [(2, 2), (5, 1)],
        [(3, 3), (4, 0)],
    ]
    with pytest.raises(ValueError, match="cuts the model into 4 chunks"):
        CHIMERA.place_stages(4, 8)


def test_no_transfer_crosses_a_chain_end():
    lay = BidirectionalLayout(4, stages_per_rank=2)
    order = {lay.rank_of_position(q): acts for q, acts in chimera_actions(ScheduleShape(4, 8, 2)).items()}
    lowered = lower_chains(order, lay.stage_to_rank(), lay.chain_length, 8)
    comms = {
        (a.computation_type.name, a.stage_index)
        for acts in lowered.values()
        for a in acts
        if a.computation_type.name in ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
    }
    assert (
        not {
            ("SEND_F", 3),
            ("SEND_F", 7),
            ("RECV_F", 0),
            ("RECV_F", 4),
            ("SEND_B", 0),
            ("SEND_B", 4),
            ("RECV_B", 3),
            ("RECV_B", 7),
        }
        & comms
    )
    assert {("SEND_F", s) for s in (0, 1, 2, 4, 5, 6)} <= comms


def test_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="even number of them, got 3"):
        CHIMERA.compute_order(ScheduleShape(2, 3, 2))
    with pytest.raises(ValueError, match="sequence_pipeline.split_backward = false"):
        CHIMERA.compute_order(ScheduleShape(2, 2, 2, split_backward=True))
    with pytest.raises(ValueError, match="Chimera holds 2 stages per rank"):
        CHIMERA.compute_order(ScheduleShape(2, 2, 2, stages_per_rank=4))
    with pytest.raises(ValueError, match="even pipeline_parallel_degree"):
        CHIMERA.check_shape(ScheduleShape(3, 2, 2))
    with pytest.raises(ValueError, match="sequence_pipeline.bidirectional_placement"):
        CHIMERA.check_shape(ScheduleShape(2, 2, 2), placement="ring")


def _run(p: int, n: int, k: int, cost: str = "uniform"):
    r = simulate(SimConfig("Chimera", pp=p, microbatches=n, subsequences=k, seq_len=SEQ_LEN, cost=cost))
    assert r.deadlock is None, (p, n, k, r.deadlock)
    assert r.parameter_copies == 2 and r.stages_per_rank == 2
    validate_unit_order(CHIMERA.compute_order(ScheduleShape(p, n, k)), k)
    return r


@pytest.mark.parametrize("p", [2, 4, 6, 8])
def test_paper_closed_form_with_backward_as_long_as_forward(p, tmp_path):
    """Chimera's analysis gives a backward the forward's time: its bubble (D-2)/(2N+D-2),
    over units (p-2)/(2Nk+p-2), exactly, for every even N >= p."""
    for k in (1, 2, 3):
        cost = tmp_path / f"equal{k}.json"
        cost.write_text(json.dumps({"F": [1 / k] * k, "B": [1 / k] * k}))
        for n in range(p, 3 * p + 1, 2):
            r = _run(p, n, k, str(cost))
            assert r.bubble_ratio == pytest.approx((p - 2) / (2 * n * k + p - 2), abs=1e-9), (p, n, k)


@pytest.mark.parametrize("p", [2, 4, 6, 8])
def test_uniform_costs_bubble_and_memory(p):
    """Backward 2x forward: the p-2 idle slots are backward slots, 2(p-2)/(3Nk+2(p-2)) at most,
    exactly at k = 1 and N a multiple of p; below Seq1F1B's (p-1)/(Nk+p-1) for p > 2. Peak
    activations at most (p-1)/k + 2 M (p M at k = 1, N = p), the same at N = 2p and 4p."""
    for k in (1, 2, 3):
        peaks = []
        for n in (p, 2 * p, 4 * p, p + 2):
            r = _run(p, n, k)
            bound = 2 * (p - 2) / (3 * n * k + 2 * (p - 2))
            if k == 1 and n % p == 0:
                assert r.bubble_ratio == pytest.approx(bound, abs=1e-9), (p, n, k)
            assert r.bubble_ratio <= bound + 1e-9, (p, n, k, r.bubble_ratio)
            if p > 2:
                assert r.bubble_ratio < (p - 1) / (n * k + p - 1), (p, n, k)
            assert max(r.peak_activations) <= (p - 1) / k + 2 + 1e-9, (p, n, k, r.peak_activations)
            if n in (2 * p, 4 * p):
                peaks.append(max(r.peak_activations))
        assert peaks[0] == pytest.approx(peaks[1]), (p, k, peaks)
    assert max(_run(p, p, 1).peak_activations) == pytest.approx(p)
