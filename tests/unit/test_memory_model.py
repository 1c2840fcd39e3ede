"""The memory model (torchtitan_seq.simulate.memory) against measured bytes and the simulator."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from torchtitan_seq.attention import bind_kv_context
from torchtitan_seq.attention.kernels import select_kernel
from torchtitan_seq.instrumentation.memory import ActivationMemory
from torchtitan_seq.runtime.kv_context import KVContext, Unit
from torchtitan_seq.runtime.shape import JobShape
from torchtitan_seq.schedules.ordering import compute_leaves
from torchtitan_seq.simulate import SimConfig, simulate
from torchtitan_seq.simulate import memory as mm
from torchtitan_seq.simulate.build import build
from torchtitan_seq.simulate.network import chunk_parameters
from torchtitan_seq.titan.v022.models.llama3_seq import SeqTransformer, seq_llama3_flavors

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 0.10  # issue #15: every schedule's predicted peak within 10% of the measured one
# Recorded CPU runs of the debug model, pp=2, 4 microbatches (benchmarks/README.md), by AC mode.
RECORDED = {
    "none": [
        "all_schedules/bench.json",
        "acceptance/bench.json",
        "memory/chimera/bench.json",
        "slab/arena/bench.json",  # last: the sequence schedules as the code runs them now
    ],
    "full": ["memory/ac_full/bench.json", "memory/chimera_ac_full/bench.json"],
}
SCHEDULES = {"1F1B", "Interleaved1F1B", "GPipe", "Seq1F1B", "InterleavedSeq1F1B", "TeraPipe", "BSIPipe", "Chimera"}


def _recorded(mode: str) -> list[dict]:
    rows = []
    for name in RECORDED[mode]:
        path = REPO / "benchmarks" / name
        if path.is_file():
            rows += [r for r in json.loads(path.read_text()) if not r.get("compiled")]
    return rows


def _config(row: dict, mode: str) -> mm.MemoryConfig:
    shape = JobShape.of_model(
        seq_llama3_flavors["debugmodel"],
        row["seq_len"],
        row["num_subsequences"],
        row["partition"] or "even",
        length_multiple=64,  # the runs' train_configs/debug_model.toml
        microbatches=row["microbatches"],
    )
    return mm.MemoryConfig("debugmodel", shape, row["schedule"], pp=row["pp"], device="cpu", activation_checkpoint=mode)


def _errors(mode: str) -> dict[str, list[float]]:
    """Per recorded run: (predicted - measured) / measured activation peak, per rank."""
    errors = {}
    for row in _recorded(mode):
        estimate = mm.predict_memory(_config(row, mode))
        errors[f"{row['label']} {row['seq_len']}"] = [
            r.activations / measured - 1 for r, measured in zip(estimate.ranks, row["peak_activation_bytes"])
        ]
    return errors


@pytest.mark.parametrize("mode", ["none", "full"])
def test_every_recorded_schedule_within_tolerance(mode):
    errors = _errors(mode)
    assert {label.split()[0] for label in errors} == SCHEDULES  # the recorded runs cover every schedule
    bad = {label: e for label, e in errors.items() if max(abs(x) for x in e) > TOLERANCE}
    assert not bad, bad


def test_kv_arenas_within_one_percent(monkeypatch):
    """#26: the runs of the K/V arenas (benchmarks/slab/arena, every sequence schedule at 2048 and 4096
    tokens) within 1% on both ranks; a model whose slabs each take an arena of their own (no two
    microbatches sharing one) misses Seq1F1B's by more."""
    rows = json.loads((REPO / "benchmarks/slab/arena/bench.json").read_text())

    def worst() -> float:
        return max(
            abs(r.activations / measured - 1)
            for row in rows
            for r, measured in zip(mm.predict_memory(_config(row, "none")).ranks, row["peak_activation_bytes"])
        )

    assert {row["schedule"] for row in rows} == SCHEDULES - {"1F1B", "Interleaved1F1B", "GPipe"}
    assert worst() < 0.01
    plan_arenas = mm.plan_arenas
    with monkeypatch.context() as patch:
        patch.setattr(mm.arenas, "plan_arenas", lambda *args, **kwargs: plan_arenas(*args, **kwargs, alternate=False))
        mm.action_plan.cache_clear()
        assert worst() > 0.04
    mm.action_plan.cache_clear()


