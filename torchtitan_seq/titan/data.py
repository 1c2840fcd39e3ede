"""Offline text corpora shipped with torchtitan_seq (:mod:`torchtitan_seq.assets`) as torchtitan datasets.

Each torchtitan version's ``register`` (:mod:`torchtitan_seq.titan.v022.registration`,
:mod:`torchtitan_seq.titan.v03.registration`) puts :data:`SHIPPED_DATASETS` into torchtitan's dataset
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
    """torchtitan's dataset config for a shipped dataset.

    Args:
        name: a key of :data:`SHIPPED_DATASETS`.

    Returns:
        The config: its gzipped JSON-lines file, loaded with ``datasets``' own ``json`` builder, each
        sample's ``text`` field the text.
    """
    return DatasetConfig(
        path=str(SHIPPED_DATASETS[name]), loader=_load_jsonl, sample_processor=operator.itemgetter("text")
    )


def add_to(table: dict[str, DatasetConfig]) -> None:
    """Put the shipped datasets into torchtitan's dataset table, leaving any entry of the same name.

    Idempotent.

    Args:
        table: torchtitan's table, ``text_datasets.DATASETS`` (the same in 0.2.2 and 0.3), updated in place.
    """
    for name in SHIPPED_DATASETS:
        table.setdefault(name, dataset_config(name))
