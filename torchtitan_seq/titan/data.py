"""Offline text corpora shipped with torchtitan_seq (:mod:`torchtitan_seq.assets`) as torchtitan datasets.

:func:`torchtitan_seq.titan.v022.registration.register` puts :data:`SHIPPED_DATASETS` into torchtitan's dataset
table, so an installed copy trains without network access (``--model.hf_assets_path`` at
:data:`TOKENIZER_DIR`). ``seqpp_text`` and ``seqpp_text_validation`` hold long documents, each longer
than a sequence; ``seqpp_packed`` and ``seqpp_packed_validation`` short ones (median about 400
tokens), many packed into each sequence, for block-causal training.
"""

import operator
from pathlib import Path

from datasets import Dataset, load_dataset
from torchtitan.hf_datasets import DatasetConfig

from torchtitan_seq.assets import ASSETS_DIR, TOKENIZER_DIR  # noqa: F401

DATASET_NAME = "seqpp_text"
VALIDATION_DATASET_NAME = "seqpp_text_validation"
PACKED_DATASET_NAME = "seqpp_packed"
PACKED_VALIDATION_DATASET_NAME = "seqpp_packed_validation"
SHIPPED_DATASETS: dict[str, Path] = {
    DATASET_NAME: ASSETS_DIR / "text" / "train.jsonl.gz",
    VALIDATION_DATASET_NAME: ASSETS_DIR / "text" / "validation.jsonl.gz",
    PACKED_DATASET_NAME: ASSETS_DIR / "text" / "packed.jsonl.gz",
    PACKED_VALIDATION_DATASET_NAME: ASSETS_DIR / "text" / "packed_validation.jsonl.gz",
}


def _load_jsonl(path: str) -> Dataset:
    # The "json" builder ships inside ``datasets``: nothing is fetched from the Hub.
    return load_dataset("json", data_files=path, split="train")


def dataset_config(name: str) -> DatasetConfig:
    """torchtitan dataset config for the shipped dataset ``name`` (a key of :data:`SHIPPED_DATASETS`)."""
    return DatasetConfig(
        path=str(SHIPPED_DATASETS[name]), loader=_load_jsonl, sample_processor=operator.itemgetter("text")
    )


def add_to(table: dict[str, DatasetConfig]) -> None:
    """Put the shipped datasets into torchtitan's dataset table (``text_datasets.DATASETS``, the same in
    0.2.2 and 0.3), leaving any entry of the same name; idempotent."""
    for name in SHIPPED_DATASETS:
        table.setdefault(name, dataset_config(name))
