"""The schedule simulator: closed forms, a deadlock/ordering sweep, outputs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import _Action, _PipelineScheduleRuntime, get_schedule_class

from torchtitan_seq import simulate as sim
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES, ScheduleShape, SequenceSchedule, seq1f1b_actions
from torchtitan_seq.schedules.ordering import B, F, ScheduleOrderError, validate_unit_order

REPO = Path(__file__).resolve().parents[2]
# Divisible by every k tested, so even subsequences are exactly S / k long.
SEQ_LEN = 840


def _run(schedule: str, p: int, n: int, k: int = 1, **kw) -> sim.SimResult:
    return sim.simulate(sim.SimConfig(schedule, p, n, k, seq_len=SEQ_LEN, **kw))


# --- closed forms under uniform costs ---------------------------------------


@pytest.mark.parametrize("p", [2, 4, 8])
def test_1f1b_closed_forms(p):
    # torch's Schedule1F1B refuses N < p.
    for n in range(p, 17):
        r = _run("1F1B", p, n)
        assert r.deadlock is None
        assert r.bubble_ratio == pytest.approx((p - 1) / (n + p - 1), abs=1e-9), n
        assert r.peak_activations[0] == pytest.approx(min(p, n), abs=1e-9), n


@pytest.mark.parametrize("schedule", ["Seq1F1B", "TeraPipe"])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_sequence_closed_forms(schedule, p):
    for n in range(1, 17):
        for k in range(1, 9):
            r = _run(schedule, p, n, k)
            shape = f"p={p} N={n} k={k}"
            assert r.deadlock is None, shape
            assert r.bubble_ratio == pytest.approx((p - 1) / (n * k + p - 1), abs=1e-9), shape
            if schedule == "Seq1F1B":
                assert r.peak_activations[0] == pytest.approx(min(p - 1 + k, n * k) / k, abs=1e-9), shape


def test_torch_reference_figures():
    """Interleaved 1F1B against the NOTES table; GPipe and TeraPipe keep every forward."""
    r = _run("Interleaved1F1B", 4, 8)
    assert r.stages_per_rank == 2
    assert r.bubble_ratio == pytest.approx(3 / (2 * 8 + 3), abs=1e-9)
    assert r.peak_activations[0] == pytest.approx((1 + 3 / 8) * 4, abs=1e-9)
    assert _run("GPipe", 4, 8).peak_activations == pytest.approx([8] * 4)
    assert _run("TeraPipe", 4, 8, 4).peak_activations == pytest.approx([8] * 4)


# --- every sequence schedule, every small shape ------------------------------


@pytest.mark.slow
def test_sweep_no_deadlock_no_ordering_violation():
    """p <= 8, N <= 10 and 12, 16, k 1-3, 5 and 8, split backward both ways for p <= 4
    (BSIPipe, Chimera: the shapes they run, even p and N, k <= 4). Every N up to p + 2 for
    the largest p: where warm-up and cool-down meet.

    simulate() validates the unit order (raising ScheduleOrderError) and runs
    torch's lowering, so a pass here means both hold.
    """
    for name in SEQUENCE_SCHEDULES:
        pairs = (
            SEQUENCE_SCHEDULES[name].parameter_copies == 2
        )  # even p and N, full backward only; k <= 4 keeps it quick
        for p in range(2 if pairs else 1, 9, 2 if pairs else 1):
            for split in (False, True) if p <= 4 and not pairs else (False,):
                for n in [*range(1, 11), 12, 16]:
                    if pairs and n % 2:
                        continue
                    for k in range(1, 5) if pairs else (1, 2, 3, 5, 8):
                        r = _run(name, p, n, k, split_backward=split)
                        assert r.deadlock is None, (name, p, n, k, split, r.deadlock)
                        assert r.makespan > 0


# --- the validator and the deadlock detector ---------------------------------


def _first_subsequence_first(order):
    """Reorder each rank's backwards to run subsequence 0 first (wrong)."""
    out = {}
    for rank, actions in order.items():
        backs = iter(sorted((a for a in actions if a.computation_type == B), key=lambda a: a.microbatch_index))
        out[rank] = [next(backs) if a.computation_type == B else a for a in actions]
    return out


