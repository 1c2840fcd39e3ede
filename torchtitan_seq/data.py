"""Offline text corpus and tokenizer shipped with torchtitan_seq.

``tools/build_assets.py`` builds the files under ``assets/`` from the Python
standard library's documentation, so an installed copy trains without network
access. Point ``--model.hf_assets_path`` at :data:`TOKENIZER_DIR` and register
the configs below in torchtitan's dataset table::

    from torchtitan.hf_datasets.text_datasets import DATASETS

    DATASETS[DATASET_NAME] = dataset_config()
    DATASETS[VALIDATION_DATASET_NAME] = validation_dataset_config()
"""

from typing import Any

from datasets import Dataset, load_dataset
from torchtitan.hf_datasets import DatasetConfig

from .assets import ASSETS_DIR, TOKENIZER_DIR, TRAIN_FILE, VALIDATION_FILE  # noqa: F401

DATASET_NAME = "seqpp_text"
VALIDATION_DATASET_NAME = "seqpp_text_validation"


def load_jsonl(path: str) -> Dataset:
    """Load a gzipped JSON-lines file as a map-style dataset.

    The "json" builder ships inside ``datasets``, so nothing is fetched from
    the Hub.
    """
    return load_dataset("json", data_files=path, split="train")


def sample_text(sample: dict[str, Any]) -> str:
    """Return the text of one corpus record."""
    return sample["text"]


def dataset_config() -> DatasetConfig:
    """torchtitan dataset config for the shipped training split."""
    return DatasetConfig(
        path=str(TRAIN_FILE), loader=load_jsonl, sample_processor=sample_text
    )


def validation_dataset_config() -> DatasetConfig:
    """torchtitan dataset config for the shipped validation split."""
    return DatasetConfig(
        path=str(VALIDATION_FILE), loader=load_jsonl, sample_processor=sample_text
    )
