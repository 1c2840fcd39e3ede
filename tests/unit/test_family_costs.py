"""What the cost models count for every model family: a dense model's FLOPs as before, MoE's active widths,
MLA's head widths, attention of bounded reach, the memory model's weights and K/V; and the planner's
``--model FAMILY:FLAVOR``."""

from __future__ import annotations

import dataclasses
import json

import pytest

from torchtitan_seq import plan as planner
from torchtitan_seq.runtime import model_counts
from torchtitan_seq.runtime.layer_shapes import AttentionReach, MoEShape
from torchtitan_seq.runtime.partition import UnitCost, partition_sequence
from torchtitan_seq.runtime.shape import JobShape
from torchtitan_seq.simulate import memory as mm
from torchtitan_seq.simulate.flavors import flavor_shape
from torchtitan_seq.simulate.network import chunk_parameters, parameter_count
from torchtitan_seq.titan.family_flavors import FAMILY_SHAPES


@pytest.mark.parametrize("name", ["8B", "70B", "qwen3:8B", "qwen3:32B"])
def test_a_dense_models_flops_are_the_llama_formula(name):
    """Per layer and token 2 x (q, k, v, o) + 6 dim F + the output layer's share; 4 H hd a pair."""
    s = flavor_shape(name)
    hd, kv = s.head_dim or s.dim // s.n_heads, s.n_kv_heads or s.n_heads
    f = model_counts.ffn_hidden_dim(s)
    linear = 2 * s.dim * hd * (2 * s.n_heads + 2 * kv) + 6 * s.dim * f + 2 * s.dim * s.vocab_size / s.n_layers
    assert UnitCost.from_model_args(s) == UnitCost(linear, 4 * s.n_heads * hd)


def test_moe_flops_count_the_active_experts_and_the_dense_leading_layers():
    """DeepSeek-V3 671B: 3 dense layers of 18432, 58 MoE layers of 8 routed + 1 shared experts of 2048 and a
    router over 256; Qwen3-235B-A22B: 8 of 128 experts of 1536 in every layer."""
    ds = flavor_shape("deepseek_v3:671B")
    mlp = (3 * 18432 + 58 * 9 * 2048) / 61
    attention = 2 * model_counts.attention_weights(ds)
    linear = attention + 6 * 7168 * mlp + 2 * 7168 * 129280 / 61 + 2 * 7168 * 256 * 58 / 61
    assert UnitCost.from_model_args(ds).linear == pytest.approx(linear, rel=1e-12)
    qwen = flavor_shape("qwen3:235B-A22B")
    dense_twin = dataclasses.replace(qwen, moe=None)  # its ffn_width is the active width, 8 x 1536
    router = 2 * 4096 * 128
    assert UnitCost.from_model_args(qwen).linear == UnitCost.from_model_args(dense_twin).linear + router


def test_mla_dims():
    """The 671B's heads: q and K 192 wide (nope 128 + rope 64), V 128, 128 heads; latents of 1536 and 512."""
    s = flavor_shape("deepseek_v3:671B")
    assert s.mla.qk_head_dim == 192
    assert model_counts.head_widths(s) == (128 * 192, 128 * 128)
    assert model_counts.kv_values(s) == 128 * (192 + 128)
    assert model_counts.pair_flops(s) == 2 * 128 * (192 + 128)
    assert model_counts.rope_width(s) == 64
    q = 7168 * 1536 + 1536 * 128 * 192
    kv = 7168 * (512 + 64) + 512 * 128 * (128 + 128)
    assert model_counts.attention_weights(s) == q + kv + 128 * 128 * 7168