def test_context_parallel_within_one_percent():
    """#29: pp 2 x cp 2 against pp 2 at 4096 and 8192 tokens (benchmarks/context_parallel: Seq1F1B k 4,
    float32 parameters), every rank within 1%; a model that takes a CP rank for a whole unit's
    (c = 1 figures) misses by more than 40%."""
    rows = json.loads((REPO / "benchmarks/context_parallel/context_parallel.json").read_text())
    assert sorted((row["seq_len"], row["cp"]) for row in rows) == [(4096, 1), (4096, 2), (8192, 1), (8192, 2)]

    def estimate(row: dict, cp: int) -> list[int]:
        shape = JobShape.of_model(
            seq_llama3_flavors["debugmodel"], row["seq_len"], 4, "compute", length_multiple=64, cp=cp, microbatches=4
        )
        config = mm.MemoryConfig("debugmodel", shape, "Seq1F1B", pp=2, device="cpu", mixed_precision_param="float32")
        return [r.activations for r in mm.predict_memory(config).ranks]

    for row in rows:
        per_pipeline_rank = [max(row["peak_activation_bytes"][r * row["cp"] : (r + 1) * row["cp"]]) for r in (0, 1)]
        assert estimate(row, row["cp"]) == pytest.approx(per_pipeline_rank, rel=0.01), row
        if row["cp"] > 1:
            assert min(e / m - 1 for e, m in zip(estimate(row, 1), per_pipeline_rank)) > 0.4


def _worst(mode: str) -> float:
    return max(abs(x) for e in _errors(mode).values() for x in e)


def test_wrong_models_miss(monkeypatch):
    """The check bites: a model without the MLP's SiLU and product, one without the loss's
    log-softmax, and one that ignores the schedule (a single microbatch in flight) miss by over 10%."""
    assert _worst("none") < TOLERANCE
    layer = mm.layer_bytes

    def no_swiglu(args, c, a, mode, unit):
        return layer(args, c, a, mode, unit) - (2 * a * mm.ffn_hidden_dim(args) / c.tp if mode == "none" else 0)

    with monkeypatch.context() as patch:
        patch.setattr(mm.activations, "layer_bytes", no_swiglu)
        assert _worst("none") > TOLERANCE
    saved = mm.saved_per_token

    def no_log_softmax(args, c, a, layers, first, last, unit):
        return saved(args, c, a, layers, first, last, unit) - (4 * args.vocab_size if last else 0)

    with monkeypatch.context() as patch:
        patch.setattr(mm.stage_bytes, "saved_per_token", no_log_softmax)
        assert _worst("none") > TOLERANCE

    def one_microbatch(plan, weights, lengths, n, with_own=False, offload=False, reach_extents=None):
        return [(max(sum(weights[s].saved) for s in plan.stages_of(rank)), 0.0, 0.0) for rank in sorted(plan.order)]

    with monkeypatch.context() as patch:
        patch.setattr(mm.estimate, "memory_walks", one_microbatch)
        assert _worst("none") > TOLERANCE


def _uniform_weights(plan: mm.ActionPlan, lengths: list[int], share: float) -> dict:
    unit = [length / sum(lengths) * share for length in lengths]
    return {s: mm.StageBytes(unit) for s in plan.stages}


@pytest.mark.parametrize(
    "schedule,p,n,k",
    [
        ("1F1B", 4, 8, 1),
        ("Interleaved1F1B", 4, 8, 1),
        ("GPipe", 2, 4, 1),
        ("Seq1F1B", 4, 8, 4),
        ("TeraPipe", 2, 4, 3),
        ("InterleavedSeq1F1B", 4, 6, 2),
        ("BSIPipe", 4, 8, 2),
        ("Chimera", 4, 8, 2),
    ],
)
def test_walk_reproduces_the_simulators_peak(schedule, p, n, k):
    """Unit weights in M, L_j / S on a stage with 1/p of the layers: the simulator's peak."""
    result = simulate(SimConfig(schedule, p, n, k, seq_len=840))
    plan = mm.action_plan(schedule, p, n, k, None, False)
    weights = _uniform_weights(plan, result.lengths, p / plan.chain_length)
    peaks = [act for act, _, _ in mm.memory_walks(plan, weights, tuple(result.lengths), n)]
    assert peaks == pytest.approx(result.peak_activations, abs=1e-9)


