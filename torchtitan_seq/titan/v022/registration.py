"""The one place torchtitan_seq registers with torchtitan, through its own extension points: the train
spec ``llama3_seq`` (:mod:`torchtitan_seq.titan.v022.models.llama3_seq`), and the shipped datasets
(:mod:`torchtitan_seq.titan.data`) in torchtitan's dataset table, its documented place for new datasets.
"""

from __future__ import annotations

from torchtitan.hf_datasets import text_datasets
from torchtitan.protocols import train_spec

from torchtitan_seq.titan import data
from torchtitan_seq.titan.titan_internals import registered_train_specs
from torchtitan_seq.titan.v022.models.llama3_seq import get_train_spec

__all__ = ["MODEL_NAME", "register"]

MODEL_NAME = "llama3_seq"
"""The train spec's name, as jobs name it (``[model] name``)."""


def register() -> None:
    """Make the model, its train spec and the shipped datasets known to torchtitan (idempotent)."""
    data.add_to(text_datasets.DATASETS)
    if MODEL_NAME not in registered_train_specs():
        train_spec.register_train_spec(MODEL_NAME, get_train_spec())
