"""The simulator's communication model: where ranks sit, transfer times, the copies'
all-reduces, and BSIPipe's and Chimera's placements."""

from __future__ import annotations

import json
import math

import pytest
from torchtitan.models.llama3 import TransformerModelArgs

from torchtitan_seq import simulate as sim
from torchtitan_seq.runtime.partition import UnitCost
from torchtitan_seq.schedules import ScheduleShape, seq1f1b_actions
from torchtitan_seq.schedules.ordering import F
from torchtitan_seq.simulate.network import parameter_count
from torchtitan_seq.titan.v022.models.llama3_seq import seq_llama3_flavors

GPT_1_3B = TransformerModelArgs(dim=2048, n_layers=24, n_heads=16, vocab_size=50257)
NVLINK = sim.Link(bandwidth=200e9, latency=5e-6)
INFINIBAND = sim.Link(bandwidth=25e9, latency=1e-5)
FLOPS = 60e12


@pytest.fixture
def gpt(monkeypatch):
    """GPT-1.3B as the flavor 'gpt-1.3b' (the simulator reads models by flavor name)."""
    monkeypatch.setitem(seq_llama3_flavors, "gpt-1.3b", GPT_1_3B)
    return "gpt-1.3b"


def _run(schedule, p, n, k=1, **kw) -> sim.SimResult:
    return sim.simulate(sim.SimConfig(schedule, p, n, k, **kw))


def _compute_end(r: sim.SimResult) -> float:
    return max(end for ivs in r.timeline.values() for _, end, _ in ivs)


