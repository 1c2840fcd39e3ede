"""Under torchtitan 0.3 the sequence schedules are exact as under 0.2.2, checked by the same harness.

The exactness harness (:mod:`harness`, its torchtitan side :mod:`harness_titan`) builds 0.3's Llama 3
with torchtitan_seq's inner attention, cuts it as :mod:`torchtitan_seq.titan.v03.pipeline` does,
parallelises each chunk with the model spec's ``parallelize_fn`` and runs each variant on gloo ranks
against the whole-sequence reference, with both kernels and the host-read check, as
``tests/exactness/`` does under 0.2.2 (whose variants these mirror). Mutations that must break
exactness keep the check honest. The variants run in two process groups (2 ranks, then 4).
"""

from __future__ import annotations

import time

import pytest

from harness import TOL, Variant, assert_breaks_exactness, assert_exact, run_variants
from torchtitan_seq.titan.version import TITAN_03

pytestmark = [pytest.mark.skipif(not TITAN_03, reason="the harness's 0.3 side needs torchtitan 0.3"), pytest.mark.slow]

TWO_RANKS = [
    *(
        Variant(f"seq1f1b-k{k}-{partition}{'-split' if split else ''}", k=k, partition=partition, split_backward=split)
        for k in (1, 3, 4)
        for partition in ("even", "compute")
        for split in (False, True)
        if k > 1 or partition == "even"  # one unit: the partitions agree
    ),
    Variant("interleaved-k3", schedule="InterleavedSeq1F1B", k=3, partition="compute"),
    Variant("interleaved-k4-split", schedule="InterleavedSeq1F1B", k=4, split_backward=True),
    Variant("bsipipe-k2-copies", schedule="BSIPipe", k=2, optimizer_steps=2),
    Variant("chimera-k2-copies", schedule="Chimera", k=2, optimizer_steps=2),
    Variant("terapipe-k4", schedule="TeraPipe", k=4, partition="compute"),
    Variant("documents-k4-compute", k=4, partition="compute", documents=True),
    Variant("documents-interleaved-k3", schedule="InterleavedSeq1F1B", k=3, documents=True),
    Variant("ac-full-k3", k=3, partition="compute", ac="full"),
    # 0.3's selective AC is op-level: one backward per region, so no split backward (the job check refuses it)
    Variant("ac-selective-k4", k=4, ac="selective"),
    # broken on purpose: each must miss the reference
    Variant("mutation-prefix_dk_dropped", k=4, mutation="prefix_dk_dropped"),
    Variant("mutation-rope_offset", k=4, mutation="rope_offset"),
    Variant("mutation-backward_order", k=4, mutation="backward_order"),
    Variant("mutation-across_documents", k=4, documents=True, mutation="across_documents"),
    Variant("mutation-copies_not_synced", schedule="BSIPipe", k=2, optimizer_steps=3, mutation="copies_not_synced"),
]
FOUR_RANKS = [
    Variant("fsdp2-k4-compute", k=4, partition="compute", dp_shard=2),
    Variant("tp2-k4", k=4, tp=2, seq_len=64),
]
MUTATED = [v.name for v in TWO_RANKS + FOUR_RANKS if v.mutation]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = {}
    for variants in (TWO_RANKS, FOUR_RANKS):
        start = time.perf_counter()
        out.update({r["name"]: r for r in run_variants(variants, tmp_path_factory.mktemp("titan03_harness"))})
        print(f"{len(variants)} variants on {variants[0].world} ranks: {time.perf_counter() - start:.1f} s")
    return out


@pytest.mark.parametrize("name", [v.name for v in TWO_RANKS + FOUR_RANKS if not v.mutation])
def test_exact_against_the_whole_sequence(results, name):
    r = results[name]
    assert_exact(r)
    print(f"{name}: loss {r['loss_rel']:.2g}, gradients {r['grad_rel']:.2g} (worst {r['worst_param']})")


@pytest.mark.parametrize("name", MUTATED)
def test_a_mutation_breaks_exactness(results, name):
    error = assert_breaks_exactness(results[name])
    print(f"{name}: relative error {error:.3g} ({error / TOL:.0f}x the tolerance)")
