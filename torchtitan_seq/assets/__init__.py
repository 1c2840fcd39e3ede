"""Files shipped with torchtitan_seq so that an installed copy trains offline.

Built by ``tools/build_assets.py`` from the Python standard library's documentation: a
byte-level BPE tokenizer (2048 ids) in HuggingFace layout under ``tokenizer/``, and gzipped
JSON-lines corpora (key "text") under ``text/``, which :mod:`torchtitan_seq.titan.data` names.
"""

from pathlib import Path

ASSETS_DIR: Path = Path(__file__).resolve().parent
TOKENIZER_DIR: Path = ASSETS_DIR / "tokenizer"
