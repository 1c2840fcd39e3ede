"""Under torchtitan 0.3, Qwen3 through every sequence schedule, exact, as under 0.2.2; its config functions
and the job check's family rules.

Qwen3 (QK-norm, heads of a width of their own) dense and with MoE layers (4 experts, 2 routed per token,
one shared), built from 0.3's own configs behind torchtitan_seq's one seam
(:func:`~torchtitan_seq.titan.v03.model.sequence_model_config`), parallelised by Qwen3's own
``parallelize_fn``, against the whole-sequence reference (:mod:`harness`): loss, every parameter's
gradient and the tokens each MoE layer counted per expert. The variants run in two process groups (2
ranks, then 4), as ``tests/exactness/test_families.py`` runs 0.2.2's.
"""

from __future__ import annotations

import time

import pytest

from harness import Variant, assert_exact, run_variants
from torchtitan_seq.titan.version import TITAN_03

pytestmark = pytest.mark.skipif(not TITAN_03, reason="torchtitan 0.3's Qwen3 needs torchtitan 0.3")

FAMILIES = ("qwen3", "qwen3_moe")
SCHEDULES = ("Seq1F1B", "TeraPipe", "InterleavedSeq1F1B", "BSIPipe", "Chimera")


def _two_ranks() -> list[Variant]:
    """Every schedule at k 2 and 4 for each family, the cut alternating (the other family takes the
    other); BSIPipe's and Chimera's copies after optimizer steps; packed documents through Qwen3."""
    variants = [
        Variant(
            f"{family}-{schedule}-k{k}-{partition}",
            schedule,
            k=k,
            partition=partition,
            family=family,
            optimizer_steps=2 if schedule in ("BSIPipe", "Chimera") else 0,
        )
        for f, family in enumerate(FAMILIES)
        for schedule in SCHEDULES
        for k in (2, 4)
        for partition in [("even", "compute")[(k // 2 + f) % 2]]
    ]
    return variants + [Variant("qwen3-documents-k4", k=4, partition="compute", documents=True, family="qwen3")]


FOUR_RANKS = [
    Variant(f"{family}-pp2-{name}-k4", k=4, partition="compute", seq_len=64, family=family, **degrees)
    for family in FAMILIES
    for name, degrees in (("fsdp2", {"dp_shard": 2}), ("tp2", {"tp": 2}))
]
TWO_RANKS = _two_ranks()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = {}
    for variants in (TWO_RANKS, FOUR_RANKS):
        start = time.perf_counter()
        out.update({r["name"]: r for r in run_variants(variants, tmp_path_factory.mktemp("titan03_families"))})
        print(f"{len(variants)} variants on {variants[0].world} ranks: {time.perf_counter() - start:.1f} s")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", [v.name for v in TWO_RANKS + FOUR_RANKS])
def test_each_family_is_exact_against_the_whole_sequence(results, name):
    r = results[name]
    # FSDP and TP: one loss per microbatch on the last stage, as torch's schedules
    assert_exact(r, n_losses=2 if name in {v.name for v in FOUR_RANKS} else None)
    print(f"{name}: loss {r['loss_rel']:.2g}, gradients {r['grad_rel']:.2g} (worst {r['worst_param']})")


def test_the_tiny_moe_counts_its_tokens_where_the_harness_reads_them():
    """The MoE comparison is not vacuous: the harness reads 0.3's per-expert counters."""
    import torch

    from harness import TITAN, expert_counts

    _, whole, _ = TITAN.models(Variant("counts", family="qwen3_moe"))
    whole(torch.randint(0, 64, (2, 32)))
    counts = expert_counts(whole)
    assert len(counts) == 4 and all(int(c.sum()) == 2 * 32 * 2 for c in counts.values()), counts


def _parse(*args: str):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--module", "torchtitan_seq.recipes", *args])


@pytest.mark.parametrize(
    "recipe,flavor,experts",
    [
        ("qwen3_debugmodel_moe_seq1f1b", "debugmodel_moe", 64),
        ("qwen3_debugmodel_untied_seq1f1b", "debugmodel_untied", 0),
    ],
)
def test_qwen3s_config_functions_pass_the_check_and_build_qwen3(recipe, flavor, experts):
    """Qwen3's debug jobs: Seq1F1B on 2 pipeline ranks, the model built on the meta device as Qwen3 with
    chunk-aware attention in every layer and its output layer untied."""
    import torch
    from torchtitan.models.qwen3 import Qwen3Model

    from torchtitan_seq.titan.v03.job_check import check_job
    from torchtitan_seq.titan.v03.model import SeqInnerAttention

    config = _parse("--config", recipe)
    assert (config.model_spec.name, config.model_spec.flavor) == ("qwen3_seq", flavor)
    assert config.parallelism.pipeline_parallel_schedule == "Seq1F1B"
    check_job(config, 2)
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    assert isinstance(model, Qwen3Model) and not model.enable_weight_tying
    assert model.tok_embeddings.weight is not model.lm_head.weight
    assert all(isinstance(layer.attention.inner_attention, SeqInnerAttention) for layer in model.layers.values())
    n_experts = [
        layer.moe.routed_experts.inner_experts.num_experts for layer in model.layers.values() if layer.moe_enabled
    ]
    assert n_experts == ([experts] * len(model.layers) if experts else [])


def test_the_job_check_refuses_a_model_without_chunk_aware_attention_in_one_line():
    """0.3's own Qwen3 spec (its flex attention) under a sequence schedule, by model name as 0.2.2."""
    import dataclasses

    from torchtitan.models.qwen3 import model_registry

    from torchtitan_seq.titan.v03.job_check import check_job

    config = _parse("--config", "qwen3_debugmodel_moe_seq1f1b")
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

    config = _parse("--config", "qwen3_debugmodel_untied_seq1f1b")
    config.model_spec = sequence_model_spec("qwen3", "debugmodel", config.model_spec.pipelining_fn)
    with pytest.raises(ValueError, match="'debugmodel'.*ties its output layer") as e:
        check_job(config, 2)
    assert "\n" not in str(e.value)


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
