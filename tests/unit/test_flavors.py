"""The flavors' shapes and chunk cut the planner reads without torchtitan are torchtitan's."""

from __future__ import annotations

from dataclasses import fields

import pytest
from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

from torchtitan_seq.titan.flavors import ModelShape, chunk_split, flavor_shapes
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
