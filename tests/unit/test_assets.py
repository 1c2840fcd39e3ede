"""The shipped tokenizer and corpus work with torchtitan without network."""

import socket
import statistics

import pytest
import torchtitan.hf_datasets.text_datasets as text_datasets
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from torchtitan_seq.titan.data import (
    DATASET_NAME,
    PACKED_DATASET_NAME,
    PACKED_VALIDATION_DATASET_NAME,
    SHIPPED_DATASETS,
    TOKENIZER_DIR,
    VALIDATION_DATASET_NAME,
    dataset_config,
)

SEQ_LEN = 16384
SENTENCE = "Return the sum of x ** 2 for x in range(10)  # naïve café ✓\n"


@pytest.fixture
def tokenizer() -> HuggingFaceTokenizer:
    return HuggingFaceTokenizer(str(TOKENIZER_DIR))


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forbid network access and register the datasets in a restorable way."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    # datasets reads the variables above at import time, so also make any
    # connection attempt fail loudly.
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    for name in SHIPPED_DATASETS:
        monkeypatch.setitem(text_datasets.DATASETS, name, dataset_config(name))


def test_tokenizer_fits_debug_model(tokenizer: HuggingFaceTokenizer) -> None:
    assert tokenizer.get_vocab_size() <= 2048
    assert tokenizer.bos_id is not None
    assert tokenizer.eos_id is not None
    assert tokenizer.bos_id != tokenizer.eos_id


def test_tokenizer_round_trips(tokenizer: HuggingFaceTokenizer) -> None:
    plain = tokenizer.encode(SENTENCE, add_bos=False, add_eos=False)
    assert tokenizer.decode(plain) == SENTENCE

    framed = tokenizer.encode(SENTENCE, add_bos=True, add_eos=True)
    assert framed == [tokenizer.bos_id, *plain, tokenizer.eos_id]
    assert tokenizer.decode(framed, skip_special_tokens=True) == SENTENCE


@pytest.mark.usefixtures("offline")
@pytest.mark.parametrize("name", [DATASET_NAME, VALIDATION_DATASET_NAME])
def test_first_sequence_comes_from_one_document(name: str, tokenizer: HuggingFaceTokenizer) -> None:
    dataset = text_datasets.HuggingFaceTextDataset(
        dataset_name=name, dataset_path=None, tokenizer=tokenizer, seq_len=SEQ_LEN
    )
    inputs, labels = next(iter(dataset))

    tokens = inputs["input"]
    assert tokens.shape == (SEQ_LEN,)
    assert labels.shape == (SEQ_LEN,)
    assert tokens[0] == tokenizer.bos_id
    # Documents are longer than SEQ_LEN, so no document boundary falls inside.
    assert not (tokens[1:] == tokenizer.bos_id).any()
    assert not (tokens == tokenizer.eos_id).any()


@pytest.mark.usefixtures("offline")
def test_packed_corpus_has_many_short_documents(tokenizer: HuggingFaceTokenizer) -> None:
    config = dataset_config(PACKED_DATASET_NAME)
    texts = [config.sample_processor(sample) for sample in config.loader(config.path)]
    assert len(texts) >= 1000

    lengths = [len(tokenizer.encode(t, add_bos=False, add_eos=False)) for t in texts]
    assert 200 <= statistics.median(lengths) <= 800
    assert max(lengths) / min(lengths) > 20


@pytest.mark.usefixtures("offline")
@pytest.mark.parametrize("name", [PACKED_DATASET_NAME, PACKED_VALIDATION_DATASET_NAME])
def test_packed_sequence_holds_several_documents(name: str, tokenizer: HuggingFaceTokenizer) -> None:
    dataset = text_datasets.HuggingFaceTextDataset(
        dataset_name=name, dataset_path=None, tokenizer=tokenizer, seq_len=2048
    )
    inputs, _ = next(iter(dataset))

    tokens = inputs["input"]
    # Every document is framed BOS ... EOS; EOS is where a block-causal mask
    # starts a new document.
    assert (tokens == tokenizer.eos_id).sum() >= 2
    assert (tokens == tokenizer.bos_id).sum() >= 2
