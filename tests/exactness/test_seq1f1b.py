"""Seq1F1B (and TeraPipe) against the single-process full-sequence reference, on gloo ranks.

Their mutations (each mechanism broken on purpose) are in test_mutations.py."""

import itertools

import pytest

from harness import Variant, assert_exact, run_variants

pytestmark = pytest.mark.slow

EXACT = [
    Variant(f"k{k}-{part}-{'IW' if split else 'B'}", k=k, partition=part, split_backward=split)
    for k, part, split in itertools.product((1, 2, 3, 4), ("even", "compute"), (False, True))
    if k > 1 or part == "even"  # one subsequence: both partitions are the whole sequence
] + [
    Variant("terapipe-k3-compute", schedule="TeraPipe", k=3, partition="compute"),
    Variant("terapipe-k4-even", schedule="TeraPipe", k=4),
    Variant("terapipe-k4-even-IW", schedule="TeraPipe", k=4, split_backward=True),
    # the microbatches given pre-split, as torch 2.14's step (and torchtitan 0.3) passes them
    Variant("k3-compute-pre-split-documents", k=3, partition="compute", documents=True, pre_split=True),
]


def _with_pp(variants, pp):
    return [Variant(**{**v.__dict__, "pp": pp, "name": f"pp{pp}-{v.name}"}) for v in variants]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"pp{p}")
def results(request, tmp_path_factory):
    pp = request.param
    variants = _with_pp(EXACT, pp)
    return {r["name"]: r for r in run_variants(variants, tmp_path_factory.mktemp(f"pp{pp}"))}


def test_exact_against_full_sequence(results):
    for r in results.values():
        assert_exact(r, n_losses=2)


def test_state_and_memory_do_not_grow(tmp_path):
    """30 steps with each kernel: nothing left in the KV context or alive for backward after any step."""
    (r,) = run_variants([Variant("30 steps", k=3, partition="compute", steps=30)], tmp_path)
    assert r["error"] is None, r["error"]
    assert r["kv_left"] == 0 and r["activations_left"] == 0
    for kernel in r["kernels"].values():  # each kernel's 30 steps
        for rank_peaks in kernel["peaks"]:
            assert len(rank_peaks) == 30 and len(set(rank_peaks)) == 1, (kernel["name"], rank_peaks)
