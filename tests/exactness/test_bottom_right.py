"""The one-call path of a kernel that aligns causal masks bottom-right (flash-attn's on a GPU), on CPU
ranks: :class:`bottom_right.BottomRightCpuKernel` reads a unit's prefix and own keys in one causal
call from ascending slabs in shared arenas. Every schedule, causal and block-causal, split backward,
recomputation and CP, against the single-process whole-sequence reference (tests/harness.py)."""

import pytest

from harness import Variant, assert_exact, run_variants

pytestmark = pytest.mark.slow

BR = dict(kernel="bottom_right")
TWO_RANKS = [
    Variant("seq1f1b-k4-even", k=4, **BR),
    Variant("seq1f1b-k3-compute", k=3, partition="compute", **BR),
    Variant("seq1f1b-k4-documents", k=4, documents=True, **BR),
    Variant("seq1f1b-k4-IW", k=4, split_backward=True, **BR),
    Variant("seq1f1b-k3-ac-full-documents", k=3, partition="compute", ac="full", documents=True, **BR),
    Variant("interleaved-k3-compute", schedule="InterleavedSeq1F1B", k=3, partition="compute", **BR),
    Variant("terapipe-k4", schedule="TeraPipe", k=4, **BR),
    Variant("bsipipe-k2", schedule="BSIPipe", k=2, optimizer_steps=1, **BR),
    Variant("chimera-k3-compute", schedule="Chimera", k=3, partition="compute", **BR),
]
FOUR_RANKS = [  # pp 2 x cp 2
    Variant("cp2-seq1f1b-k3-compute", k=3, partition="compute", cp=2, seq_len=48, **BR),
    Variant("cp2-seq1f1b-k4-documents", k=4, documents=True, cp=2, seq_len=64, **BR),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = {}
    for variants in (TWO_RANKS, FOUR_RANKS):
        out.update({r["name"]: r for r in run_variants(variants, tmp_path_factory.mktemp("bottom_right"))})
    return out


@pytest.mark.parametrize("name", [v.name for v in TWO_RANKS + FOUR_RANKS])
def test_exact_against_full_sequence(results, name):
    assert_exact(results[name], n_losses=2)
