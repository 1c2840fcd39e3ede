"""Under torchtitan 0.3, Qwen3, DeepSeek-V3 and gpt-oss through every sequence schedule, exact; their
config functions and the job check's family rules.

Qwen3 (QK-norm, heads of a width of their own) dense and with MoE layers (4 experts, 2 routed per token,
one shared); DeepSeek-V3 (multi-head latent attention: values narrower than queries and keys, YaRN RoPE on
the decoupled part, a dense first layer, then MoE layers with a shared expert); gpt-oss (a sliding window
of 6 on every other layer, narrower than any unit, so windows cross units; a learned sink a head; biases;
MoE layers). Each built from 0.3's own configs behind torchtitan_seq's one seam
(:func:`~torchtitan_seq.titan.v03.model.sequence_model_config`), parallelised by the family's own
``parallelize_fn``, against the whole-sequence reference (:mod:`harness`: the family's own attention
modules with dense attention): loss, every parameter's gradient and the tokens each MoE layer counted per
expert. DeepSeek-V3 also with ``kv_context = "latent"`` (MLA's latent kept, its prefix expanded per unit),
and its mutation. The variants run in two process groups (2 ranks, then 4), as
``tests/exactness/test_families.py`` runs 0.2.2's.
"""

from __future__ import annotations

import time

import pytest

from harness import Variant, assert_breaks_exactness, assert_exact, run_variants
from titan03_run import parse_job
from torchtitan_seq.titan.version import TITAN_03

pytestmark = pytest.mark.skipif(not TITAN_03, reason="torchtitan 0.3's families need torchtitan 0.3")

FAMILIES = ("qwen3", "qwen3_moe")
NEW_FAMILIES = ("deepseek_v3", "gpt_oss")
SCHEDULES = ("Seq1F1B", "TeraPipe", "InterleavedSeq1F1B", "BSIPipe", "Chimera")


def _schedule_variant(family: str, schedule: str, k: int, partition: str) -> Variant:
    """``schedule`` at ``k`` on the ``partition`` cut; BSIPipe's and Chimera's copies compared after optimizer
    steps (their syncs included)."""
    steps = 2 if schedule in ("BSIPipe", "Chimera") else 0
    name = f"{family}-{schedule}-k{k}-{partition}"
    return Variant(name, schedule, k=k, partition=partition, family=family, optimizer_steps=steps)


