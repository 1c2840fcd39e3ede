import itertools

import pytest

from torchtitan_seq.runtime.partition import UnitCost, partition_sequence
from torchtitan_seq.titan.v022.models.llama3_seq import seq_llama3_flavors

DEBUG = UnitCost.from_model_args(seq_llama3_flavors["debugmodel"])


@pytest.mark.parametrize("seq_len,k,multiple", [(2048, 4, 64), (2048, 3, 1), (30, 4, 1), (4096, 8, 128), (64, 1, 16)])
@pytest.mark.parametrize("method", ["even", "compute", "latency"])
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


def _unit_costs(lengths, cost):
    return [cost(length, sum(lengths[:j])) for j, length in enumerate(lengths)]


def terapipe_latency(lengths, cost, num_stages):
    """TeraPipe's objective: sum of unit times + (K - 1) * the longest, K pipeline stages."""
    times = _unit_costs(lengths, cost)
    return sum(times) + (num_stages - 1) * max(times)


EIGHT_B = UnitCost.from_model_args(seq_llama3_flavors["8B"])


@pytest.mark.parametrize(
    "seq_len,k,multiple",
    [(2048, 4, 64), (512, 4, 16), (512, 4, 32), (16384, 4, 128), (32768, 8, 128), (4096, 3, 1), (30, 4, 1)],
)
@pytest.mark.parametrize("cost", [DEBUG, EIGHT_B], ids=["debug", "8B"])
def test_latency_partition_is_no_worse_than_even_and_compute(seq_len, k, multiple, cost):
    lat, even, comp = (
        partition_sequence(seq_len, k, method, multiple=multiple, cost=cost)
        for method in ("latency", "even", "compute")
    )
    for stages in (2, 4, 8):
        best = terapipe_latency(lat, cost, stages)
        assert best <= terapipe_latency(even, cost, stages) * (1 + 1e-12)
        assert best <= terapipe_latency(comp, cost, stages) * (1 + 1e-12)


def test_latency_partition_can_beat_rounded_compute_partition():
    # Rounding the compute cut points to 32 tokens unbalances it; the latency cut is optimal on the grid.
    assert partition_sequence(512, 4, "compute", multiple=32, cost=DEBUG) == [128, 160, 96, 128]
    lat = partition_sequence(512, 4, "latency", multiple=32, cost=DEBUG)
    assert max(_unit_costs(lat, DEBUG)) < max(_unit_costs([128, 160, 96, 128], DEBUG))


@pytest.mark.parametrize("seq_len,k,multiple", [(96, 4, 8), (64, 3, 4), (40, 5, 2)])
@pytest.mark.parametrize("cost", [DEBUG, EIGHT_B, UnitCost(linear=1.0, attention=0.5)], ids=["debug", "8B", "toy"])
def test_latency_partition_is_optimal_on_the_grid(seq_len, k, multiple, cost):
    """Against every cut into k units of whole multiples (brute force)."""
    lat = partition_sequence(seq_len, k, "latency", multiple=multiple, cost=cost)
    blocks = seq_len // multiple
    for cuts in itertools.combinations(range(1, blocks), k - 1):
        bounds = (0, *cuts, blocks)
        lengths = [(b - a) * multiple for a, b in zip(bounds, bounds[1:])]
        for stages in (2, 4):
            other = terapipe_latency(lengths, cost, stages)
            assert terapipe_latency(lat, cost, stages) <= other * (1 + 1e-12)


def test_latency_partition_solves_long_sequences():
    """128k tokens on a 128-token grid (1024 blocks), k up to 16: a search over the grid, not
    over every cut (its speed is the benchmark's business, not a timed test's)."""
    for k in (8, 16):
        lengths = partition_sequence(131072, k, "latency", multiple=128, cost=EIGHT_B)
        assert sum(lengths) == 131072 and all(length % 128 == 0 for length in lengths)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(seq_len=3, num_subsequences=4), "num_subsequences = 4"),
        (dict(seq_len=64, num_subsequences=0), "num_subsequences = 0"),
        (dict(seq_len=100, num_subsequences=2, multiple=64), "not a multiple of 64"),
        (dict(seq_len=128, num_subsequences=4, multiple=64), "length_multiple"),
        (dict(seq_len=64, num_subsequences=2, method="latency?"), "partition = 'latency?'"),
        (dict(seq_len=64, num_subsequences=8, method="latency", multiple=16), "num_subsequences = 8"),
    ],
)
def test_bad_input_names_the_setting(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("?", r"\?")):
        partition_sequence(**kwargs, cost=DEBUG)


@pytest.mark.parametrize("method", ["compute", "latency"])
def test_cost_model_is_required(method):
    with pytest.raises(ValueError, match=f"the '{method}' partition needs a UnitCost"):
        partition_sequence(64, 2, method)


def test_document_pairs_are_those_of_random_packed_documents():
    """UnitCost's block-causal pair count against packed documents of exponentially spread
    lengths (mean D): the mean over 2000 random sequences, within 3%; and causal as D grows."""
    import numpy as np

    rng, d, seq_len = np.random.default_rng(0), 256, 4096
    cost = UnitCost(linear=0.0, attention=1.0, document_length=d)
    units = [(0, 1024), (1024, 1024), (3072, 1024)]
    counted = np.zeros(len(units))
    for _ in range(2000):
        starts = np.concatenate([[0], np.cumsum(np.maximum(1, np.round(rng.exponential(d, 64))))])
        starts = starts[starts < seq_len].astype(int)
        positions = np.arange(seq_len)
        keys = positions - starts[np.searchsorted(starts, positions, side="right") - 1] + 1
        counted += [keys[prefix : prefix + length].sum() / 2000 for prefix, length in units]
    for (prefix, length), mean in zip(units, counted):
        assert abs(cost.pairs(length, prefix) - mean) / mean < 0.03, (prefix, cost.pairs(length, prefix), mean)
    causal = UnitCost(linear=0.0, attention=1.0)
    huge = UnitCost(linear=0.0, attention=1.0, document_length=1e9)
    assert abs(huge.pairs(1024, 3072) / causal.pairs(1024, 3072) - 1) < 1e-5


def test_short_documents_even_out_the_compute_partition():
    """A unit's attention no longer grows with its offset once documents are short."""
    cut = {
        d: partition_sequence(
            4096, 4, "compute", multiple=64, cost=UnitCost.from_model_args(seq_llama3_flavors["debugmodel"], d)
        )
        for d in (None, 4096, 512, 64)
    }
    assert cut[None] == [1600, 960, 832, 704] and cut[64] == [1024] * 4
    spreads = [max(c) - min(c) for c in cut.values()]
    assert spreads == sorted(spreads, reverse=True)