def test_windowed_attention_flops_do_not_grow_with_the_prefix():
    """gpt-oss: the even layers read at most 128 keys, so past the window a unit's forward grows with its prefix
    at half the rate of a model whose every layer reads its whole prefix."""
    cost = UnitCost.from_model_args(flavor_shape("gpt_oss:120b"))
    assert cost.bounded == 0.5
    windowed = [cost.reach.pairs(1024, prefix) for prefix in (128, 1000, 10_000, 100_000)]
    assert windowed == [1024 * 128] * 4
    full = dataclasses.replace(cost, reach=None, bounded=0.0)
    growth = cost.forward(1024, 100_000) - cost.forward(1024, 1000)
    assert growth == pytest.approx(0.5 * (full.forward(1024, 100_000) - full.forward(1024, 1000)))


def test_chunked_attention_reads_the_queries_own_chunk():
    """Llama 4's iRoPE: 3 of 4 layers chunked by 8192 tokens; a unit of a chunk's second half reads that
    chunk's first half, whatever precedes the chunk."""
    shape = flavor_shape("llama4:17bx16e_irope")
    cost = UnitCost.from_model_args(shape)
    assert cost.bounded == 0.75 and cost.reach == AttentionReach(chunk=8192, period=4)
    causal = 4096 * 4096 + 4096 * 4096 / 2
    assert cost.reach.pairs(4096, 4096) == cost.reach.pairs(4096, 8192 * 7 + 4096) == causal
    assert cost.reach.pairs(8192, 4096) == 2 * (4096 * 4096 / 2) + 4096 * 4096  # two chunks' parts


def test_bounded_reach_evens_the_compute_cut():
    """Later units cost less extra where half the layers' attention does not grow with the prefix."""
    cuts = {
        name: partition_sequence(131072, 4, cost=UnitCost.from_model_args(flavor_shape(name)))
        for name in ("gpt_oss:120b", "qwen3:235B-A22B")
    }
    assert cuts["gpt_oss:120b"][0] < cuts["qwen3:235B-A22B"][0]


@pytest.mark.parametrize("name,pp", [("deepseek_v3:671B", 4), ("llama4:17bx128e", 8), ("qwen3:235B-A22B", 2)])
def test_the_chunks_hold_every_expert(name, pp):
    """Summed over torchtitan's cut, the chunks hold the model's parameters, every expert's; the first chunk
    holds the dense leading layers."""
    shape = flavor_shape(name)
    chunks = mm.memory_chunk_split(shape.n_layers, pp)
    assert sum(chunk_parameters(shape, *c) for c in chunks) == pytest.approx(parameter_count(shape), rel=1e-12)
    assert parameter_count(shape, active=True) < parameter_count(shape) / 5


def test_a_first_chunk_short_of_the_dense_layers_counts_the_rest_as_moe():
    """61 layers on 32 chunks: the first holds 1 of the 3 dense layers; the next ones are counted as MoE,
    an upper bound."""
    shape = flavor_shape("deepseek_v3:671B")
    chunks = mm.memory_chunk_split(shape.n_layers, 32)
    assert sum(chunk_parameters(shape, *c) for c in chunks) > parameter_count(shape)


def test_the_memory_model_reads_active_widths_and_mlas_kv():
    """An MoE layer saves its active MLP and the token's routed copies; the K/V slab of the 671B holds 128 x
    (192 + 128) values a token and layer."""
    qwen = flavor_shape("qwen3:235B-A22B")
    shape = JobShape(32768, 4, tp=2, microbatches=8)
    config = mm.MemoryConfig(qwen, shape, "Seq1F1B", 4)
    dense_twin = dataclasses.replace(qwen, moe=None)
    extra = mm.layer_bytes(qwen, config, 2, "none", True) - mm.layer_bytes(dense_twin, config, 2, "none", True)
    assert extra == 2 * 2 * 8 * 4096
    ds = flavor_shape("deepseek_v3:671B")
    config = mm.MemoryConfig(ds, shape, "Seq1F1B", 4)
    weights = mm.bytes_of_stage(ds, config, 2, (15, False, False), [8192] * 4, True)
    assert weights.grad == 3 * 8192 * 128 * (192 + 128) / 2 * 2 * 15


