"""Every mechanism of exactness, broken on purpose, misses the reference by a wide margin.

Each test runs a real multi-rank schedule with one mutation (:mod:`mutations`)
through the exactness harness and asserts that the loss or some parameter's
gradient is off by more than 100x the tolerance, relative to its own scale.
The clean twin of every variant (the same variant without its mutation)
passes the same comparison in the exactness tests (test_seq1f1b.py,
test_interleaved.py, test_compose.py, test_bsipipe.py, test_chimera.py,
test_packed_documents.py, test_context_parallel.py), so what fails here is
the mutation alone.
"""

import pytest

from harness import TOL, Variant, assert_breaks_exactness, assert_exact, run_variants
from mutations import MUTATIONS

pytestmark = pytest.mark.slow

# A mutation runs with each kernel whose path holds the mechanism it breaks (both by default), and
# must break exactness with each. These hold on one path only: the prefix calls (unmasked, apart from
# the diagonal's) are the top-left kernel's; the one call over prefix and own keys the bottom-right kernel's.
TOP_LEFT, BOTTOM_RIGHT = ("top_left",), ("bottom_right",)
TWO_RANKS = [
    Variant("host_read_in_units", k=2, optimizer_steps=1, mutation="host_read_in_units"),
    Variant("prefix_dk_dropped", k=4, mutation="prefix_dk_dropped"),
    Variant("prefix_dv_dropped", k=4, mutation="prefix_dv_dropped"),
    Variant("prefix_dq_dropped", k=4, mutation="prefix_dq_dropped", kernels=TOP_LEFT),
    Variant("rope_offset", k=4, mutation="rope_offset"),
    Variant("backward_order", k=4, mutation="backward_order"),
    Variant("backward_order-interleaved", schedule="InterleavedSeq1F1B", k=4, mutation="backward_order"),
    Variant("backward_order-terapipe", schedule="TeraPipe", k=4, mutation="backward_order"),
    Variant("unit_mean_loss", k=3, partition="compute", mutation="unit_mean_loss"),
    Variant(
        "recompute_without_prefix",
        k=3,
        partition="compute",
        ac="full",
        mutation="recompute_without_prefix",
        kernels=TOP_LEFT,
    ),
    Variant("split_w_without_kv_grad", k=4, split_backward=True, mutation="split_w_without_kv_grad"),
    Variant("pairs_not_combined-bsipipe", schedule="BSIPipe", k=2, mutation="pairs_not_combined"),
    Variant("copies_not_synced-bsipipe", schedule="BSIPipe", k=2, optimizer_steps=3, mutation="copies_not_synced"),
    Variant("pairs_not_combined-chimera", schedule="Chimera", k=2, mutation="pairs_not_combined"),
    Variant("copies_not_synced-chimera", schedule="Chimera", k=2, optimizer_steps=3, mutation="copies_not_synced"),
    Variant("across_documents", k=4, documents=True, mutation="across_documents"),
    Variant("slab_offset", k=4, partition="compute", mutation="slab_offset"),
    Variant(
        "bottom_right_descending", k=4, partition="compute", kernels=BOTTOM_RIGHT, mutation="bottom_right_descending"
    ),
    Variant(
        "kv_offload_not_copied_out",
        schedule="InterleavedSeq1F1B",
        k=4,
        kv_offload=True,
        mutation="kv_offload_not_copied_out",
    ),
]
FOUR_RANKS = [
    Variant("tp_wrong_shard", k=4, tp=2, seq_len=64, mutation="tp_wrong_shard"),
    # pp 2 x cp 2
    Variant("cp_shard_left_out", k=3, partition="compute", cp=2, seq_len=48, mutation="cp_shard_left_out"),
    Variant("cp_kv_grads_local", k=3, partition="compute", cp=2, seq_len=48, mutation="cp_kv_grads_local"),
    Variant("cp_second_chunk_positions", k=4, cp=2, seq_len=64, mutation="cp_second_chunk_positions"),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = {}
    for variants in (TWO_RANKS, FOUR_RANKS):
        out.update({r["name"]: r for r in run_variants(variants, tmp_path_factory.mktemp("mutations"))})
    return out


# Mutations of what only an MoE model has, exercised on Qwen3 MoE in test_families.py.
MOE_ONLY = {"inference_counts_kept"}
# Mutations of what only another family has (sliding windows and their copied slabs, sinks, MLA's decoupled RoPE
# and latent, attention chunks), exercised on it in test_families.py.
FAMILY_ONLY = {
    "window_off_by_one",
    "reach_copy_last_key_zeroed",
    "sink_per_call",
    "mla_rope_at_sequence_positions",
    "chunk_boundary_at_unit_start",
    "latent_prefix_grad_dropped",
}
# HSDP's, exercised under torchtitan 0.3 (tests/titan03/test_titan03_harness.py), whose replicas need no shards;
# 0.2.2 pipelines replicas only over FSDP2's shards (without them they are its DDP), on 8 ranks.
HSDP_ONLY = {"replicas_not_reduced"}


def test_every_mutation_is_exercised():
    assert {v.mutation for v in TWO_RANKS + FOUR_RANKS} | MOE_ONLY | FAMILY_ONLY | HSDP_ONLY == set(MUTATIONS)


def _check(results, name: str) -> None:
    assert_breaks_exactness(results[name])
    for kernel, r in results[name]["kernels"].items():
        error = max(r["grad_rel"], r["loss_rel"])
        print(f"{name} [{kernel}]: relative error {error:.3g} ({error / TOL:.0f}x the tolerance)")


def test_host_read_in_units(results):
    """Exact, but a unit reads a tensor on the host: the host-read check of every exactness test
    (assert_exact, host_reads.py) fails on it, with each kernel."""
    r = results["host_read_in_units"]
    assert all(k["host_reads"] and k["grad_rel"] <= TOL for k in r["kernels"].values()), r["kernels"]
    with pytest.raises(AssertionError, match="read on the host during the units"):
        assert_exact(r)


def test_prefix_dk_dropped(results):
    _check(results, "prefix_dk_dropped")


def test_prefix_dv_dropped(results):
    _check(results, "prefix_dv_dropped")


def test_prefix_dq_dropped(results):
    _check(results, "prefix_dq_dropped")


def test_rope_offset_wrong_after_the_first_unit(results):
    _check(results, "rope_offset")


@pytest.mark.parametrize("name", ["backward_order", "backward_order-interleaved", "backward_order-terapipe"])
def test_backward_first_subsequence_first(results, name):
    _check(results, name)


def test_per_unit_mean_loss(results):
    _check(results, "unit_mean_loss")


def test_recomputation_without_the_recorded_prefix(results):
    _check(results, "recompute_without_prefix")


def test_split_backward_w_pass_without_kv_gradient(results):
    _check(results, "split_w_without_kv_grad")


def test_tensor_parallel_kv_of_the_wrong_shard(results):
    _check(results, "tp_wrong_shard")


@pytest.mark.parametrize("schedule", ["bsipipe", "chimera"])
def test_mirrored_pair_gradients_not_combined(results, schedule):
    _check(results, f"pairs_not_combined-{schedule}")


@pytest.mark.parametrize("schedule", ["bsipipe", "chimera"])
def test_mirror_copies_not_resynchronised_after_the_optimizer_step(results, schedule):
    """Judged against the reference trained by the same SGD steps in one process, not by
    comparing the copies with the code that syncs them."""
    _check(results, f"copies_not_synced-{schedule}")


def test_unit_attending_across_a_document_boundary(results):
    """Packed documents: queries read the whole prefix, earlier documents included."""
    _check(results, "across_documents")


def test_unit_writing_its_kv_at_the_wrong_slab_offset(results):
    """Units after the first write their K/V into the slab one position early."""
    _check(results, "slab_offset")


def test_bottom_right_kernel_reading_a_descending_slab(results):
    """A kernel that aligns causal masks bottom-right (flash-attn's, torch's CUDA flash kernel) makes its
    one call over a slab an arena holds from the top: it reads prefix and own keys last position first."""
    _check(results, "bottom_right_descending")


def test_kv_offload_copying_stale_kv_back(results):
    """The K/V offload frees an arena without copying it out: the units that read it next read zeros."""
    _check(results, "kv_offload_not_copied_out")


def test_context_parallel_kv_shard_left_out_of_the_gather(results):
    _check(results, "cp_shard_left_out")


def test_context_parallel_kv_gradients_not_reduce_scattered(results):
    _check(results, "cp_kv_grads_local")


def test_context_parallel_second_chunk_positions_off(results):
    _check(results, "cp_second_chunk_positions")