def test_validator_rejects_first_subsequence_first_backward():
    bad = _first_subsequence_first(seq1f1b_actions(ScheduleShape(2, 1, 4)))
    with pytest.raises(ScheduleOrderError, match=r"rule 2 .*microbatch 0, subsequence 0"):
        validate_unit_order(bad, 4)


def test_simulate_rejects_a_misordered_schedule_by_name(monkeypatch):
    class Misordered(SequenceSchedule):
        actions_fn = staticmethod(lambda shape: _first_subsequence_first(seq1f1b_actions(shape)))

    monkeypatch.setitem(SEQUENCE_SCHEDULES, "Misordered", Misordered)
    with pytest.raises(ScheduleOrderError, match="rule 2"):
        _run("Misordered", 2, 2, 4)


def test_deadlock_is_reported_not_hung():
    # Rank 0 waits for the gradient of unit 0 before sending the input of
    # unit 1, which rank 1 needs before it runs the backward of unit 0.
    dead = {
        0: [_Action(0, F, 0), _Action(0, B, 0), _Action(0, F, 1), _Action(0, B, 1)],
        1: [_Action(1, F, 0), _Action(1, F, 1), _Action(1, B, 1), _Action(1, B, 0)],
    }
    r = sim.simulate_order(dead, lengths=[1], times=sim.UnitTimes(F=(1.0,), B=(2.0,)), microbatches=2)
    assert r.deadlock is not None
    stuck = {(s.rank, s.index, s.action) for s in r.deadlock.stuck}
    assert stuck == {(0, 1, "0B0"), (1, 1, "1F1")}
    assert "no rank can progress" in r.summary()["deadlock"]
    assert [a for _, _, a in r.timeline[0]] == [_Action(0, F, 0)]


# --- placement, lowering and plug-in of new schedules ------------------------


def _looped_bfs_units(shape):
    """A V-stage, loop-placed sequence schedule: every forward of a stage, then backwards."""
    assert not shape.split_backward
    p, n, k, stages_per_rank = shape.num_ranks, shape.num_microbatches, shape.num_subsequences, shape.stages_per_rank
    fwd = [m * k + j for m in range(n) for j in range(k)]
    bwd = [m * k + j for m in range(n) for j in reversed(range(k))]
    stages = lambda r: [r + i * p for i in range(stages_per_rank)]  # noqa: E731
    return {
        r: [_Action(s, F, u) for s in stages(r) for u in fwd]
        + [_Action(s, B, u) for s in reversed(stages(r)) for u in bwd]
        for r in range(p)
    }


def test_multi_stage_sequence_schedule_plugs_in(monkeypatch):
    class LoopedUnits(SequenceSchedule):
        actions_fn = staticmethod(_looped_bfs_units)
        stages_per_rank = 2

    class WronglyPlaced(LoopedUnits):
        stage_placement = "v"

    monkeypatch.setitem(SEQUENCE_SCHEDULES, "LoopedUnits", LoopedUnits)
    monkeypatch.setitem(SEQUENCE_SCHEDULES, "WronglyPlaced", WronglyPlaced)
    r = _run("LoopedUnits", 4, 2, 2)
    assert r.deadlock is None and r.stages_per_rank == 2
    # Each stage holds half a rank's layers: a unit weighs (1/k) / V.
    assert r.peak_activations == pytest.approx([2 * 2 * 2 * 0.25] * 4)
    assert _run("LoopedUnits", 4, 2, 2, stages_per_rank=4).stages_per_rank == 4
    with pytest.raises(ValueError, match="stage_placement 'v'"):
        _run("WronglyPlaced", 4, 2, 2)


@pytest.mark.parametrize(
    "name", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
)
def test_lowering_is_the_runtimes(name):
    """Our lowering of torch's runtime schedules equals their pipeline_order_with_comms."""
    r = _run(name, 4, 8)
    assert r.deadlock is None
    cls = get_schedule_class(name)
    placement = "v" if name in ("ZBVZeroBubble", "DualPipeV") else "loop"
    stages = [sim.MockStage(s, 8, 4) for s in ((0, 7) if placement == "v" else (0, 4))]
    assert r.lowered == cls(stages, 8).pipeline_order_with_comms