@pytest.mark.parametrize(
    "schedule,n,k",
    [
        ("1F1B", 20, 1),
        ("Interleaved1F1B", 20, 1),
        ("GPipe", 20, 1),
        ("Seq1F1B", 23, 3),
        ("TeraPipe", 20, 2),
        ("InterleavedSeq1F1B", 20, 2),
        ("InterleavedSeq1F1B", 22, 1),
        ("BSIPipe", 20, 2),
        ("Chimera", 22, 2),
    ],
)
def test_peak_from_fewer_microbatches(schedule, n, k):
    """N on p = 4 is built as 2p + N mod p microbatches: the same peaks as the whole step (GPipe
    and TeraPipe scaled by N over that), remainders that join earlier rounds included."""
    p = 4
    plan = mm.action_plan(schedule, p, n, k, None, False)
    assert plan.built_microbatches == 2 * p + n % p
    built = build(SimConfig(schedule, p, n, k))
    whole = mm.ActionPlan(
        {
            r: tuple(leaf for a in acts if a is not None for leaf in compute_leaves(a))
            for r, acts in built.order.items()
        },
        plan.chain_length,
        plan.parameter_copies,
        n,
    )
    lengths = (1,) * k
    weights = _uniform_weights(plan, lengths, 1.0)
    for r in range(p):
        walks = [mm.memory_walks(steps, weights, lengths, n)[r][0] for steps in (plan, whole)]
        assert walks[0] == pytest.approx(walks[1]), r


def test_kv_context_under_checkpointing(monkeypatch):
    """benchmarks/documents: rank 0 of Seq1F1B (p 2, N 4, k 4 even, 4096 tokens, the debug
    model's 6 layers as one stage) under full AC; the context held 62914560 bytes at most (one
    arena shared by two microbatches: the keys of 5 units, those of the units in flight).
    Without the KV context's term (as if recomputation read nothing the context keeps) the
    prediction misses it by far."""
    measured = json.loads((REPO / "benchmarks/documents/documents.json").read_text())
    measured = measured["runs"]["causal-ac_full"]["kv_context_peak_bytes"]
    args = seq_llama3_flavors["debugmodel"]
    plan = mm.action_plan("Seq1F1B", 2, 4, 4, None, False)
    config = mm.MemoryConfig(
        "debugmodel", JobShape(4096, 4, microbatches=4), "Seq1F1B", pp=2, device="cpu", activation_checkpoint="full"
    )

    def held_peak() -> float:
        held = mm.bytes_of_stage(args, config, 4, (args.n_layers, False, False), [1024] * 4, True).held
        zeros = [0.0] * 4
        weights = {s: mm.StageBytes(zeros, held=held) for s in plan.stages}
        return mm.memory_walks(plan, weights, (1024,) * 4, 4)[0][1]

    assert held_peak() == measured
    with monkeypatch.context() as patch:
        patch.setattr(mm.stage_bytes, "recomputed_fraction", lambda c: 0.0)
        assert abs(held_peak() / measured - 1) > TOLERANCE
    # Without recomputation the context's blocks are the K/V autograd saves: no extra.
    assert mm.recomputed_fraction(dataclasses.replace(config, activation_checkpoint="none")) == 0


