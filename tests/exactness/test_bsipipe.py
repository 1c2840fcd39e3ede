"""BSIPipe against the single-process full-sequence reference: loss and gradients, mirrored
copies kept identical, composed with TP and FSDP2."""

import pytest

from harness import Variant, assert_exact, run_variants


def _bsi(name: str, pp: int, **kw) -> Variant:
    # 2p chunks of at least one layer each (torchtitan counts embeddings and output as one layer).
    return Variant(f"pp{pp}-{name}", schedule="BSIPipe", pp=pp, layers=2 * pp, **kw)


def _variants(pp: int) -> list[Variant]:
    return [
        *[
            _bsi(f"k{k}-{part}", pp, k=k, partition=part)
            for k, part in ((1, "even"), (2, "even"), (3, "even"), (2, "compute"), (3, "compute"))
        ],
        _bsi("k2-N4", pp, k=2, microbatches=4),
        _bsi("copies", pp, k=2, optimizer_steps=3),
        _bsi("k2-pre-split", pp, k=2, pre_split=True),  # step(arg_mbs=..., ...), torch 2.14's form
    ]


EXACT = {pp: _variants(pp) for pp in (2, 4)}
# 4 ranks: pp=2 x tp=2 (TP shards the heads, each KV context holds its rank's) and pp=2 x dp_shard=2 (FSDP2
# reduces once per step; the pairs combine the shards).
TP_FSDP = [
    Variant("pp2-tp2-k2", schedule="BSIPipe", pp=2, tp=2, k=2, layers=4),
    Variant("pp2-tp2-copies", schedule="BSIPipe", pp=2, tp=2, k=2, layers=4, optimizer_steps=3),
    Variant("pp2-fsdp2-k2", schedule="BSIPipe", pp=2, dp_shard=2, k=2, layers=4),
]


@pytest.fixture(scope="module", params=[pytest.param(p, marks=pytest.mark.slow) for p in EXACT], ids=lambda p: f"pp{p}")
def results(request, tmp_path_factory):
    pp = request.param
    return {r["name"]: r for r in run_variants(EXACT[pp], tmp_path_factory.mktemp(f"pp{pp}"))}


def test_exact_against_full_sequence(results):
    """Loss and every gradient (each chunk's, found on its chain-A copy) equal the reference;
    the chain-B copies keep no gradient, so an optimizer steps each chunk once."""
    for name, r in results.items():
        assert_exact(r, n_losses=4 if name.endswith("N4") else 2)
        assert r["mirror_grads"] == 0, r


def test_copies_stay_identical_over_optimizer_steps(results):
    """After each of 3 SGD steps the copies are identical, and the step after them equals the
    reference trained by the same steps (test_exact_against_full_sequence)."""
    r = next(r for name, r in results.items() if "copies" in name)
    assert r["error"] is None, r["error"]
    assert r["copies_diff"] == [0.0, 0.0, 0.0], r


@pytest.mark.slow
def test_tensor_parallel_and_fsdp_match_the_reference(tmp_path):
    """:data:`TP_FSDP` against the reference, the copies identical after each step."""
    tp, copies, fsdp = run_variants(TP_FSDP, tmp_path)
    assert_exact(tp, n_losses=2)
    assert_exact(copies, n_losses=2)
    assert copies["copies_diff"] == [0.0, 0.0, 0.0], copies
    assert_exact(fsdp, n_losses=2)
