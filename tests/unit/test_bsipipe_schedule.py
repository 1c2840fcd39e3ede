"""BSIPipe's layout, chain-aware lowering, refusals, and its simulated bubbles and memory."""

import itertools

import pytest

from torchtitan_seq.schedules import (
    SEQUENCE_SCHEDULES,
    BidirectionalLayout,
    ScheduleShape,
    bsipipe_actions,
    lower_chains,
    seq1f1b_actions,
)
from torchtitan_seq.simulate.stand_in import torch_lowering


def test_layout_places_chains_in_mirrored_vs():
    lay = BidirectionalLayout(4, "linear")
    # Position q holds chunks {q, 2p-1-q} of A and {p-1-q, p+q} of B.
    for q in range(4):
        chunks = [lay.chunk(s) for s in lay.stages_of_rank(q)]
        assert chunks == [q, 7 - q, 3 - q, 4 + q]
    paired = BidirectionalLayout(4)
    assert [paired.rank_of_position(q) for q in range(4)] == [0, 2, 3, 1]
    assert all(abs(r - paired.mirror(r)) == 1 for r in range(4))  # pairs are neighbours
    assert "rank 0: position 0, chunks A [0, 7] B [3, 4], mirrored with rank 1" in paired.describe()
    with pytest.raises(ValueError, match="even pipeline_parallel_degree"):
        BidirectionalLayout(3)
    with pytest.raises(ValueError, match="sequence_pipeline.bidirectional_placement"):
        BidirectionalLayout(4, "ring")


def test_lowering_of_one_chain_is_torchs():
    """With one chain, lower_chains lowers as torch's runtime does (its sends and receives where torch's
    _add_send_recv places them, and torch 2.15's waits after them)."""
    for p, n, k in itertools.product((2, 3, 4), (1, 3), (1, 2, 4)):
        order = seq1f1b_actions(ScheduleShape(p, n, k))
        ours = lower_chains(order, {s: s for s in range(p)}, p, n * k)
        assert ours == torch_lowering(order, p, n * k)[0]


def test_no_transfer_crosses_a_chain_end():
    lay = BidirectionalLayout(4)
    order = {lay.rank_of_position(q): acts for q, acts in bsipipe_actions(ScheduleShape(4, 8, 2)).items()}
    lowered = lower_chains(order, lay.stage_to_rank(), lay.chain_length, 8)
    comms = {
        (a.computation_type.name, a.stage_index)
        for acts in lowered.values()
        for a in acts
        if a.computation_type.name in ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
    }
    ends = {0, 7, 8, 15}  # first and last stage of each chain
    assert (
        not {
            ("SEND_F", 7),
            ("SEND_F", 15),
            ("RECV_F", 0),
            ("RECV_F", 8),
            ("SEND_B", 0),
            ("SEND_B", 8),
            ("RECV_B", 7),
            ("RECV_B", 15),
        }
        & comms
    )
    # The V turns (stages 3/4 and 11/12) are on one rank: no transfer there either.
    assert not {("SEND_F", 3), ("SEND_F", 11), ("SEND_B", 4), ("SEND_B", 12)} & comms
    assert {("SEND_F", s) for s in range(16) if s not in ends | {3, 11}} <= comms


def test_refuses_what_it_cannot_run():
    cls = SEQUENCE_SCHEDULES["BSIPipe"]
    with pytest.raises(ValueError, match="even number of them, got 3"):
        cls.compute_order(ScheduleShape(2, 3, 2))
    with pytest.raises(ValueError, match="sequence_pipeline.split_backward = false"):
        cls.compute_order(ScheduleShape(2, 2, 2, split_backward=True))
    # The job check refuses the same without building the lists.
    with pytest.raises(ValueError, match="even number of them, got 3"):
        cls.check_shape(ScheduleShape(2, 3, 2))
    with pytest.raises(ValueError, match="even pipeline_parallel_degree"):
        cls.check_shape(ScheduleShape(3, 2, 2))


@pytest.mark.parametrize("p", [2, 4, 8])
def test_smaller_bubbles_than_interleaved_and_memory_independent_of_n(p):
    """Uniform costs, N in {2p, 8p}, k 1-4: bubble below InterleavedSeq1F1B's (v=2) and
    at most (p-1)/(3Nk+p-1) + 0.01; two parameter copies; the same peak at N = 2p and 8p."""
    from torchtitan_seq.simulate import SimConfig, simulate

    for k in (1, 2, 3, 4):
        peaks = []
        for n in (2 * p, 8 * p):
            # 3072 tokens: every k cuts them into equal subsequences.
            bsi = simulate(SimConfig("BSIPipe", pp=p, microbatches=n, subsequences=k, seq_len=3072))
            inter = simulate(SimConfig("InterleavedSeq1F1B", pp=p, microbatches=n, subsequences=k, seq_len=3072))
            assert bsi.deadlock is None and bsi.parameter_copies == 2
            assert bsi.bubble_ratio < inter.bubble_ratio, (p, n, k, bsi.bubble_ratio, inter.bubble_ratio)
            assert bsi.bubble_ratio <= (p - 1) / (3 * n * k + p - 1) + 0.01, (p, n, k, bsi.bubble_ratio)
            peaks.append(max(bsi.peak_activations))
        assert peaks[0] == pytest.approx(peaks[1]), (p, k, peaks)