def test_overlap_sub_actions_run_in_sequence():
    r = _run("DualPipeV", 4, 8)
    for intervals in r.timeline.values():
        for (_, end, _), (start, _, _) in zip(intervals, intervals[1:]):
            assert start >= end - 1e-12
    leaves = [sub for acts in r.compute_order.values() for a in acts if a for sub in (a.sub_actions or (a,))]
    assert sum(len(iv) for iv in r.timeline.values()) == len(leaves)


# --- costs --------------------------------------------------------------------


def test_cost_file_and_latency(tmp_path):
    path = tmp_path / "times.json"
    path.write_text(json.dumps({"F": [1.0, 3.0], "I": [2.0, 5.0], "W": [1.0, 1.0], "device": "cpu"}))
    r = _run("Seq1F1B", 1, 1, 2, cost=str(path))
    assert r.makespan == pytest.approx(1 + 3 + 3 + 6)  # B = I + W
    split = _run("Seq1F1B", 1, 1, 2, cost=str(path), split_backward=True)
    assert split.makespan == pytest.approx(1 + 3 + 5 + 2 + 1 + 1)
    path.write_text(json.dumps({"F": [1.0, 3.0], "B": [2.0, 5.0]}))
    with pytest.raises(ValueError, match="no times"):
        _run("Seq1F1B", 1, 1, 2, cost=str(path), split_backward=True)
    # GPipe, p=2, N=1: F, latency, F, B, latency, B.
    assert _run("GPipe", 2, 1, comm_latency=0.5).makespan == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)


def test_calibrated_chunks_time_their_own_stages(tmp_path):
    """A calibration's per-chunk times (a light first chunk, a heavy last one) time each stage
    as its own chunk; without them every stage takes the shared (slowest rank's) times."""
    light, heavy = {"F": [1.0], "B": [2.0], "I": [0.0], "W": [2.0]}, {"F": [3.0], "B": [6.0], "I": [4.0], "W": [2.0]}
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({**heavy, "chunks": [[0], [1]], "chunk_times": [[light], [heavy]]}))
    # 1F1B, p=2, N=2. Rank 0: F0 F1 (0-2), B0 once rank 1's B0 ends (10-12), B1 after its B1 (19-21);
    # rank 1: F0 (1-4), B0 (4-10), F1 (10-13), B1 (13-19).
    assert sim.simulate(sim.SimConfig("1F1B", 2, 2, cost=str(path))).makespan == pytest.approx(21.0)
    path.write_text(json.dumps(heavy))
    assert sim.simulate(sim.SimConfig("1F1B", 2, 2, cost=str(path))).makespan == pytest.approx(3 * 9.0)
    # Chunks measured for another layout (two per rank) leave the shared times in place.
    path.write_text(json.dumps({**heavy, "chunks": [[0, 2], [1, 3]], "chunk_times": [[light, light], [heavy, heavy]]}))
    assert sim.simulate(sim.SimConfig("1F1B", 2, 2, cost=str(path))).makespan == pytest.approx(3 * 9.0)


def test_transformer_cost_and_compute_partition():
    even = sim.simulate(sim.SimConfig("Seq1F1B", 2, 2, 4, cost="transformer", seq_len=4096))
    times = sim.unit_times(sim.SimConfig("Seq1F1B", 2, 2, 4, cost="transformer", seq_len=4096), even.lengths)
    assert list(times.F) == sorted(times.F)  # later units attend to longer prefixes
    assert times.B == pytest.approx([i + w for i, w in zip(times.I, times.W)])
    balanced = sim.simulate(sim.SimConfig("Seq1F1B", 2, 2, 4, cost="transformer", seq_len=4096, partition="compute"))
    assert balanced.lengths[0] > balanced.lengths[-1]
    assert balanced.makespan < even.makespan


