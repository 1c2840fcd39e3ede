"""torch.compile (torchtitan's per-block compile, inductor's C++ backend) through every
sequence schedule: exact against the eager full-sequence reference, a bounded number of
graphs, no graph break, and a mutation that still fails under compile.

Inductor compiles slowly on two cores (minutes, cold); its on-disk cache serves the
graphs these variants share. The eager exactness tests hold the wider matrix.
"""

import pytest

from harness import TOL, Variant, assert_breaks_exactness, assert_exact, run_variants

pytestmark = pytest.mark.slow

C = dict(compile="inductor", optimizer_steps=1)  # a second step: nothing recompiles after the first

PP2 = [
    Variant("seq1f1b-k4-compute", k=4, partition="compute", **C),
    # packed documents: the op reads them from the KV context; cut blocks copied (AC)
    Variant("seq1f1b-k3-compute-ac-full-documents", k=3, partition="compute", ac="full", documents=True, **C),
    Variant("seq1f1b-k3-compute-ac-selective-op", k=3, partition="compute", ac="selective:op", **C),
    Variant("seq1f1b-k3-compute-ac-memory_budget", k=3, partition="compute", ac="memory_budget", **C),
    Variant("interleaved-k3-compute", schedule="InterleavedSeq1F1B", k=3, partition="compute", **C),
    Variant("terapipe-k4-latency-documents", schedule="TeraPipe", k=4, partition="latency", documents=True, **C),
    Variant("bsipipe-k2-even", schedule="BSIPipe", k=2, **C),
    Variant("chimera-k2-even", schedule="Chimera", k=2, **C),
]
# The job check refuses compile with split backward (a compiled block is one autograd
# node: the weight pass would replay it).
PP2_FSDP_TP = [
    Variant("fsdp2-k4-compute", k=4, partition="compute", dp_shard=2, **C),
    # the first block's input is the embedding's reduce-scatter, not yet waited for: its gradient is
    # kept by torch_internals.keep_async_collective_input_grads
    Variant("tp2-k4-compute", k=4, partition="compute", tp=2, **C),
]
MUTATED = [
    Variant("prefix_dk_dropped", k=4, partition="compute", compile="inductor", mutation="prefix_dk_dropped"),
    Variant(
        "recompute_without_prefix",
        k=3,
        partition="compute",
        ac="full",
        compile="inductor",
        mutation="recompute_without_prefix",
        kernels=("top_left",),  # the prefix calls are the top-left kernel's
    ),
]


def _assert_compiled_once(r: dict) -> None:
    """The first step compiled every graph (one per distinct unit length per block at most,
    on each rank); later steps compiled none, and no block broke its graph."""
    assert r["graph_breaks"] == 0, r
    for graphs in r["graphs"]:
        assert graphs[0] > 0 and len(set(graphs)) == 1, r["graphs"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return {r["name"]: r for r in run_variants(PP2 + MUTATED, tmp_path_factory.mktemp("pp2"))}


@pytest.mark.parametrize("name", [v.name for v in PP2])
def test_compiled_equals_eager_full_sequence(results, name):
    r = results[name]
    assert_exact(r)
    _assert_compiled_once(r)


@pytest.mark.parametrize("name", [v.name for v in MUTATED])
def test_mutation_fails_under_compile(results, name):
    assert assert_breaks_exactness(results[name]) > 100 * TOL


def test_compiled_with_fsdp_and_with_tp(tmp_path):
    for r in run_variants(PP2_FSDP_TP, tmp_path):
        assert_exact(r)
        _assert_compiled_once(r)
