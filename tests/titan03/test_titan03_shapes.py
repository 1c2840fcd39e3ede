"""Under torchtitan 0.3, what the cost models read of every family's configs is what they read of 0.2.2's
flavors (torchtitan_seq's tables): the unit cost and the parameters, every expert's."""

from __future__ import annotations

import dataclasses

import pytest

from torchtitan_seq.titan.version import TITAN_03

pytestmark = pytest.mark.skipif(not TITAN_03, reason="torchtitan 0.3's configs need torchtitan 0.3")


def test_every_families_0_3_config_costs_as_its_flavor():
    from torchtitan_seq.runtime.partition import UnitCost
    from torchtitan_seq.simulate.network import parameter_count
    from torchtitan_seq.titan.family_flavors import FAMILY_SHAPES
    from torchtitan_seq.titan.flavors import model_shape
    from torchtitan_seq.titan.v03.model import FLAVORS, sequence_model_spec
    from torchtitan_seq.titan.v03.pipeline import pipeline_sequence_llm

    compared = 0
    for family, flavors in FLAVORS.items():
        for flavor in set(flavors) & set(FAMILY_SHAPES.get(family, {})):
            table = FAMILY_SHAPES[family][flavor]
            # 0.3's gpt-oss debug model has a vocabulary of its own
            shape = model_shape(sequence_model_spec(family, flavor, pipeline_sequence_llm).model)
            shape = dataclasses.replace(shape, vocab_size=table.vocab_size)
            assert UnitCost.from_model_args(shape) == UnitCost.from_model_args(table), (family, flavor)
            assert parameter_count(shape) == parameter_count(table), (family, flavor)
            compared += 1
    assert compared >= 18  # Llama 3 and Qwen3 at least
