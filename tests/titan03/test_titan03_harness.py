"""Under torchtitan 0.3 the sequence schedules are exact as under 0.2.2, checked by the same harness.

The exactness harness (:mod:`harness`, its torchtitan side :mod:`harness_titan`) builds 0.3's Llama 3
with torchtitan_seq's inner attention, cuts it as :mod:`torchtitan_seq.titan.v03.pipeline` does,
parallelises each chunk with the model spec's ``parallelize_fn`` and runs each variant on gloo ranks
against the whole-sequence reference, with both kernels and the host-read check, as
``tests/exactness/`` does under 0.2.2 (whose variants these mirror; on 4 ranks FSDP2, TP and context
parallelism through every schedule, on 8 context parallelism with FSDP2 or TP). Mutations that must break
exactness keep the check honest. Beside them HSDP (replicas of the chunks, alone on 4 ranks, with FSDP2's
shards or TP on 8), memory-budget activation checkpointing of compiled blocks and the validator's
forward-only pass (``evaluate``: the schedule's ``eval`` after the compared step). The variants run in
three process groups (2 ranks, 4, then 8).
"""

from __future__ import annotations

import time

import pytest

from harness import TOL, Variant, assert_breaks_exactness, assert_exact, run_variants
from torchtitan_seq.titan.version import TITAN_03

pytestmark = [pytest.mark.skipif(not TITAN_03, reason="the harness's 0.3 side needs torchtitan 0.3"), pytest.mark.slow]

COMPILED = dict(compile="inductor", optimizer_steps=1)  # as tests/exactness/test_compile.py compiles 0.2.2's
PARTITION = "aot_eager_decomp_partition"  # AOTAutograd's min-cut partition, without inductor's code generation
# Per schedule but Seq1F1B, the keywords of its variants of a setting: BSIPipe and Chimera run two chains.
OTHER_SCHEDULES = {
    "TeraPipe": dict(k=4, partition="compute"),
    "InterleavedSeq1F1B": dict(k=3, partition="compute"),
    "BSIPipe": dict(k=2),
    "Chimera": dict(k=2),
}
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
    # memory-budget AC: a setting of compile's partitioner, which then recomputes part of each compiled block,
    # unit attention included; beside it the same blocks compiled without it, which save more
    Variant("compiled-k3-compute", k=3, partition="compute", **COMPILED),
    Variant("ac-memory_budget-k3-compute", k=3, partition="compute", ac="memory_budget", **COMPILED),
    # the other schedules under the budget's min-cut partition, without inductor's code generation (as
    # tests/exactness/test_compositions.py runs 0.2.2's): what a schedule changes is the graphs' order
    *(
        Variant(f"{s}-ac-memory_budget", schedule=s, ac="memory_budget", compile=PARTITION, optimizer_steps=1, **kw)
        for s, kw in OTHER_SCHEDULES.items()
    ),
    # the validator's forward-only pass (the schedule's eval after the compared step): its loss too; BSIPipe's
    # V turns hand gradients over on the rank, in eval too (the job check refuses it)
    Variant("validate-documents-k4-compute", k=4, partition="compute", documents=True, evaluate=True),
    *(Variant(f"validate-{s}", schedule=s, evaluate=True, **kw) for s, kw in OTHER_SCHEDULES.items() if s != "BSIPipe"),
    # broken on purpose: each must miss the reference
    Variant("mutation-prefix_dk_dropped", k=4, mutation="prefix_dk_dropped"),
    Variant("mutation-rope_offset", k=4, mutation="rope_offset"),
    Variant("mutation-backward_order", k=4, mutation="backward_order"),
    Variant("mutation-across_documents", k=4, documents=True, mutation="across_documents"),
    Variant("mutation-copies_not_synced", schedule="BSIPipe", k=2, optimizer_steps=3, mutation="copies_not_synced"),
    Variant(
        "mutation-memory_budget-recompute_without_prefix",
        k=3,
        partition="compute",
        ac="memory_budget",
        mutation="recompute_without_prefix",
        kernels=("top_left",),  # the prefix calls are the top-left kernel's
        **COMPILED,
    ),
]
CP = dict(cp=2, seq_len=64)  # pp 2 x cp 2: each unit's queries over 2 CP ranks, which FSDP spans
FOUR_RANKS = [
    Variant("fsdp2-k4-compute", k=4, partition="compute", dp_shard=2),
    Variant("tp2-k4", k=4, tp=2, seq_len=64),
    # HSDP: 0.3's FSDP over (dp_replicate, fsdp), here 2 replicas of unsharded chunks, each its own rows
    Variant("hsdp2-k4-compute", k=4, partition="compute", dp_replicate=2, evaluate=True),
    Variant("validate-tp2-documents-k4", k=4, tp=2, seq_len=64, documents=True, evaluate=True),
    Variant("mutation-replicas_not_reduced", k=4, partition="compute", dp_replicate=2, mutation="replicas_not_reduced"),
    # context parallelism, as tests/exactness/test_context_parallel.py runs 0.2.2's
    Variant("cp2-seq1f1b-k4", k=4, **CP),
    Variant("cp2-seq1f1b-k3-compute-48", k=3, partition="compute", cp=2, seq_len=48),  # the mutations' twin
    Variant("cp2-seq1f1b-k4-split", k=4, split_backward=True, **CP),
    Variant("cp2-documents-k4-compute", k=4, partition="compute", documents=True, **CP),
    Variant("cp2-ac-full-k3", k=3, partition="compute", ac="full", **CP),
    Variant("cp2-interleaved-k3-compute", schedule="InterleavedSeq1F1B", k=3, partition="compute", **CP),
    Variant("cp2-terapipe-k4", schedule="TeraPipe", k=4, **CP),
    Variant("cp2-bsipipe-k2", schedule="BSIPipe", k=2, optimizer_steps=1, **CP),
    Variant("cp2-chimera-k3-compute", schedule="Chimera", k=3, partition="compute", **CP),
    Variant("cp2-qwen3-k4-compute", k=4, partition="compute", family="qwen3", **CP),
    # broken on purpose (tests/helpers/mutations.py): a share left out of the K/V gather, K/V gradients not
    # reduce-scattered, the second chunk's RoPE positions off
    Variant("mutation-cp_shard_left_out", k=3, partition="compute", cp=2, seq_len=48, mutation="cp_shard_left_out"),
    Variant("mutation-cp_kv_grads_local", k=3, partition="compute", cp=2, seq_len=48, mutation="cp_kv_grads_local"),
    Variant("mutation-cp_second_chunk_positions", k=4, mutation="cp_second_chunk_positions", **CP),
]
EIGHT_RANKS = [
    # context parallelism with FSDP2 (FSDP over 2 data-parallel x 2 CP ranks) and with TP
    Variant("cp2-fsdp2-seq1f1b-k4-compute", k=4, partition="compute", dp_shard=2, **CP),
    Variant("cp2-tp2-seq1f1b-k2-even", k=2, tp=2, **CP),
    # HSDP over FSDP2's shards: 2 replicas x 2 shards; and with TP
    Variant("hsdp2-fsdp2-k4-compute", k=4, partition="compute", dp_replicate=2, dp_shard=2),
    Variant("hsdp2-tp2-k4", k=4, dp_replicate=2, tp=2, seq_len=64),
    *(Variant(f"{s}-hsdp2-fsdp2", schedule=s, dp_replicate=2, dp_shard=2, **kw) for s, kw in OTHER_SCHEDULES.items()),
    Variant(
        "mutation-replicas_not_reduced-fsdp2",
        k=4,
        partition="compute",
        dp_replicate=2,
        dp_shard=2,
        mutation="replicas_not_reduced",
    ),
]
VARIANTS = TWO_RANKS + FOUR_RANKS + EIGHT_RANKS
MUTATED = [v.name for v in VARIANTS if v.mutation]
EVALUATED = {v.name: v.evaluate for v in VARIANTS}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = {}
    for variants in (TWO_RANKS, FOUR_RANKS, EIGHT_RANKS):
        start = time.perf_counter()
        out.update({r["name"]: r for r in run_variants(variants, tmp_path_factory.mktemp("titan03_harness"))})
        print(f"{len(variants)} variants on {variants[0].world} ranks: {time.perf_counter() - start:.1f} s")
    return out