def test_the_memory_estimate_counts_every_expert():
    """Parameters, gradients and optimizer states of the fullest rank are those of its chunk, every expert."""
    shape = flavor_shape("gpt_oss:120b")
    job = JobShape(8192, 4, microbatches=8)
    estimate = mm.predict_memory(mm.MemoryConfig("gpt_oss:120b", job, "Seq1F1B", 4, dp_shard=8))
    chunks = mm.memory_chunk_split(shape.n_layers, 4)
    most = max(chunk_parameters(shape, *c) for c in chunks)
    assert estimate.optimizer == pytest.approx(most * 2 * 4 / 8, rel=1e-6)


@pytest.mark.parametrize(
    "model,needle",
    [
        ("mistral:7B", "--model 'mistral:7B': model family 'mistral' is unknown: use one of llama3, qwen3,"),
        ("qwen3:235B", "--model 'qwen3:235B': qwen3 has no flavor '235B': use one of debugmodel,"),
        ("qwen3", "--model 'qwen3': give FAMILY:FLAVOR, a family of llama3, qwen3, deepseek_v3, llama4, gpt_oss"),
    ],
)
def test_an_unknown_model_gets_one_line_naming_it_and_the_known_ones(model, needle, capsys):
    argv = ["--model", model, "--seq-len", "2048", "--gpus", "4", "--gpu-memory-gib", "80", "--local-batch-size", "8"]
    assert planner.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_flavor_is_model_llama3(capsys):
    rest = ["--seq-len", "2048", "--gpus", "4", "--gpu-memory-gib", "4", "--local-batch-size", "8", "--json"]
    outputs = []
    for argv in (["--flavor", "debugmodel", *rest], ["--model", "llama3:debugmodel", *rest]):
        assert planner.main(argv) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    assert "--model.name" not in json.loads(outputs[0])["overrides"]


def test_a_small_moe_plan_names_its_family(capsys):
    argv = ["--model", "qwen3:debugmodel_moe", "--seq-len", "2048", "--gpus", "4", "--gpu-memory-gib", "8"]
    assert planner.main([*argv, "--local-batch-size", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plans"][0]["fits"]
    assert out["overrides"].startswith("--model.name qwen3 --model.flavor debugmodel_moe ")


@pytest.mark.parametrize(
    "model,seq_len,gpus",
    [("qwen3:235B-A22B", 32768, 64), ("deepseek_v3:671B", 131072, 1024), ("gpt_oss:120b", 65536, 256)],
)
def test_the_planner_answers_for_the_big_models(model, seq_len, gpus, capsys):
    argv = ["--model", model, "--seq-len", str(seq_len), "--gpus", str(gpus), "--gpu-memory-gib", "141"]
    assert planner.main([*argv, "--local-batch-size", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    family, flavor = model.split(":")
    assert out["plans"][0]["fits"]
    assert out["overrides"].startswith(f"--model.name {family} --model.flavor {flavor} ")


def test_every_family_flavor_is_known_to_the_tools():
    for family, flavors in FAMILY_SHAPES.items():
        for name, shape in flavors.items():
            assert flavor_shape(name if family == "llama3" else f"{family}:{name}") == shape


def test_the_layer_counts_follow_the_per_layer_rules():
    """The MoE layers (past the dense leading ones, every ``every``-th) and the bounded layers (all but one a
    period), counted in closed form, are those the per-layer rules give."""
    for n in range(0, 100):
        for every in (1, 2, 3):
            for dense in (0, 1, 3):
                moe = MoEShape(8, 2, 16, dense_layers=dense, every=every)
                assert moe.moe_layers(n) == sum(moe.is_moe(i) for i in range(n)), (n, every, dense)
        for period in (1, 2, 4):
            for phase in range(period):
                reach = AttentionReach(window=4, period=period, global_phase=phase)
                assert reach.bounded_layers(n) == sum(i % period != phase for i in range(n)), (n, period, phase)