# --- outputs --------------------------------------------------------------------


@pytest.mark.parametrize("name,k", [("Seq1F1B", 4), ("1F1B", 1), ("DualPipeV", 1)])
def test_csv_round_trip(tmp_path, name, k):
    r = _run(name, 4, 8, k)
    path = tmp_path / "order.csv"
    path.write_text(sim.compute_csv(r), newline="")
    with open(path, newline="") as f:
        parsed = {rank: [_Action.from_str(s) for s in row] for rank, row in enumerate(csv.reader(f))}
    assert parsed == r.compute_order
    # What torchtitan's pipeline_parallel_schedule_csv does with it, on rank 0's stages.
    v = r.stages_per_rank
    placement = "v" if name == "DualPipeV" else "loop"
    stages = [s for s, rank in generate_stage_to_rank_mapping(4, 4 * v, placement).items() if rank == 0]
    runtime = _PipelineScheduleRuntime([sim.MockStage(s, 4 * v, 4) for s in stages], 8 * k)
    runtime._load_csv(str(path))
    assert runtime.pipeline_order == r.compute_order
    assert runtime.pipeline_order_with_comms == r.lowered
    dumped = tmp_path / "dumped.csv"
    runtime._dump_csv(str(dumped), format="compute_only")
    assert dumped.read_bytes() == path.read_bytes()


def test_svg_trace_and_cli(tmp_path, capsys):
    svg, trace = tmp_path / "t.svg", tmp_path / "t.json"
    rc = sim.main(
        [
            "--schedule",
            "Seq1F1B",
            "--pp",
            "4",
            "--microbatches",
            "4",
            "--subsequences",
            "4",
            "--json",
            "--svg",
            str(svg),
            "--trace",
            str(trace),
        ]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    for key in (
        "schedule",
        "pp",
        "microbatches",
        "subsequences",
        "stages_per_rank",
        "bubble_ratio",
        "makespan",
        "peak_activations",
        "parameter_copies",
        "deadlock",
    ):
        assert key in summary
    assert summary["deadlock"] is False
    text = svg.read_text()
    assert text.startswith("<svg") and text.count("<rect") > 4 * 32 and "url(#hatch-B)" in text
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1, 2, 3}
    assert sum(e["ph"] == "X" for e in events) == 4 * 32


def test_schedules_folder_is_fresh(tmp_path):
    sim.regenerate(tmp_path)
    committed = REPO / "schedules"
    fresh = sorted(p.name for p in tmp_path.iterdir())
    assert fresh == sorted(p.name for p in committed.iterdir()), (
        "run: python -m torchtitan_seq.simulate --regenerate schedules"
    )
    for name in fresh:
        assert (tmp_path / name).read_bytes() == (committed / name).read_bytes(), name


def test_packed_documents_cost_less_attention_and_cut_more_evenly(capsys):
    """--document-length D: the transformer cost scores the pairs of packed documents, and
    the compute partition follows; short documents leave less work and a more even cut."""
    common = [
        "--schedule",
        "Seq1F1B",
        "--pp",
        "2",
        "--microbatches",
        "4",
        "--subsequences",
        "4",
        "--cost",
        "transformer",
        "--partition",
        "compute",
        "--seq-len",
        "4096",
        "--json",
    ]
    runs = {}
    for d in ("0", "4096", "512"):
        assert sim.main([*common, "--document-length", d]) == 0
        runs[d] = json.loads(capsys.readouterr().out)
    assert runs["0"]["makespan"] > runs["4096"]["makespan"] > runs["512"]["makespan"]
    spread = {d: max(r["lengths"]) - min(r["lengths"]) for d, r in runs.items()}
    assert spread["0"] > spread["4096"] > spread["512"], spread


# --- what a unit costs beyond its share ---------------------------------------