@pytest.mark.parametrize("name", [v.name for v in VARIANTS if not v.mutation])
def test_exact_against_the_whole_sequence(results, name):
    r = results[name]
    assert_exact(r)
    assert (r["eval_loss_rel"] is not None) == EVALUATED[name], r  # the schedule's eval ran where asked for
    evaluated = "" if r["eval_loss_rel"] is None else f", eval's loss {r['eval_loss_rel']:.2g}"
    print(f"{name}: loss {r['loss_rel']:.2g}{evaluated}, gradients {r['grad_rel']:.2g} (worst {r['worst_param']})")


@pytest.mark.parametrize("name", MUTATED)
def test_a_mutation_breaks_exactness(results, name):
    error = assert_breaks_exactness(results[name])
    print(f"{name}: relative error {error:.3g} ({error / TOL:.0f}x the tolerance)")


def test_memory_budget_ac_saves_less_than_the_same_compiled_blocks(results):
    """The budget reaches compile's partitioner: each rank's peak of saved activations on the compared step,
    with each kernel, is below that of the blocks compiled without it; neither breaks a graph."""
    budget, compiled = results["ac-memory_budget-k3-compute"], results["compiled-k3-compute"]
    for r in (budget, compiled):
        assert r["graph_breaks"] == 0, r
    for kernel, k in budget["kernels"].items():
        peaks = [rank[-1] for rank in k["peaks"]]
        without = [rank[-1] for rank in compiled["kernels"][kernel]["peaks"]]
        print(f"{kernel}: peak saved activations per rank {peaks} with the budget, {without} without")
        assert all(p < w for p, w in zip(peaks, without, strict=True)), (peaks, without)
