"""BSIPipe: exact against the full-sequence reference, mirrored copies kept identical,
its layout and lowering, and through torchtitan."""

import itertools
import shutil

import pytest
from exactness import Variant, assert_exact, run_variants
from titan import assert_same_losses, assert_trained, run_train
from torch.distributed.pipelining.schedules import _add_reduce_grad, _add_send_recv, _add_unshard_reshard

from torchtitan_seq.schedules import BidirectionalLayout, lower_chains
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, bsipipe_actions, seq1f1b_actions


def _bsi(name: str, pp: int, **kw) -> Variant:
    # 2p chunks of at least one layer each (torchtitan counts embeddings and output as one layer).
    return Variant(f"pp{pp}-{name}", schedule="BSIPipe", pp=pp, layers=2 * pp, **kw)


def _variants(pp: int) -> list[Variant]:
    return [
        *[
            _bsi(f"k{k}-{part}", pp, k=k, partition=part)
            for k, part in ((1, "even"), (2, "even"), (3, "even"), (2, "compute"), (3, "compute"))
        ],
        _bsi("k2-N4", pp, k=2, microbatches=4),
        _bsi("copies", pp, k=2, optimizer_steps=3),
    ]


@pytest.fixture(scope="module", params=[pytest.param(p, marks=pytest.mark.slow) for p in (2, 4)],
                ids=lambda p: f"pp{p}")
def results(request, tmp_path_factory):
    pp = request.param
    return {r["name"]: r for r in run_variants(_variants(pp), tmp_path_factory.mktemp(f"pp{pp}"))}


def test_exact_against_full_sequence(results):
    """Loss and every gradient (each chunk's, found on its chain-A copy) equal the reference;
    the chain-B copies keep no gradient, so an optimizer steps each chunk once."""
    for name, r in results.items():
        assert_exact(r, n_losses=4 if name.endswith("N4") else 2)
        assert r["mirror_grads"] == 0, r


def test_copies_stay_identical_over_optimizer_steps(results):
    """After each of 3 SGD steps the copies are identical, and the step after them equals the
    reference trained by the same steps (test_exact_against_full_sequence)."""
    r = next(r for name, r in results.items() if "copies" in name)
    assert r["error"] is None, r["error"]
    assert r["copies_diff"] == [0.0, 0.0, 0.0], r


@pytest.mark.slow
def test_tensor_parallel_and_fsdp_match_the_reference(tmp_path):
    """4 ranks: pp=2 x tp=2 (TP shards the heads, each KV context holds its rank's) and
    pp=2 x dp_shard=2 (FSDP2 reduces once per step; the pairs combine the shards)."""
    variants = [
        Variant("pp2-tp2-k2", schedule="BSIPipe", pp=2, tp=2, k=2, layers=4),
        Variant("pp2-tp2-copies", schedule="BSIPipe", pp=2, tp=2, k=2, layers=4, optimizer_steps=3),
        Variant("pp2-fsdp2-k2", schedule="BSIPipe", pp=2, dp_shard=2, k=2, layers=4),
    ]
    tp, copies, fsdp = run_variants(variants, tmp_path)
    assert_exact(tp, n_losses=2)
    assert_exact(copies, n_losses=2)
    assert copies["copies_diff"] == [0.0, 0.0, 0.0], copies
    assert_exact(fsdp, n_losses=2)


# --- layout and lowering ---------------------------------------------------------


def test_layout_places_chains_in_mirrored_vs():
    lay = BidirectionalLayout(4, "linear")
    # Position q holds chunks {q, 2p-1-q} of A and {p-1-q, p+q} of B.
    for q in range(4):
        chunks = [lay.chunk(s) for s in lay.stages_of_rank(q)]
        assert chunks == [q, 7 - q, 3 - q, 4 + q]
    paired = BidirectionalLayout(4)
    assert [paired.rank_of_position(q) for q in range(4)] == [0, 2, 3, 1]
    assert all(abs(r - paired.mirror(r)) == 1 for r in range(4))  # pairs are neighbours
    assert "rank 0: position 0, chunks A [0, 7] B [3, 4], mirrored with rank 1" in paired.describe()
    with pytest.raises(ValueError, match="even pipeline_parallel_degree"):
        BidirectionalLayout(3)
    with pytest.raises(ValueError, match="sequence_pipeline.bidirectional_placement"):
        BidirectionalLayout(4, "ring")


def test_lowering_of_one_chain_is_torchs():
    """With one chain, lower_chains places every send and receive where torch's _add_send_recv does."""
    for p, n, k in itertools.product((2, 3, 4), (1, 3), (1, 2, 4)):
        order = seq1f1b_actions(p, n, k)
        ours = lower_chains(order, {s: s for s in range(p)}, p, n * k)
        with_fsdp = {r: _add_reduce_grad(_add_unshard_reshard(a), n * k) for r, a in order.items()}
        assert ours == _add_send_recv(with_fsdp, lambda s: s, p)


