"""Offline text corpora and tokenizer shipped with torchtitan_seq.

``tools/build_assets.py`` builds the files under ``assets/`` from the Python
standard library's documentation, so an installed copy trains without network
access. Point ``--model.hf_assets_path`` at :data:`TOKENIZER_DIR`; the datasets
of :data:`SHIPPED_DATASETS` go into torchtitan's dataset table
(:func:`torchtitan_seq.registration.register`):

* ``seqpp_text`` and ``seqpp_text_validation``: long documents, each longer than a sequence;
* ``seqpp_packed`` and ``seqpp_packed_validation``: short documents (median about 400
  tokens), many packed into each sequence, for block-causal training.
"""

from pathlib import Path
from typing import Any

from datasets import Dataset, load_dataset
from torchtitan.hf_datasets import DatasetConfig

from .assets import (  # noqa: F401
    ASSETS_DIR,
    PACKED_TRAIN_FILE,
    PACKED_VALIDATION_FILE,
    TOKENIZER_DIR,
    TRAIN_FILE,
    VALIDATION_FILE,
)

DATASET_NAME = "seqpp_text"
VALIDATION_DATASET_NAME = "seqpp_text_validation"
PACKED_DATASET_NAME = "seqpp_packed"
PACKED_VALIDATION_DATASET_NAME = "seqpp_packed_validation"
SHIPPED_DATASETS: dict[str, Path] = {
    DATASET_NAME: TRAIN_FILE,
    VALIDATION_DATASET_NAME: VALIDATION_FILE,
    PACKED_DATASET_NAME: PACKED_TRAIN_FILE,
    PACKED_VALIDATION_DATASET_NAME: PACKED_VALIDATION_FILE,
}


def load_jsonl(path: str) -> Dataset:
    """Load a gzipped JSON-lines file as a map-style dataset.

    The "json" builder ships inside ``datasets``, so nothing is fetched from
    the Hub.
    """
    return load_dataset("json", data_files=path, split="train")


def sample_text(sample: dict[str, Any]) -> str:
    """Return the text of one corpus record."""
    return sample["text"]


def dataset_config(name: str) -> DatasetConfig:
    """torchtitan dataset config for the shipped dataset ``name`` (a key of :data:`SHIPPED_DATASETS`)."""
    return DatasetConfig(path=str(SHIPPED_DATASETS[name]), loader=load_jsonl, sample_processor=sample_text)
