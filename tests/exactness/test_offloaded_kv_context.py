"""K/V offload (``sequence_pipeline.kv_offload``) against the single-process full-sequence reference, on
gloo ranks: Seq1F1B (4 ranks, where the first ranks' arenas lie unread between a microbatch's forwards and
backwards), InterleavedSeq1F1B and BSIPipe (2 ranks, arenas unread between the chunks' units), each with an
arena offloaded at least once on some stage (:func:`_spans`). The mutation that
copies stale K/V back (``kv_offload_not_copied_out``) is in test_mutations.py."""

import pytest

from harness import Variant, assert_exact, run_variants
from torchtitan_seq.runtime.kv_offload import arena_of, offload_spans
from torchtitan_seq.runtime.kv_placement import plan_arenas
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, ScheduleShape
from torchtitan_seq.schedules.ordering import B, F, I, W, stage_passes

TWO_RANKS = [
    Variant("interleaved-k4", schedule="InterleavedSeq1F1B", k=4, kv_offload=True),
    Variant("interleaved-k4-IW", schedule="InterleavedSeq1F1B", k=4, split_backward=True, kv_offload=True),
    Variant(
        "interleaved-k3-compute-ac", schedule="InterleavedSeq1F1B", k=3, partition="compute", ac="full", kv_offload=True
    ),
    Variant("bsipipe-k4-N4", schedule="BSIPipe", k=4, microbatches=4, layers=4, kv_offload=True),
]
FOUR_RANKS = [
    Variant("seq1f1b-pp4-k2-N4", pp=4, k=2, microbatches=4, kv_offload=True),
    Variant("seq1f1b-pp4-k4-N4-compute", pp=4, k=4, microbatches=4, partition="compute", kv_offload=True),
]


def _spans(v: Variant) -> int:
    """Offload spans over every stage of ``v``, planned as its stages plan them."""
    cls = SEQUENCE_SCHEDULES[v.schedule]
    order = cls.compute_order(ScheduleShape(v.pp, v.microbatches, v.k, v.split_backward))
    lengths = [v.seq_len // v.k] * v.k
    count = 0
    for actions in order.values():
        for stage in {a.stage_index for a in actions if a is not None}:
            plan = plan_arenas(stage_passes(actions, stage, v.k)[1], lengths, sum(lengths[:-1]))
            touches = stage_passes(actions, stage, v.k, (F, I, B, W))[1]
            count += len(offload_spans([m for _, m, _ in touches], arena_of(plan)))
    return count


@pytest.mark.parametrize("v", TWO_RANKS + FOUR_RANKS, ids=lambda v: v.name)
def test_each_variant_offloads(v):
    """Quick: every variant takes some arena to the host (planned at even lengths)."""
    assert _spans(v) > 0


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = {}
    for variants in (TWO_RANKS, FOUR_RANKS):
        out.update({r["name"]: r for r in run_variants(variants, tmp_path_factory.mktemp("kv_offload"))})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", [v.name for v in TWO_RANKS + FOUR_RANKS])
def test_offloaded_kv_context_is_exact(results, name):
    r = results[name]
    assert_exact(r, n_losses=next(v.microbatches for v in TWO_RANKS + FOUR_RANKS if v.name == name))
