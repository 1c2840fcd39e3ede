"""The flavors' shapes and chunk cut the planner reads without torchtitan are torchtitan's, and what the cost
models count of them (parameters, FLOPs) is what torchtitan's models hold."""

from __future__ import annotations

import copy
import importlib
from dataclasses import fields

import pytest
import torch
from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

from torchtitan_seq.runtime.partition import UnitCost
from torchtitan_seq.simulate.network import parameter_count
from torchtitan_seq.titan.family_flavors import FAMILY_SHAPES
from torchtitan_seq.titan.flavors import ModelShape, chunk_split, flavor_shapes, model_shape
from torchtitan_seq.titan.v022.models.llama3_seq import seq_llama3_flavors


def test_every_flavor_has_torchtitans_shape():
    assert set(flavor_shapes) == set(seq_llama3_flavors)
    for name, shape in flavor_shapes.items():
        args = seq_llama3_flavors[name]
        assert shape == ModelShape(
            **{f.name: getattr(args, f.name) for f in fields(ModelShape) if hasattr(args, f.name)}
        ), name


@pytest.mark.parametrize("n_layers", [*range(1, 13), 32, 80, 126])
def test_chunk_split_is_torchtitans(n_layers):
    for num_chunks in range(1, n_layers + 5):
        try:
            names = generate_llm_fqn_per_model_part(num_chunks, n_layers, 1, 1)
        except ValueError:
            assert chunk_split(n_layers, num_chunks) is None, num_chunks
            continue
        expected = tuple(
            (sum(n.startswith("layers.") for n in chunk), "tok_embeddings" in chunk, "output" in chunk)
            for chunk in names
        )
        assert chunk_split(n_layers, num_chunks) == expected, num_chunks


FAMILIES = {
    "qwen3": ("torchtitan.models.qwen3", "qwen3_args", "torchtitan.models.qwen3.model.model", "Qwen3Model"),
    "deepseek_v3": (
        "torchtitan.models.deepseek_v3",
        "deepseekv3_args",
        "torchtitan.models.deepseek_v3.model.model",
        "DeepSeekV3Model",
    ),
    "llama4": ("torchtitan.models.llama4", "llama4_args", "torchtitan.models.llama4.model.model", "Transformer"),
    "gpt_oss": ("torchtitan.models.gpt_oss", "gptoss_configs", "torchtitan.models.gpt_oss.model.model", "GptOssModel"),
}
"""Per family: torchtitan 0.2.2's module of flavors, its table, the model's module and class."""


def _torchtitan_table(family: str) -> dict:
    module, table, _, _ = FAMILIES[family]
    return getattr(importlib.import_module(module), table)


def _meta_model(family: str, args):
    """torchtitan's model of ``args`` on the meta device (no memory); DeepSeek-V3's MoE backend is set by
    the trainer (``update_from_config``), here to the standard one."""
    _, _, module, name = FAMILIES[family]
    args = copy.deepcopy(args)
    args.moe_impl = "standard"
    with torch.device("meta"):
        return getattr(importlib.import_module(module), name)(args), args


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_flavor_has_torchtitans_shape(family):
    table = _torchtitan_table(family)
    assert set(FAMILY_SHAPES[family]) == set(table)
    for name, args in table.items():
        assert FAMILY_SHAPES[family][name] == model_shape(args), name


@pytest.mark.parametrize("family", FAMILIES)
def test_parameter_counts_are_those_of_torchtitans_models(family):
    """Every flavor's parameters, all experts', as torchtitan builds the model (an output layer tied to the
    embeddings counted twice, as the pipeline's first and last stages hold it), and those a token runs
    through as torchtitan's own MoE count has them (its FLOPs per token: 6 x active parameters besides the
    embeddings, plus 6 L H (qk + v) per token of the sequence, which also gives the FLOPs of a (query, key)
    pair); the unit cost's FLOPs per token are 2 x those parameters but norms, biases and sinks."""
    for name, args in _torchtitan_table(family).items():
        shape = FAMILY_SHAPES[family][name]
        model, args = _meta_model(family, args)
        built = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
        assert parameter_count(shape) == built, name
        if getattr(args, "moe_enabled", True):
            short, long = (args.get_nparams_and_flops(model, seq)[1] for seq in (1000, 2000))
            pair = (long - short) / (3 * args.n_layers * 1000)
            assert UnitCost.from_model_args(shape).attention == pair, name
            embeddings, active = shape.vocab_size * shape.dim, (short - (long - short)) / 6
            assert parameter_count(shape, active=True) - embeddings == active, name
            linear = UnitCost.from_model_args(shape).linear * shape.n_layers
            assert linear == pytest.approx(2 * active, rel=2e-3), name