def _measured_layer(args, dtype: torch.dtype, length: int) -> float:
    """Bytes per token one transformer block of ``args`` saves, run as a unit through a KV context."""
    args = dataclasses.replace(args, n_layers=1, max_seq_len=2 * length)
    with torch.device("meta"):
        model = SeqTransformer(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    model.layers.to(dtype)
    context = KVContext()
    bind_kv_context(model, context, select_kernel(torch.device("cpu")))
    memory = ActivationMemory()
    x = torch.randn(1, length, args.dim, dtype=dtype, requires_grad=True)
    with memory.track(), context.running(Unit(0, 0, 0, length, 2)):
        model.layers["0"](x, model.freqs_cis, None, torch.arange(length).unsqueeze(0))
    return memory.peak / length


@pytest.mark.parametrize("n_kv_heads,ffn_dim_multiplier", [(None, None), (4, 1.5)])
def test_layer_bytes_against_autograd(n_kv_heads, ffn_dim_multiplier):
    """One block's saved bytes per token on the CPU (float32), MHA and GQA with a wider MLP."""
    args = dataclasses.replace(
        seq_llama3_flavors["debugmodel"], n_kv_heads=n_kv_heads, ffn_dim_multiplier=ffn_dim_multiplier
    )
    config = mm.MemoryConfig(args, JobShape(512), "Seq1F1B", device="cpu")
    predicted = mm.layer_bytes(args, config, 4, "none", unit=True)
    assert predicted == pytest.approx(_measured_layer(args, torch.float32, 512), rel=0.01)


@pytest.mark.parametrize("flavor", ["debugmodel", "8B"])
def test_parameter_count(flavor):
    args = seq_llama3_flavors[flavor]
    with torch.device("meta"):
        model = SeqTransformer(args)
    total = sum(p.numel() for p in model.parameters())
    chunks = mm.memory_chunk_split(args.n_layers, 1)
    assert chunk_parameters(args, *chunks[0], 1) == total
    # Two chunks (pp 2) split the same parameters; tp 2 halves all but the norms.
    assert sum(chunk_parameters(args, *c, 1) for c in mm.memory_chunk_split(args.n_layers, 2)) == total
    norms = (2 * args.n_layers + 1) * args.dim
    assert chunk_parameters(args, *chunks[0], 2) == (total - norms) / 2 + norms


def test_state_bytes_and_copies():
    """Mirrored copies double parameters and gradients, not optimizer states; FSDP shards
    master weights and states and keeps an unsharded bf16 copy and fp32 gradients."""
    shape = JobShape(2048, 2, microbatches=4)
    one = mm.predict_memory(mm.MemoryConfig("debugmodel", shape, "Seq1F1B", pp=2))
    copies = mm.predict_memory(mm.MemoryConfig("debugmodel", shape, "Chimera", pp=2))
    whole = one.ranks[0].parameters + one.ranks[1].parameters
    assert copies.ranks[0].parameters == copies.ranks[1].parameters == whole
    assert copies.ranks[0].gradients == whole  # fp32 everywhere: no FSDP with pp and no dp
    assert copies.ranks[0].optimizer + copies.ranks[1].optimizer == 2 * whole
    fsdp = mm.predict_memory(mm.MemoryConfig("debugmodel", shape, "Seq1F1B", pp=2, dp_shard=4))
    n = one.ranks[0].parameters / 4  # parameters of rank 0's stage
    assert fsdp.ranks[0].parameters == pytest.approx(n * (4 / 4 + 2))
    assert fsdp.ranks[0].gradients == pytest.approx(n * 4)
    assert fsdp.ranks[0].optimizer == pytest.approx(n * 8 / 4)
    assert fsdp.total == max(r.total for r in fsdp.ranks)


def test_bad_settings():
    with pytest.raises(ValueError, match="activation_checkpoint"):
        mm.MemoryConfig("8B", JobShape(8192), activation_checkpoint="memory_budget")
    with pytest.raises(ValueError, match="compute_dtype"):
        mm.MemoryConfig("8B", JobShape(8192), compute_dtype="bf16")
    with pytest.raises(ValueError, match="selective_ac_option"):
        mm.MemoryConfig("8B", JobShape(8192), activation_checkpoint="selective", selective_ac_option="every")
    with pytest.raises(ValueError, match="model = 'llama9'"):
        mm.predict_memory(mm.MemoryConfig("llama9", JobShape(8192)))


def _floor_cases(flavors=(("debugmodel", 2048), ("8B", 65536), ("70B", 131072))):
    """Jobs across flavors, schedules, pipeline, TP and CP degrees and AC modes, as the planner asks."""
    from torchtitan_seq import plan as planner

    for flavor, seq_len in flavors:
        job = planner.Job(flavor, seq_len, 8)
        for i, choice in enumerate(planner.CHOICES):
            for pp in (2, 4, 8):
                for tp, cp, ac in ((1, 1, "none"), (2, 2, "selective"), (1, 4, "full"), (8, 1, "none")):
                    if (i + pp + tp) % 3 or planner.cut_lengths(job, choice, tp, cp) is None:
                        continue  # a third of them, each flavor a different third
                    if not planner.schedule_runs(choice, pp, 8, planner.flavor_shape(flavor).n_layers):
                        continue
                    yield mm.MemoryConfig(
                        flavor, job.shape(choice, tp, cp), choice.schedule, pp, dp_shard=4, activation_checkpoint=ac
                    )


def test_the_floor_is_below_the_estimate_and_close_to_it_once_walked():
    """memory_floor never exceeds predict_memory's total (it decides what the planner drops unasked), and
    with the lists (walked) it is most of it: it is what lets the planner estimate so few configurations."""
    ratios = []
    for config in _floor_cases():
        total = mm.predict_memory(config).total
        floor, walked = mm.memory_floor(config), mm.memory_floor(config, walked=True)
        assert floor <= walked <= total, (config, floor, walked, total)
        ratios.append(walked / total)
    ratios.sort()
    assert len(ratios) > 150 and ratios[len(ratios) // 2] > 0.85 and ratios[0] > 0.3, ratios[:: len(ratios) // 10]


def test_the_floor_places_stages_as_the_lists_do():
    """memory_floor counts each rank's stages from the schedule's placement (stages_by_rank), without
    the lists: the very stages the built lists run on each rank."""
    from torchtitan_seq.simulate.build import stages_by_rank

    for config in _floor_cases(flavors=(("debugmodel", 2048),)):
        shape = config.shape
        plan = mm.action_plan(config.schedule, config.pp, 8, shape.num_subsequences, shape.stages_per_rank, False)
        placed = stages_by_rank(config.schedule, config.pp, shape.stages_per_rank)
        assert placed == tuple(tuple(plan.stages_of(r)) for r in range(config.pp)), config.schedule
