"""torch.compile (torchtitan's per-block compile, inductor) with context parallelism inside units (pp 2 x
cp 2) through every sequence schedule, against the eager whole-sequence reference.

A compiled block saves what its graph computed (each CP rank's share of the unit's K/V), not the unit's
gathered K/V; unit attention stays outside the graph (a custom op), and its backward reads the gathered
K/V where the KV context's slab holds them, then reduce-scatters their gradient to each rank's share.
"""

import pytest

from harness import Variant, assert_breaks_exactness, assert_exact, run_variants

pytestmark = pytest.mark.slow

C = dict(compile="inductor", cp=2, seq_len=64, optimizer_steps=1)  # a second step: nothing recompiles
VARIANTS = [
    Variant("seq1f1b-k4-compute", k=4, partition="compute", **C),
    Variant("seq1f1b-k3-ac-full-documents", k=3, partition="compute", ac="full", documents=True, **C),
    Variant("interleaved-k3-compute", schedule="InterleavedSeq1F1B", k=3, partition="compute", **C),
    Variant("terapipe-k4-even", schedule="TeraPipe", k=4, **C),
    Variant("bsipipe-k2-even", schedule="BSIPipe", k=2, **C),
    Variant("chimera-k3-compute", schedule="Chimera", k=3, partition="compute", **C),
    # the K/V gradient left unreduced over the CP ranks must fail under compile too
    Variant("cp_kv_grads_local", k=3, partition="compute", mutation="cp_kv_grads_local", **C),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return {r["name"]: r for r in run_variants(VARIANTS, tmp_path_factory.mktemp("compile_cp"))}


@pytest.mark.parametrize("name", [v.name for v in VARIANTS if v.mutation is None])
def test_compiled_units_under_context_parallelism_are_exact(results, name):
    """Exact, every graph compiled in the first step (none after it), no graph break."""
    r = results[name]
    assert_exact(r, n_losses=2)
    assert r["graph_breaks"] == 0, r
    assert all(graphs[0] > 0 and len(set(graphs)) == 1 for graphs in r["graphs"]), r["graphs"]


def test_a_mutation_still_breaks_exactness_under_compile(results):
    assert_breaks_exactness(results["cp_kv_grads_local"])
