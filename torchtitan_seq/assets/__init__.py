"""Files shipped with torchtitan_seq so that an installed copy trains offline.

Built by ``tools/build_assets.py`` from the Python standard library's
documentation: a byte-level BPE tokenizer (2048 ids) in HuggingFace layout,
and a text corpus of long documents (gzipped JSON lines, key "text").
The packed corpus holds short documents (median ~400 tokens) cut from the same text.
"""

from pathlib import Path

ASSETS_DIR: Path = Path(__file__).resolve().parent
TOKENIZER_DIR: Path = ASSETS_DIR / "tokenizer"
TRAIN_FILE: Path = ASSETS_DIR / "text" / "train.jsonl.gz"
VALIDATION_FILE: Path = ASSETS_DIR / "text" / "validation.jsonl.gz"
PACKED_TRAIN_FILE: Path = ASSETS_DIR / "text" / "packed.jsonl.gz"
PACKED_VALIDATION_FILE: Path = ASSETS_DIR / "text" / "packed_validation.jsonl.gz"