def test_no_transfer_crosses_a_chain_end():
    lay = BidirectionalLayout(4)
    order = {lay.rank_of_position(q): acts for q, acts in bsipipe_actions(4, 8, 2).items()}
    lowered = lower_chains(order, lay.stage_to_rank(), lay.chain_length, 8)
    comms = {(a.computation_type.name, a.stage_index) for acts in lowered.values() for a in acts
             if a.computation_type.name in ("SEND_F", "RECV_F", "SEND_B", "RECV_B")}
    ends = {0, 7, 8, 15}  # first and last stage of each chain
    assert not {("SEND_F", 7), ("SEND_F", 15), ("RECV_F", 0), ("RECV_F", 8),
                ("SEND_B", 0), ("SEND_B", 8), ("RECV_B", 7), ("RECV_B", 15)} & comms
    # The V turns (stages 3/4 and 11/12) are on one rank: no transfer there either.
    assert not {("SEND_F", 3), ("SEND_F", 11), ("SEND_B", 4), ("SEND_B", 12)} & comms
    assert {("SEND_F", s) for s in range(16) if s not in ends | {3, 11}} <= comms


def test_refuses_what_it_cannot_run():
    cls = SEQUENCE_SCHEDULES["BSIPipe"]
    with pytest.raises(ValueError, match="even number of them, got 3"):
        cls.compute_order(2, 3, 2)
    with pytest.raises(ValueError, match="sequence_pipeline.split_backward = false"):
        cls.compute_order(2, 2, 2, split_backward=True)
    # The job check refuses the same without building the lists.
    with pytest.raises(ValueError, match="even number of them, got 3"):
        cls.check_shape(2, 3, 2)
    with pytest.raises(ValueError, match="even pipeline_parallel_degree"):
        cls.check_shape(3, 2, 2)


# --- through torchtitan ------------------------------------------------------------

SMALL = ("--training.seq_len", "512", "--training.local_batch_size", "4")


@pytest.mark.slow
def test_logs_the_losses_of_1f1b_from_one_seed_checkpoint(tmp_path):
    """torchtitan seeds each pipeline rank differently, so both runs start from one seed checkpoint."""
    seed = run_train(*SMALL, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
                     "--parallelism.pipeline_parallel_degree", "1", dump_folder=tmp_path / "seed",
                     env={"NGPU": "1"})
    assert seed.returncode == 0, seed.output[-3000:]
    runs = {}
    for schedule in ("BSIPipe", "1F1B"):
        folder = tmp_path / schedule
        shutil.copytree(tmp_path / "seed" / "checkpoint", folder / "checkpoint")
        runs[schedule] = run_train(*SMALL, "--training.steps", "10", "--checkpoint.enable",
                                   "--checkpoint.interval", "1000", "--checkpoint.last_save_model_only",
                                   "--parallelism.pipeline_parallel_schedule", schedule, dump_folder=folder,
                                   check=False)
        assert_trained(runs[schedule], 10)
    assert_same_losses(runs["BSIPipe"], runs["1F1B"])
    assert "BSIPipe placement 'paired':" in runs["BSIPipe"].output


# --- simulated: bubbles and memory -------------------------------------------------


@pytest.mark.parametrize("p", [2, 4, 8])
def test_smaller_bubbles_than_interleaved_and_memory_independent_of_n(p):
    """Uniform costs, N in {2p, 8p}, k 1-4: bubble below InterleavedSeq1F1B's (v=2) and
    at most (p-1)/(3Nk+p-1) + 0.01; two parameter copies; the same peak at N = 2p and 8p."""
    from torchtitan_seq.simulate import SimConfig, simulate

    for k in (1, 2, 3, 4):
        peaks = []
        for n in (2 * p, 8 * p):
            # 3072 tokens: every k cuts them into equal subsequences.
            bsi = simulate(SimConfig("BSIPipe", pp=p, microbatches=n, subsequences=k, seq_len=3072))
            inter = simulate(SimConfig("InterleavedSeq1F1B", pp=p, microbatches=n, subsequences=k, seq_len=3072))
            assert bsi.deadlock is None and bsi.parameter_copies == 2
            assert bsi.bubble_ratio < inter.bubble_ratio, (p, n, k, bsi.bubble_ratio, inter.bubble_ratio)
            assert bsi.bubble_ratio <= (p - 1) / (3 * n * k + p - 1) + 0.01, (p, n, k, bsi.bubble_ratio)
            peaks.append(max(bsi.peak_activations))
        assert peaks[0] == pytest.approx(peaks[1]), (p, k, peaks)
