"""The README's composition matrix, the cells no other grid holds: memory-budget AC and torch.compile with
TP for the schedules other than Seq1F1B, and replicated data parallelism (HSDP) for every schedule.

test_compile.py compiles each schedule with inductor; the compiled variants here run dynamo and
AOTAutograd without inductor's code generation (``aot_eager``; the memory budget's min-cut partition with
``aot_eager_decomp_partition``): what a schedule changes is the graphs' inputs and order, not the kernels.
tests/unit/test_composition_matrix.py checks the matrix's cells against these lists.
"""

from __future__ import annotations

import pytest

from harness import Variant, assert_exact, run_variants

pytestmark = pytest.mark.slow

# Per schedule, the keywords its variants share: BSIPipe and Chimera run two microbatch chains.
SCHEDULES = {
    "Seq1F1B": dict(k=4, partition="compute"),
    "TeraPipe": dict(k=4, partition="compute"),
    "InterleavedSeq1F1B": dict(k=3, partition="compute"),
    "BSIPipe": dict(k=2),
    "Chimera": dict(k=2),
}
OTHERS = {s: kw for s, kw in SCHEDULES.items() if s != "Seq1F1B"}
C = dict(optimizer_steps=1)  # a second step: nothing recompiles after the first

WORLDS = {
    2: [
        Variant(f"{s}-memory-budget", schedule=s, ac="memory_budget", compile="aot_eager_decomp_partition", **C, **kw)
        for s, kw in OTHERS.items()
    ],
    4: [
        Variant(f"{s}-compiled-tp2", schedule=s, tp=2, seq_len=64, compile="aot_eager", **C, **kw)
        for s, kw in OTHERS.items()
    ],
    # two replicas of pp 2 x FSDP 2: each replica's shards reduce, then the replicas average
    8: [Variant(f"{s}-hsdp", schedule=s, dp_replicate=2, dp_shard=2, seq_len=64, **kw) for s, kw in SCHEDULES.items()],
}


@pytest.fixture(scope="module", params=sorted(WORLDS), ids=lambda w: f"{w}ranks")
def results(request, tmp_path_factory):
    world = request.param
    return run_variants(WORLDS[world], tmp_path_factory.mktemp(f"world{world}"))


def test_exact_against_full_sequence(results):
    for r in results:
        assert_exact(r, n_losses=2)
