"""Under torchtitan 0.3 every sequence schedule composes as Seq1F1B does: the README's composition matrix,
schedule by schedule, against the whole-sequence reference in the 0.3 harness.

test_titan03_harness.py holds Seq1F1B's compositions and each schedule's orders; these are the other
schedules' (TeraPipe, InterleavedSeq1F1B, BSIPipe, Chimera) with each setting of the matrix, several
settings a variant where they compose (the matrix's cells are checked against these lists by
tests/unit/test_composition_matrix.py). The compiled variants run dynamo and AOTAutograd without
inductor's code generation (``aot_eager``; the memory budget's min-cut partition with
``aot_eager_decomp_partition``), which Seq1F1B's end-to-end run under 0.3 and 0.2.2's grid compile with
inductor: what a schedule changes is the graphs' inputs and order, not the generated kernels.
"""

from __future__ import annotations

import time

import pytest

from harness import Variant, assert_exact, run_variants
from torchtitan_seq.titan.version import TITAN_03

pytestmark = [pytest.mark.skipif(not TITAN_03, reason="the harness's 0.3 side needs torchtitan 0.3"), pytest.mark.slow]

# Per schedule, the keywords its variants share: BSIPipe and Chimera run two microbatch chains (k 2 keeps
# their units at 16 tokens); the orders that split backward (TeraPipe, InterleavedSeq1F1B) do so too.
SCHEDULES = {
    "TeraPipe": dict(k=4, partition="compute"),
    "InterleavedSeq1F1B": dict(k=4, partition="compute"),
    "BSIPipe": dict(k=2),
    "Chimera": dict(k=2),
}
SPLITS = {"TeraPipe", "InterleavedSeq1F1B"}


def _each(name: str, **settings) -> list[Variant]:
    return [Variant(f"{s}-{name}", schedule=s, **{**kw, **settings}) for s, kw in SCHEDULES.items()]


TWO_RANKS = [
    *(
        Variant(
            f"{s}-ac-full-documents{'-split' if s in SPLITS else ''}",
            schedule=s,
            ac="full",
            documents=True,
            split_backward=s in SPLITS,
            **kw,
        )
        for s, kw in SCHEDULES.items()
    ),  # fmt: skip
    *_each("ac-selective", ac="selective"),
    *_each("compiled", compile="aot_eager", optimizer_steps=1),
    Variant("Seq1F1B-compiled", k=4, partition="compute", compile="aot_eager", optimizer_steps=1),
]
FOUR_RANKS = [
    *_each("fsdp2", dp_shard=2, seq_len=64),
    *_each("tp2", tp=2, seq_len=64),
    *_each("compiled-tp2", tp=2, seq_len=64, compile="aot_eager", optimizer_steps=1),
    Variant("Seq1F1B-compiled-tp2", k=4, partition="compute", tp=2, seq_len=64, compile="aot_eager", optimizer_steps=1),
    # the unit attention op reads the gathered K/V from the KV context inside the compiled backward
    *_each("compiled-cp2", cp=2, seq_len=64, compile="aot_eager", optimizer_steps=1),
    Variant("Seq1F1B-compiled-cp2", k=4, partition="compute", cp=2, seq_len=64, compile="aot_eager", optimizer_steps=1),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = {}
    for variants in (TWO_RANKS, FOUR_RANKS):
        start = time.perf_counter()
        out.update({r["name"]: r for r in run_variants(variants, tmp_path_factory.mktemp("titan03_compositions"))})
        print(f"{len(variants)} variants on {variants[0].world} ranks: {time.perf_counter() - start:.1f} s")
    return out


@pytest.mark.parametrize("name", [v.name for v in TWO_RANKS + FOUR_RANKS])
def test_exact_against_the_whole_sequence(results, name):
    r = results[name]
    assert_exact(r, n_losses=2)  # one a microbatch
    print(f"{name}: loss {r['loss_rel']:.2g}, gradients {r['grad_rel']:.2g} (worst {r['worst_param']})")