def _two_ranks() -> list[Variant]:
    """Every schedule at k 2 and 4 for each Qwen3 family, the cut alternating (the other family takes the
    other); every schedule at k 1 to 4 for DeepSeek-V3 and gpt-oss, the cut alternating with k (each family
    its own), then full AC and packed documents for each; packed documents through Qwen3."""
    variants = [
        _schedule_variant(family, schedule, k, ("even", "compute")[(k // 2 + f) % 2])
        for f, family in enumerate(FAMILIES)
        for schedule in SCHEDULES
        for k in (2, 4)
    ]
    variants += [
        _schedule_variant(family, schedule, k, ("even", "compute")[(k + f) % 2])
        for f, family in enumerate(NEW_FAMILIES)
        for schedule in SCHEDULES
        for k in (1, 2, 3, 4)
    ]
    variants += [
        Variant(f"{family}-full-ac-k3", k=3, partition="compute", ac="full", family=family) for family in NEW_FAMILIES
    ]
    variants += [
        Variant(f"{family}-documents-k4", k=4, partition="compute", documents=True, family=family)
        for family in ("qwen3", *NEW_FAMILIES)
    ]
    return variants + _latent()


LATENT = dict(family="deepseek_v3", kv_context="latent")


def _latent() -> list[Variant]:
    """DeepSeek-V3 keeping MLA's latent in its K/V context: every schedule (k 2 and 4, the cut alternating),
    split backward, full AC, packed documents; and its mutation, the prefix's latent gradient dropped."""
    variants = [
        Variant(
            f"deepseek_v3-latent-{s}-k{k}",
            s,
            k=k,
            partition=("even", "compute")[i % 2],
            optimizer_steps=steps,
            **LATENT,
        )
        for i, (s, k, steps) in enumerate(
            [("Seq1F1B", 4, 0), ("TeraPipe", 2, 0), ("InterleavedSeq1F1B", 2, 0), ("BSIPipe", 2, 2), ("Chimera", 4, 2)]
        )
    ]
    return variants + [
        Variant("deepseek_v3-latent-k3-split-backward", k=3, partition="compute", split_backward=True, **LATENT),
        Variant("deepseek_v3-latent-ac-full-k3", k=3, ac="full", **LATENT),
        Variant("deepseek_v3-latent-documents-k4", k=4, partition="compute", documents=True, **LATENT),
        Variant("mutation-latent_prefix_grad_dropped", k=4, mutation="latent_prefix_grad_dropped", **LATENT),
    ]


FOUR_RANKS = [
    Variant(f"{family}-pp2-{name}-k4", k=4, partition="compute", seq_len=64, family=family, **degrees)
    for family in (*FAMILIES, *NEW_FAMILIES)
    for name, degrees in (("fsdp2", {"dp_shard": 2}), ("tp2", {"tp": 2}))
] + [
    Variant(f"deepseek_v3-latent-pp2-{name}-k4", k=4, partition="compute", seq_len=64, **LATENT, **degrees)
    for name, degrees in (("fsdp2", {"dp_shard": 2}), ("tp2", {"tp": 2}))
]
TWO_RANKS = _two_ranks()
MUTATED = [v.name for v in TWO_RANKS if v.mutation]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = {}
    for variants in (TWO_RANKS, FOUR_RANKS):
        start = time.perf_counter()
        out.update({r["name"]: r for r in run_variants(variants, tmp_path_factory.mktemp("titan03_families"))})
        print(f"{len(variants)} variants on {variants[0].world} ranks: {time.perf_counter() - start:.1f} s")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", [v.name for v in TWO_RANKS + FOUR_RANKS if not v.mutation])
def test_each_family_is_exact_against_the_whole_sequence(results, name):
    r = results[name]
    # FSDP and TP: one loss per microbatch on the last stage, as torch's schedules
    assert_exact(r, n_losses=2 if name in {v.name for v in FOUR_RANKS} else None)
    print(f"{name}: loss {r['loss_rel']:.2g}, gradients {r['grad_rel']:.2g} (worst {r['worst_param']})")


@pytest.mark.slow
@pytest.mark.parametrize("name", MUTATED)
def test_each_mutation_misses_the_reference(results, name):
    assert_breaks_exactness(results[name])


@pytest.mark.parametrize("family,layers", [("qwen3_moe", 4), ("deepseek_v3", 3), ("gpt_oss", 4)])
def test_the_tiny_moe_counts_its_tokens_where_the_harness_reads_them(family, layers):
    """The MoE comparison is not vacuous: the harness reads 0.3's per-expert counters (DeepSeek-V3's first
    layer is dense)."""
    import torch

    from harness import TITAN, expert_counts

    _, whole, _ = TITAN.models(Variant("counts", family=family))
    whole(torch.randint(0, 64, (2, 32)))
    counts = expert_counts(whole)
    assert len(counts) == layers and all(int(c.sum()) == 2 * 32 * 2 for c in counts.values()), counts


@pytest.mark.slow
@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_a_debug_flavor_unit_by_unit_computes_the_whole_sequence(family):
    """The shipped debug flavor itself (DeepSeek-V3's MLA at its widths; gpt-oss's 64 heads with sinks and
    windows of 128 over units of 64), its experts in fp32: 4 units through a KV context give the logits of
    the whole sequence."""
    import torch

    from harness import TITAN
    from torchtitan_seq.attention import bind_kv_context
    from torchtitan_seq.attention.kernels import select_kernel
    from torchtitan_seq.runtime.kv_context import KVContext, Unit
    from torchtitan_seq.titan.v03.model import sequence_model_spec
    from torchtitan_seq.titan.v03.pipeline import pipeline_sequence_llm

    config = sequence_model_spec(family, "debugmodel", pipeline_sequence_llm).model
    TITAN.with_float32_experts(config)  # 0.3's bf16 GEMMs would round each unit's rows apart
    torch.manual_seed(0)
    model = config.build()
    TITAN.init_weights(model)
    lengths = [64] * 4
    tokens = torch.randint(0, config.vocab_size, (2, sum(lengths)))
    context = KVContext(lengths)
    with torch.no_grad():
        whole = model(tokens)
        bind_kv_context(model, context, select_kernel(torch.device("cpu")))
        units = []
        for j, n in enumerate(lengths):
            with context.running(Unit(0, j, j * n, n, len(lengths))):
                units.append(model(tokens[:, j * n : (j + 1) * n]))
    assert float((torch.cat(units, 1) - whole).abs().max() / whole.abs().max()) < 1e-5


@pytest.mark.parametrize(
    "recipe,flavor,experts,windows",
    [
        ("qwen3_debugmodel_moe_seq1f1b", "debugmodel_moe", [64] * 8, [None] * 8),
        ("qwen3_debugmodel_untied_seq1f1b", "debugmodel_untied", [], [None] * 8),
        ("deepseek_v3_debugmodel_seq1f1b", "debugmodel", [8] * 5, [None] * 6),  # its first layer dense
        ("gpt_oss_debugmodel_seq1f1b", "debugmodel", [8] * 4, [128, None, 128, None]),
    ],
)
def test_the_families_config_functions_pass_the_check_and_build_the_family(recipe, flavor, experts, windows):
    """The debug jobs of Qwen3, DeepSeek-V3 and gpt-oss: Seq1F1B on 2 pipeline ranks, the model built on the
    meta device as the family's class with chunk-aware attention in every layer, of the layer's reach (gpt-oss's
    sliding windows), and its output layer untied."""
    import importlib

    import torch

    from torchtitan_seq.titan.v03.job_check import check_job
    from torchtitan_seq.titan.v03.model import SeqInnerAttention

    config = parse_job("--config", recipe)
    family = recipe.split("_debugmodel")[0]
    assert (config.model_spec.name, config.model_spec.flavor) == (f"{family}_seq", flavor)
    assert config.parallelism.pipeline_parallel_schedule == "Seq1F1B"
    check_job(config, 2)
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    family_class = {"qwen3": "Qwen3Model", "deepseek_v3": "DeepSeekV3Model", "gpt_oss": "GptOssModel"}[family]
    assert isinstance(model, getattr(importlib.import_module(f"torchtitan.models.{family}"), family_class))
    assert not model.enable_weight_tying
    assert model.tok_embeddings.weight is not model.lm_head.weight
    inner = [layer.attention.inner_attention for layer in model.layers.values()]
    assert all(isinstance(a, SeqInnerAttention) for a in inner) and [a.reach.window for a in inner] == windows
    n_experts = [
        layer.moe.routed_experts.inner_experts.num_experts for layer in model.layers.values() if layer.moe_enabled
    ]
    assert n_experts == experts


def test_the_job_check_refuses_a_model_without_chunk_aware_attention_in_one_line():
    """0.3's own Qwen3 spec (its flex attention) under a sequence schedule, by model name as 0.2.2."""
    import dataclasses

    from torchtitan.models.qwen3 import model_registry

    from torchtitan_seq.titan.v03.job_check import check_job

    config = parse_job("--config", "qwen3_debugmodel_moe_seq1f1b")
    config.model_spec = dataclasses.replace(
        model_registry("debugmodel_moe"), pipelining_fn=config.model_spec.pipelining_fn
    )
    with pytest.raises(ValueError, match="cannot run model.name = 'qwen3'.*use one of llama3_seq, qwen3_seq") as e:
        check_job(config, 2)
    assert "\n" not in str(e.value)


def test_the_job_check_refuses_a_tied_flavor_in_a_pipeline_in_one_line():
    """Qwen3's dense debug flavor ties its output layer to its embeddings, which 0.3 does not pipeline."""
    from torchtitan_seq.titan.v03.job_check import check_job
    from torchtitan_seq.titan.v03.model import sequence_model_spec

    config = parse_job("--config", "qwen3_debugmodel_untied_seq1f1b")
    config.model_spec = sequence_model_spec("qwen3", "debugmodel", config.model_spec.pipelining_fn)
    with pytest.raises(ValueError, match="'debugmodel'.*ties its output layer") as e:
        check_job(config, 2)
    assert "\n" not in str(e.value)


def test_the_job_check_refuses_gpt_oss_with_tp_in_one_line():
    """0.3's gpt-oss experts add their output bias on every TP rank under its spmd_types backend."""
    from torchtitan_seq.titan.v03.job_check import check_job

    config = parse_job("--config", "gpt_oss_debugmodel_seq1f1b", "--parallelism.tensor-parallel-degree", "2")
    with pytest.raises(ValueError, match="tensor_parallel_degree = 2 with gpt_oss_seq.*set it to 1") as e:
        check_job(config, 4)
    assert "\n" not in str(e.value)


def test_deepseek_v3_with_multi_token_prediction_is_refused():
    """0.3 does not pipeline DeepSeek-V3's multi-token prediction layers."""
    from torchtitan.models.deepseek_v3 import model_registry

    from torchtitan_seq.titan.v03.model import sequence_model_config

    with pytest.raises(ValueError, match="multi-token prediction"):
        sequence_model_config(model_registry("debugmodel", num_mtp_layers=1).model)


def test_the_shape_of_a_0_3_config_is_its_flavors():
    """What the cost models read of 0.3's Llama 3 configs is torchtitan_seq's table's, and of Qwen3's
    MoE debug model its active MLP width (8 routed experts of 768)."""
    from torchtitan_seq.runtime.partition import UnitCost
    from torchtitan_seq.titan.flavors import flavor_shapes, model_shape
    from torchtitan_seq.titan.v03.model import FLAVORS, sequence_model_spec
    from torchtitan_seq.titan.v03.pipeline import pipeline_sequence_llm

    for flavor in FLAVORS["llama3"]:
        shape = model_shape(sequence_model_spec("llama3", flavor, pipeline_sequence_llm).model)
        assert UnitCost.from_model_args(shape) == UnitCost.from_model_args(flavor_shapes[flavor]), flavor
    moe = model_shape(sequence_model_spec("qwen3", "debugmodel_moe", pipeline_sequence_llm).model)
    assert (moe.dim, moe.n_layers, moe.n_heads, moe.n_kv_heads, moe.head_dim, moe.ffn_width) == (
        256,
        8,
        16,
        8,
        128,
        6144,
    )
