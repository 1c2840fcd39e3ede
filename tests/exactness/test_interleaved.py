"""InterleavedSeq1F1B (Seq1F1B-I) against the single-process full-sequence reference, on gloo ranks."""

import itertools

import pytest

from harness import Variant, assert_exact, run_variants

_SEQ1F1B = [
    Variant(f"k{k}-{part}", k=k, partition=part)
    for k, part in itertools.product((1, 2, 3, 4), ("even", "compute"))
    if k > 1 or part == "even"  # one subsequence: both partitions are the whole sequence
] + [
    Variant("k3-compute-IW", k=3, partition="compute", split_backward=True),
    Variant("k2-even-N3", k=2, microbatches=3),  # N not a multiple of p: a shorter last round or spread
]


def _interleaved(variants, pp):
    # 2 pp stages of at least one layer each (torchtitan counts embeddings and output as one layer).
    return [
        Variant(
            **{**v.__dict__, "pp": pp, "schedule": "InterleavedSeq1F1B", "layers": 2 * pp, "name": f"pp{pp}-{v.name}"}
        )
        for v in variants
    ]


EXACT = {pp: _interleaved(_SEQ1F1B, pp) for pp in (2, 4)}


@pytest.fixture(scope="module", params=[pytest.param(p, marks=pytest.mark.slow) for p in EXACT], ids=lambda p: f"pp{p}")
def results(request, tmp_path_factory):
    pp = request.param
    return {r["name"]: r for r in run_variants(EXACT[pp], tmp_path_factory.mktemp(f"pp{pp}"))}


def test_exact_against_full_sequence(results):
    for name, r in results.items():
        assert_exact(r, n_losses=(3 if name.endswith("N3") else 2))