@pytest.mark.parametrize("document_length", [None, 300.0])
def test_the_fit_recovers_a_fixed_cost_per_unit_and_costs_per_token_and_pair(document_length):
    from torchtitan_seq.runtime.partition import UnitCost
    from torchtitan_seq.simulate.costs import fit_unit_costs

    pairs = UnitCost(0.0, 0.0, document_length).pairs
    cuts = [[2048], [1024, 1024], [704, 512, 448, 384], [256] * 8]
    units = [
        (n, sum(cut[:j]), 5e-3 + 2e-6 * n + 3e-10 * pairs(n, sum(cut[:j]))) for cut in cuts for j, n in enumerate(cut)
    ]
    fit = fit_unit_costs(units, document_length)
    assert (fit.fixed, fit.per_token, fit.per_pair) == pytest.approx((5e-3, 2e-6, 3e-10), rel=1e-6)
    # k x fixed over the cut's F + B
    total = sum(t for _, _, t in units[7:])
    assert fit.fixed_share([256] * 8) == pytest.approx(8 * 5e-3 / total, rel=1e-6)
    with pytest.raises(ValueError, match="cannot separate"):
        fit_unit_costs(units[7:])  # one even cut: fixed and per-token cost are one
    # Units that cost more than linearly in their tokens get no negative fixed cost.
    convex = [(n, 0, 1e-6 * n**1.2) for n in (128, 256, 512, 1024, 2048)]
    assert fit_unit_costs(convex).fixed == 0.0


def test_the_h200_fixed_cost_per_unit_is_the_fit_of_the_newest_gpu_check():
    """plan.H200_UNIT_OVERHEAD_S is refitted when a GPU check's cost files are committed: it is the
    fit of the newest benchmarks/gpu/DATE/cudnn (16K tokens and up, per layer), which plan/job.py names."""
    from torchtitan_seq.plan import H200_UNIT_OVERHEAD_S
    from torchtitan_seq.simulate.costs import fit_cost_files, gpu_fixed_cost_per_layer

    checks = [p for p in sorted((REPO / "benchmarks/gpu").glob("*/cudnn")) if any(p.glob("cost_s*.json"))]
    newest = checks[-1]
    fitted = gpu_fixed_cost_per_layer(newest)
    assert fitted == pytest.approx(H200_UNIT_OVERHEAD_S, rel=5e-3), (
        f"{newest.relative_to(REPO)} fits {fitted * 1e3:.3f} ms per unit and layer: "
        "set torchtitan_seq/plan/job.py's H200_UNIT_OVERHEAD_S (and its docstring) to it"
    )
    assert f"benchmarks/gpu/{newest.parent.name}/cudnn" in (REPO / "torchtitan_seq/plan/job.py").read_text()
    # The rule on the 2026-11-30 check: its 15 files of 16K-64K tokens, 4 layers.
    first = REPO / "benchmarks/gpu/2026-11-30/cudnn"
    files = [p for p in sorted(first.glob("cost_s*.json")) if "s8192" not in p.name]
    assert len(files) == 15
    assert gpu_fixed_cost_per_layer(first) == pytest.approx(fit_cost_files(files).fixed / 4, rel=1e-12)


def test_a_unit_overhead_adds_its_time_to_every_units_passes():
    from dataclasses import replace

    from torchtitan_seq.simulate.costs import seconds_per_time_unit, subsequence_lengths, unit_times
    from torchtitan_seq.simulate.network import Network

    config = sim.SimConfig("Seq1F1B", 2, 4, 4, cost="transformer", seq_len=2048, network=Network(flops_per_gpu=1e12))
    lengths = subsequence_lengths(config)
    bare = unit_times(config, lengths)
    loaded = unit_times(replace(config, unit_overhead=1e-3), lengths)
    # debugmodel: 6 layers, 3 a stage at pp = 2, so 3 ms a unit
    added = 3e-3 / seconds_per_time_unit(config)
    for j in range(4):
        assert loaded.F[j] + loaded.B[j] == pytest.approx(bare.F[j] + bare.B[j] + added, rel=1e-9)
        assert loaded.F[j] / loaded.B[j] == pytest.approx(bare.F[j] / bare.B[j], rel=1e-9)
        assert loaded.I[j] + loaded.W[j] == pytest.approx(loaded.B[j], rel=1e-9)
