"""Context parallelism inside units (pp 2 x cp 2; with FSDP 2 or TP 2 on 8 ranks) through every
sequence schedule, against the single-process whole-sequence reference, on gloo ranks.

Each CP rank computes two chunks of every unit's queries and gathers the unit's K/V
(:mod:`torchtitan_seq.runtime.context_parallel`); torchtitan's ``parallelize_llama`` parallelises the chunks
as inside torchtitan (:func:`~torchtitan_seq.titan.v022.pipeline.chunk_parallel_dims`: FSDP over data-parallel x
CP ranks). The mutations (a share left out of the gather, K/V gradients not reduce-scattered, the
second chunk's RoPE positions off) are in test_mutations.py.
"""

import itertools

import pytest

from harness import Variant, assert_exact, run_variants

pytestmark = pytest.mark.slow

CP = dict(cp=2, seq_len=64)
FOUR_RANKS = [
    Variant(f"seq1f1b-k{k}-{part}", k=k, partition=part, **CP)
    for k, part in itertools.product((1, 2, 3, 4), ("even", "compute"))
    if k > 1 or part == "even"  # one subsequence: both partitions are the whole sequence
] + [
    # seq_len 48: the clean twin of two CP mutations (test_mutations.py)
    Variant("seq1f1b-k3-compute-48", k=3, partition="compute", cp=2, seq_len=48),
    Variant("seq1f1b-k4-IW", k=4, split_backward=True, **CP),
    Variant("seq1f1b-k3-ac-full", k=3, partition="compute", ac="full", **CP),
    Variant("seq1f1b-k3-ac-selective-1", k=3, partition="compute", ac="selective:1", **CP),
    Variant("seq1f1b-k3-ac-selective-op", k=3, partition="compute", ac="selective:op", **CP),
    Variant("seq1f1b-k4-documents", k=4, documents=True, **CP),
    Variant("seq1f1b-k3-documents-ac-full", k=3, partition="compute", documents=True, ac="full", **CP),
    Variant("interleaved-k3-compute", schedule="InterleavedSeq1F1B", k=3, partition="compute", **CP),
    Variant("terapipe-k4-even", schedule="TeraPipe", k=4, **CP),
    Variant("bsipipe-k2", schedule="BSIPipe", k=2, optimizer_steps=1, **CP),
    Variant("chimera-k3-compute", schedule="Chimera", k=3, partition="compute", **CP),
]
EIGHT_RANKS = [
    Variant("fsdp2-seq1f1b-k4-compute", k=4, partition="compute", dp_shard=2, **CP),
    Variant("tp2-seq1f1b-k2-even", k=2, tp=2, **CP),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = {}
    for variants in (FOUR_RANKS, EIGHT_RANKS):
        out.update({r["name"]: r for r in run_variants(variants, tmp_path_factory.mktemp("cp"))})
    return out


@pytest.mark.parametrize("name", [v.name for v in FOUR_RANKS + EIGHT_RANKS])
def test_exact_against_full_sequence(results, name):
    assert_exact(results[name], n_losses=2)
