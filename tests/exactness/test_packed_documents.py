"""Packed documents (block-causal attention) through every sequence schedule, against the
single-process whole-sequence reference with a dense document mask, on gloo ranks.

The layouts (``harness.DOCUMENT_LAYOUTS``) hold a document that spans several units,
one that ends exactly at a unit boundary, a unit holding several whole documents,
one-token documents, a sequence that is one document and a sequence with no EOS.
The mutation of a unit attending across a document boundary is in test_mutations.py.
"""

import pytest

from harness import Variant, assert_exact, run_variants

pytestmark = pytest.mark.slow

EXACT = [
    Variant("seq1f1b-k4-even", k=4, documents=True, optimizer_steps=1),
    Variant("seq1f1b-k3-compute", k=3, partition="compute", documents=True),
    Variant("seq1f1b-k4-IW", k=4, split_backward=True, documents=True),
    Variant("seq1f1b-k4-ac-full", k=4, ac="full", documents=True),
    Variant("terapipe-k4", schedule="TeraPipe", k=4, documents=True),
    Variant("interleaved-k4", schedule="InterleavedSeq1F1B", k=4, documents=True),
    Variant("bsipipe-k2", schedule="BSIPipe", k=2, documents=True, optimizer_steps=1),
    Variant("bsipipe-k4", schedule="BSIPipe", k=4, seq_len=64, documents=True),
    Variant("chimera-k3-compute", schedule="Chimera", k=3, partition="compute", documents=True),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return {r["name"]: r for r in run_variants(EXACT, tmp_path_factory.mktemp("documents"))}


@pytest.mark.parametrize("name", [v.name for v in EXACT])
def test_exact_against_dense_document_mask(results, name):
    assert_exact(results[name], n_losses=2)