def test_ranks_fill_nodes_in_mesh_order():
    # Pipeline ranks of 2 GPUs (tp 2), 8 GPUs a node: 4 ranks per node.
    net = sim.Network(NVLINK, INFINIBAND, gpus_per_node=8, gpus_per_rank=2, tensor_parallel=2)
    assert [net.node(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert net.link(0, 3) == NVLINK and net.link(3, 4) == INFINIBAND
    # A rank wider than a node: every pipeline hop leaves the node.
    wide = sim.Network(NVLINK, INFINIBAND, gpus_per_node=4, gpus_per_rank=8)
    assert [wide.node(r) for r in range(3)] == [0, 2, 4] and wide.link(0, 1) == INFINIBAND
    with pytest.raises(ValueError, match="gpus_per_node 8, gpus_per_rank 3"):
        sim.Network(gpus_per_node=8, gpus_per_rank=3)
    with pytest.raises(ValueError, match="bandwidth > 0"):
        sim.Link(bandwidth=0.0)


def test_parameter_count():
    # GPT-1.3B with untied embedding and output; SwiGLU width 8/3 dim rounded up to 256s: 5632.
    layers = 24 * (4 * 2048**2 + 3 * 2048 * 5632 + 2 * 2048)
    assert parameter_count(GPT_1_3B) == layers + 2 * 50257 * 2048 + 2048


@pytest.mark.parametrize(
    "schedule,k", [("1F1B", 1), ("Interleaved1F1B", 1), ("Seq1F1B", 4), ("BSIPipe", 2), ("Chimera", 2)]
)
def test_free_links_keep_the_timings(schedule, k):
    """Transfers over free links, passed explicitly, time every action as without a network."""
    plain = _run(schedule, 4, 8, k, cost="transformer", seq_len=1024)
    args = seq_llama3_flavors["debugmodel"]
    chunks = 4 * plain.stages_per_rank // plain.parameter_copies
    free = sim.Transfers.for_model(sim.Network(flops_per_gpu=FLOPS), args, plain.lengths, chunks, 1e-3)
    timed = sim.simulate_order(
        plain.compute_order,
        lengths=plain.lengths,
        times=sim.unit_times(sim.SimConfig(schedule, 4, 8, k, cost="transformer", seq_len=1024), plain.lengths),
        microbatches=8,
        stages_per_rank=plain.stages_per_rank,
        parameter_copies=plain.parameter_copies,
        transfers=free,
    )
    assert timed.timeline == plain.timeline
    assert timed.makespan == plain.makespan == _compute_end(plain)
    assert len(timed.copies_synced) == (4 if plain.parameter_copies == 2 else 0)


def test_a_transfer_takes_latency_plus_bytes_over_bandwidth():
    """GPipe, p = 2, N = 1, uniform costs: F, transfer, F, B, transfer, B."""
    args = seq_llama3_flavors["debugmodel"]
    seq_len, slow, fast = 840, sim.Link(1e9, 1e-3), sim.Link(1e10, 1e-4)
    seconds = args.n_layers * UnitCost.from_model_args(args).forward(seq_len, 0) / (2 * FLOPS)
    nbytes = seq_len * args.dim * 2  # bf16 activations of one sequence
    for gpus_per_node, link in ((1, slow), (2, fast)):
        net = sim.Network(intra_node=fast, inter_node=slow, gpus_per_node=gpus_per_node, flops_per_gpu=FLOPS)
        hop = (link.latency + nbytes / link.bandwidth) / seconds
        r = _run("GPipe", 2, 1, seq_len=seq_len, network=net, comm_latency=0.5)
        assert r.makespan == pytest.approx(1 + 2 * (hop + 0.5) + 1 + 2 + 2)
    # Tensor parallelism: a rank's compute and each transfer split 2 ways.
    net = sim.Network(inter_node=slow, gpus_per_node=2, gpus_per_rank=2, tensor_parallel=2, flops_per_gpu=FLOPS)
    hop = (slow.latency + nbytes / 2 / slow.bandwidth) / (seconds / 2)
    assert _run("GPipe", 2, 1, seq_len=seq_len, network=net).makespan == pytest.approx(6 + 2 * hop)


def test_context_parallel_splits_compute_and_gathers_kv_per_layer():
    """Seq1F1B, k = 1, p = 2, N = 1, uniform costs, CP 2 on one node: each rank's compute and
    transfers halve, and each of the stage's layers all-gathers the unit's K/V in F (c - 1 = 1 ring step
    of a rank's share of K and V) and reduce-scatters their gradient in B."""
    args = seq_llama3_flavors["debugmodel"]
    seq_len, link = 840, sim.Link(1e9, 1e-4)
    seconds = args.n_layers * UnitCost.from_model_args(args).forward(seq_len, 0) / (2 * 2 * FLOPS)
    net = sim.Network(link, link, gpus_per_node=2, gpus_per_rank=2, context_parallel=2, flops_per_gpu=FLOPS)
    kv = 2 * (args.n_kv_heads or args.n_heads) * (args.dim // args.n_heads)
    gather = link.latency + seq_len / 2 * kv * 2 / link.bandwidth  # one step, bf16
    assert net.kv_collective_seconds(args, seq_len) == pytest.approx(gather)
    comm = args.n_layers / 2 * gather / seconds
    hop = (link.latency + seq_len * args.dim * 2 / 2 / link.bandwidth) / seconds
    r = _run("Seq1F1B", 2, 1, 1, seq_len=seq_len, network=net)
    assert r.makespan == pytest.approx((1 + comm) * 2 + (2 + comm) * 2 + 2 * hop)
    with pytest.raises(ValueError, match="context_parallel"):
        sim.Network(gpus_per_rank=2, tensor_parallel=2, context_parallel=2)


def test_each_unit_sends_its_own_bytes():
    """Seq1F1B, p = 2, one microbatch of units 200 and 600 tokens long: rank 1's second
    forward waits for the 600 tokens' transfer (2 time units), its first for 200's (2/3)."""
    args = seq_llama3_flavors["debugmodel"]
    net = sim.Network(inter_node=sim.Link(bandwidth=600 * args.dim * 2 / 2.0), gpus_per_node=1)
    transfers = sim.Transfers.for_model(net, args, [200, 600], 2, 1.0)
    r = sim.simulate_order(
        seq1f1b_actions(ScheduleShape(2, 1, 2)),
        lengths=[200, 600],
        times=sim.UnitTimes(F=(0.25, 0.75), B=(0.5, 1.5)),
        microbatches=1,
        transfers=transfers,
    )
    forwards = [start for start, _, a in r.timeline[1] if a.computation_type == F]
    assert forwards == pytest.approx([0.25 + 2 / 3, 1.0 + 2.0])


def test_a_cost_file_in_seconds_needs_no_conversion(tmp_path):
    path = tmp_path / "times.json"
    path.write_text(json.dumps({"F": [0.01], "B": [0.02]}))
    net = sim.Network(inter_node=sim.Link(1e9, 1e-3), gpus_per_node=1)
    with pytest.raises(ValueError, match='"unit": "s"'):
        _run("GPipe", 2, 1, seq_len=840, cost=str(path), network=net)
    path.write_text(json.dumps({"F": [0.01], "B": [0.02], "unit": "s"}))
    hop = 1e-3 + 840 * seq_llama3_flavors["debugmodel"].dim * 2 / 1e9
    r = _run("GPipe", 2, 1, seq_len=840, cost=str(path), network=net)
    assert r.makespan == pytest.approx(0.01 + hop + 0.01 + 0.02 + hop + 0.02)


def test_a_slower_inter_node_link_lengthens_the_step(gpt):
    """Seq1F1B, p = 4 on nodes of 2 GPUs: one inter-node hop, the step grows with its cost."""
    makespans = [
        _run(
            "Seq1F1B",
            4,
            8,
            4,
            cost="transformer",
            flavor=gpt,
            seq_len=8192,
            network=sim.Network(NVLINK, inter, gpus_per_node=2, flops_per_gpu=FLOPS),
        ).makespan
        for inter in (sim.Link(), NVLINK, INFINIBAND, sim.Link(5e9, 1e-5), sim.Link(5e9, 1e-3))
    ]
    assert makespans == sorted(makespans) and len(set(makespans)) == len(makespans), makespans


def test_the_copies_all_reduce_ends_the_step(gpt):
    """Chimera, p = 2: the pair all-reduces its 2 chunks' gradients, then their parameters,
    each in 2 ring steps of half the buffer, after both ranks finish computing."""
    net = sim.Network(inter_node=sim.Link(25e9), gpus_per_node=1, flops_per_gpu=FLOPS)
    r = _run("Chimera", 2, 2, cost="transformer", flavor=gpt, seq_len=4096, network=net)
    seconds = 24 * UnitCost.from_model_args(GPT_1_3B).forward(4096, 0) / (2 * FLOPS)
    chunk_bytes = parameter_count(GPT_1_3B) / 2 * 4  # fp32, the model in p = 2 chunks
    all_reduces = 2 * 2 * (2 * chunk_bytes / 2) / 25e9 / seconds
    assert r.copies_synced == pytest.approx([_compute_end(r) + all_reduces] * 2)
    assert r.makespan == pytest.approx(_compute_end(r) + all_reduces)
    assert r.summary()["copies_synced"] == r.copies_synced


@pytest.mark.parametrize("schedule,k", [("BSIPipe", 2), ("Chimera", 1)])
def test_paired_placement_beats_linear_across_nodes(gpt, schedule, k):
    """GPT-1.3B, p = 8 on nodes of 4 GPUs, 16 microbatches of 20K tokens: paired keeps each
    mirrored pair's all-reduces on NVLink, linear sends them over InfiniBand, and gains
    about 0.8% (BSIPipe's ablation: 0.92-1.59%; projection.md has N = 64). On one node of 8
    the placements differ by nothing."""

    def makespan(placement: str, gpus_per_node: int) -> float:
        net = sim.Network(NVLINK, INFINIBAND, gpus_per_node=gpus_per_node, flops_per_gpu=FLOPS)
        return _run(
            schedule,
            8,
            16,
            k,
            cost="transformer",
            flavor=gpt,
            seq_len=20480,
            partition="compute",
            network=net,
            bidirectional_placement=placement,
        ).makespan

    gain = makespan("linear", 4) / makespan("paired", 4) - 1
    assert 0.002 < gain < 0.03, gain
    assert makespan("linear", 8) == pytest.approx(makespan("paired", 8), rel=1e-12)


def test_cli_links(capsys):
    common = [
        "--schedule",
        "Chimera",
        "--pp",
        "2",
        "--microbatches",
        "2",
        "--json",
        "--inter-node-bandwidth",
        "25e9",
        "--gpus-per-node",
        "1",
    ]
    assert sim.main(common) == 2
    assert "--flops-per-gpu" in capsys.readouterr().err
    runs = {}
    for placement in ("paired", "linear"):
        assert sim.main([*common, "--flops-per-gpu", "1e12", "--bidirectional-placement", placement]) == 0
        runs[placement] = json.loads(capsys.readouterr().out)
    free = _run("Chimera", 2, 2)
    # Two ranks on two nodes: both placements the same, the all-reduces after the compute.
    assert runs["paired"]["makespan"] == runs["linear"]["makespan"] > free.makespan
    assert math.isclose(max(free.copies_synced), free.makespan)
