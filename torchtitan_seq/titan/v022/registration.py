"""The one place torchtitan_seq registers with torchtitan, through its own extension points: the train
specs of the model families sequence schedules run, under torchtitan's own model names and the alias
``llama3_seq`` (:mod:`torchtitan_seq.titan.v022.models.train_specs`), and the shipped datasets
(:mod:`torchtitan_seq.titan.data`) in torchtitan's dataset table, its documented place for new datasets;
and, without CUDA, the CPU stand-in for its MoE's Triton token permutation
(:func:`~torchtitan_seq.titan.cpu_compat.moe_permute_on_cpu`).

torchtitan looks a model name up among registered specs before its own packages, so a job naming
``qwen3`` gets the family's spec with chunk-aware attention; it trains exactly as torchtitan's own
under torch's schedules and without a pipeline.
"""

from __future__ import annotations

from torchtitan.hf_datasets import text_datasets
from torchtitan.models.moe import utils as moe_utils
from torchtitan.protocols import train_spec

from torchtitan_seq.titan import cpu_compat, data
from torchtitan_seq.titan.titan_internals import registered_train_specs
from torchtitan_seq.titan.v022.models.train_specs import ALIASES, SEQUENCE_FAMILIES, sequence_train_spec

__all__ = ["MODEL_NAME", "register"]

MODEL_NAME = "llama3_seq"
"""The name the shipped configs give the model (``[model] name``): Llama 3's alias."""


def register() -> None:
    """Make the families' train specs and the shipped datasets known to torchtitan, and its MoE's
    token permutation run on a CPU (idempotent)."""
    data.add_to(text_datasets.DATASETS)
    cpu_compat.moe_permute_on_cpu(moe_utils)
    registered = registered_train_specs()
    for name in (*SEQUENCE_FAMILIES, *ALIASES):
        if name not in registered:
            train_spec.register_train_spec(name, sequence_train_spec(ALIASES.get(name, name)))
