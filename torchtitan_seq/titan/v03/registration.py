"""The one place torchtitan_seq registers with torchtitan 0.3: the shipped datasets
(:mod:`torchtitan_seq.titan.data`) in torchtitan's dataset table, its documented place for new datasets.

0.3 has no train-spec registry: the model, its pipelining function and the trainer come with each
config function of :mod:`torchtitan_seq.recipes` (``--module torchtitan_seq.recipes --config F``).
"""

from __future__ import annotations

from torchtitan.hf_datasets import text_datasets

from torchtitan_seq.titan import data

__all__ = ["register"]


def register() -> None:
    """Make the shipped datasets known to torchtitan (idempotent)."""
    data.add_to(text_datasets.DATASETS)
