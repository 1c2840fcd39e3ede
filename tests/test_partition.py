import pytest

from torchtitan_seq.model import seq_llama3_flavors
from torchtitan_seq.partition import UnitCost, partition_sequence

DEBUG = UnitCost.from_model_args(seq_llama3_flavors["debugmodel"])


@pytest.mark.parametrize("seq_len,k,multiple", [(2048, 4, 64), (2048, 3, 1), (30, 4, 1), (4096, 8, 128), (64, 1, 16)])
@pytest.mark.parametrize("method", ["even", "compute"])
def test_lengths_cover_the_sequence(seq_len, k, multiple, method):
    lengths = partition_sequence(seq_len, k, method, multiple=multiple, cost=DEBUG)
    assert sum(lengths) == seq_len and len(lengths) == k
    assert all(length > 0 and length % multiple == 0 for length in lengths)


def test_compute_partition_balances_cost():
    lengths = partition_sequence(8192, 4, "compute", cost=DEBUG)
    assert lengths == sorted(lengths, reverse=True)  # later units see longer prefixes
    costs, prefix = [], 0
    for length in lengths:
        costs.append(DEBUG(length, prefix))
        prefix += length
    assert max(costs) / min(costs) < 1.01
    even_costs = [DEBUG(2048, 2048 * j) for j in range(4)]
    assert max(even_costs) / min(even_costs) > 1.2


def test_compute_partition_matches_published_and_measured_splits():
    # Seq1F1B's solver for 8B at 16k, k=4: [4930, 4238, 3776, 3440].
    eight_b = UnitCost.from_model_args(seq_llama3_flavors["8B"])
    for ours, theirs in zip(partition_sequence(16384, 4, "compute", cost=eight_b), [4930, 4238, 3776, 3440]):
        assert abs(ours - theirs) / theirs < 0.01
    # The split fitted to measured unit times of the debug model on this CPU.
    assert partition_sequence(2048, 4, "compute", multiple=64, cost=DEBUG) == [704, 512, 448, 384]


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(seq_len=3, num_subsequences=4), "num_subsequences = 4"),
        (dict(seq_len=64, num_subsequences=0), "num_subsequences = 0"),
        (dict(seq_len=100, num_subsequences=2, multiple=64), "not a multiple of 64"),
        (dict(seq_len=128, num_subsequences=4, multiple=64), "length_multiple"),
        (dict(seq_len=64, num_subsequences=2, method="latency?"), "partition = 'latency?'"),
    ],
)
def test_bad_input_names_the_setting(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("?", r"\?")):
        partition_sequence(**kwargs, cost=DEBUG)
