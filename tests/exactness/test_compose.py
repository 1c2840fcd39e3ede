"""Sequence schedules composed with torchtitan's activation checkpointing, FSDP2, TP and DCP."""

import pytest

from harness import Variant, assert_exact, run_variants

pytestmark = pytest.mark.slow

# Op-level selective AC allows one backward per region, so it cannot split backward into I and W
# (check_job refuses that pair).
AC = [
    Variant(f"{ac}-{split}", k=3, partition="compute", ac=ac, split_backward=split == "IW")
    for ac, split in [("full", "B"), ("full", "IW"), ("selective:1", "B"), ("selective:1", "IW"), ("selective:op", "B")]
] + [
    # every other schedule: GPipe order, several stages per rank, two chains sharing ranks
    Variant(f"{ac}-{schedule}", schedule=schedule, k=3, partition="compute", ac=ac)
    for schedule in ("TeraPipe", "InterleavedSeq1F1B", "BSIPipe", "Chimera")
    for ac in ("full", "selective:1")
]
FSDP_TP = {
    (dp_shard, tp): [
        Variant(
            f"fsdp{dp_shard}-tp{tp}-{part}-{split}",
            k=4,
            partition=part,
            dp_shard=dp_shard,
            tp=tp,
            seq_len=64,
            split_backward=split == "IW",
            microbatches=2,
        )
        for part, split in [("even", "B"), ("compute", "B"), ("compute", "IW")]
    ]
    for dp_shard, tp in [(2, 1), (1, 2), (2, 2)]
}
# TeraPipe (GPipe order) and InterleavedSeq1F1B (two stages per rank) share Seq1F1B's runtime but not its
# order: FSDP's unshard/reshard and reduction and TP's collectives run at other points. pp2 x fsdp2 and
# pp2 x tp2 both take 4 ranks, so one process group runs them all.
ORDERS_FSDP_TP = [
    Variant(
        f"{schedule}-fsdp{dp_shard}-tp{tp}-{split}",
        schedule=schedule,
        k=4,
        partition="compute",
        dp_shard=dp_shard,
        tp=tp,
        seq_len=64,
        split_backward=split == "IW",
        microbatches=2,
    )
    for schedule in ("TeraPipe", "InterleavedSeq1F1B")
    for dp_shard, tp in [(2, 1), (1, 2)]
    for split in ("B", "IW")
]


@pytest.fixture(scope="module")
def ac_results(tmp_path_factory):
    return {r["name"]: r for r in run_variants(AC, tmp_path_factory.mktemp("ac"))}


def test_activation_checkpointing_is_exact(ac_results):
    for r in ac_results.values():
        assert_exact(r, n_losses=2)


@pytest.mark.parametrize("dp_shard,tp", [(2, 1), (1, 2), (2, 2)], ids=["pp2-fsdp2", "pp2-tp2", "pp2-fsdp2-tp2"])
def test_fsdp_and_tp_are_exact(dp_shard, tp, tmp_path):
    for r in run_variants(FSDP_TP[dp_shard, tp], tmp_path):
        assert_exact(r, n_losses=2)


def test_fsdp_and_tp_are_exact_with_terapipe_and_interleaved(tmp_path):
    for r in run_variants(ORDERS_FSDP_TP, tmp_path):
        assert_exact(r, n_losses=2)
