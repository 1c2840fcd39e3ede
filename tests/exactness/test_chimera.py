"""Chimera against the single-process full-sequence reference: loss and gradients, mirrored
copies kept identical, composed with TP and FSDP2."""

import pytest

from harness import Variant, assert_exact, run_variants

pytestmark = pytest.mark.slow


def _chimera(name: str, **kw) -> Variant:
    # p chunks (one per rank and direction) of the 4-layer model.
    return Variant(name, schedule="Chimera", **kw)


# One process group per world size: pp=2 on 2 ranks; pp=4, pp=2 x tp=2 and pp=2 x dp_shard=2 on 4.
WORLDS = {
    2: [
        _chimera("pp2-k1-even", k=1),
        _chimera("pp2-k2-even", k=2),  # the clean twin of the mutations' (test_mutations.py)
        _chimera("pp2-k3-compute", k=3, partition="compute"),
        _chimera("pp2-k2-N4", k=2, microbatches=4),
        _chimera("pp2-k2-copies", k=2, optimizer_steps=3),
    ],
    4: [
        _chimera("pp4-k1-even", pp=4, k=1),
        _chimera("pp4-k3-compute-N4-copies", pp=4, k=3, partition="compute", microbatches=4, optimizer_steps=1),
        # TP shards the heads (each KV context holds its rank's), the pairs combine the shards.
        _chimera("pp2-tp2-k2-copies", tp=2, k=2, optimizer_steps=1),
        # FSDP2 reduces once per step, then the pairs combine the reduced shards.
        _chimera("pp2-fsdp2-k2", dp_shard=2, k=2),
    ],
}


@pytest.fixture(scope="module", params=sorted(WORLDS), ids=lambda w: f"{w}ranks")
def results(request, tmp_path_factory):
    world = request.param
    return {r["name"]: r for r in run_variants(WORLDS[world], tmp_path_factory.mktemp(f"world{world}"))}


def test_exact_against_full_sequence(results):
    """Loss and every gradient (each chunk's, found on its chain-A copy) equal the reference;
    the chain-B copies keep no gradient, so an optimizer steps each chunk once."""
    for name, r in results.items():
        assert_exact(r, n_losses=4 if "N4" in name else 2)
        assert r["mirror_grads"] == 0, r


def test_copies_stay_identical_over_optimizer_steps(results):
    """After each SGD step the copies are identical, and the step after them equals the
    reference trained by the same steps (test_exact_against_full_sequence)."""
    copies = [r for name, r in results.items() if "copies" in name]
    assert copies
    for r in copies:
        assert r["error"] is None, r["error"]
        assert r["copies_diff"] and set(r["copies_diff"]) == {0.0}, r
