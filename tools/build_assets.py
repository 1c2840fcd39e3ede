"""Build the offline training assets shipped in ``torchtitan_seq/assets``.

Writes::

    torchtitan_seq/assets/text/train.jsonl.gz
    torchtitan_seq/assets/text/validation.jsonl.gz
    torchtitan_seq/assets/tokenizer/tokenizer.json
    torchtitan_seq/assets/tokenizer/tokenizer_config.json

The corpus is the Python standard library's own documentation: the pydoc text
of every importable stdlib module, the docstrings of their source files and the
language reference topics pydoc ships in ``pydoc_data``. Building therefore
needs no network, and re-running it on the same Python build rewrites
byte-identical files.

Usage (from the repository root, inside the virtualenv)::

    python tools/build_assets.py
"""

import ast
import gzip
import importlib
import inspect
import json
import os
import pkgutil
import pydoc
import pydoc_data.topics
import re
import statistics
import sys
import warnings
from pathlib import Path
from types import ModuleType

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO_ROOT = Path(__file__).resolve().parents[1]
ASSETS_DIR = REPO_ROOT / "torchtitan_seq" / "assets"
TEXT_DIR = ASSETS_DIR / "text"
TOKENIZER_DIR = ASSETS_DIR / "tokenizer"

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
# torchtitan's Llama 3 debug model embeds 2048 ids; this count includes BOS/EOS.
VOCAB_SIZE = 2048
# Longer than a 16k-token training sequence, so a packed sequence can be cut
# from a single document.
MIN_DOC_TOKENS = 20_000
VALIDATION_DOCS = 10

SKIPPED_MODULES = frozenset(
    {
        "antigravity",  # opens a web browser on import
        "this",  # prints on import
        "idlelib",  # Tk GUI applications rather than library documentation
        "tkinter",
        "turtle",
        "turtledemo",
        "lib2to3",  # writes grammar caches next to its source on import
        "test",  # CPython's regression suite, not documentation
    }
)
# Submodules of these are near-identical boilerplate (one codec per module).
UNWALKED_PACKAGES = frozenset({"encodings"})
# pydoc sections that name files on this machine, dump live module state
# (os.environ, sys.path, time zones) or depend on the Python patch version.
DROPPED_SECTIONS = frozenset({"MODULE REFERENCE", "FILE", "DATA"})
MACHINE_MARKERS = (
    "/usr/",
    "/root",
    ".pyenv",
    "site-packages",
    sys.prefix,
    sys.base_prefix,
    str(Path.home()),
    str(REPO_ROOT),
)
BUILD_ENV = {"PYTHONHASHSEED": "0", "BUILD_ASSETS_ISOLATED": "1"}
MEMORY_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
OVERSTRIKE = re.compile(".\b")


def isolate() -> None:
    """Re-run this script in BUILD_ENV unless it already runs there.

    pydoc renders live state: class attributes holding a copy of os.environ
    (wsgiref's BaseHandler.os_environ) would leak the caller's variables, and
    set-valued attributes are listed in hash order, which varies per run.
    """
    if os.environ.get("BUILD_ASSETS_ISOLATED") != "1":
        os.execve(sys.executable, [sys.executable, *sys.argv], BUILD_ENV)


def scrub(text: str) -> str:
    """Drop lines tied to this machine and memory addresses that change per run."""
    lines = (MEMORY_ADDRESS.sub("", line).rstrip() for line in text.splitlines())
    return "\n".join(
        line for line in lines if not any(m in line for m in MACHINE_MARKERS)
    )


def module_names() -> list[str]:
    """Public stdlib modules and their public submodules, sorted by name."""
    names = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIPPED_MODULES:
            continue
        try:
            module = importlib.import_module(name)
        except ImportError:  # built for another platform, e.g. winreg
            continue
        names.append(name)
        if hasattr(module, "__path__") and name not in UNWALKED_PACKAGES:
            walk = pkgutil.walk_packages(
                module.__path__, f"{name}.", onerror=lambda _: None
            )
            names.extend(
                info.name
                for info in walk
                if not any(
                    part.startswith("_") or part in ("test", "tests", "idle_test")
                    for part in info.name.split(".")
                )
            )
    return sorted(names)


def pydoc_text(module: ModuleType) -> str:
    """pydoc's plain-text page for ``module`` without the DROPPED_SECTIONS."""
    page = OVERSTRIKE.sub("", pydoc.render_doc(module, renderer=pydoc.plaintext))
    kept, dropping = [], False
    for line in page.splitlines():
        # Section headings are the only unindented lines of a pydoc page.
        if line and not line[0].isspace():
            dropping = line.strip() in DROPPED_SECTIONS
        if not dropping:
            kept.append(line)
    return "\n".join(kept)


def source_docstrings(module: ModuleType) -> str:
    """Docstrings of the module's source file, each under its qualified name."""
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):  # built-in or extension module
        return ""
    entries = []

    def visit(node: ast.AST, qualname: str) -> None:
        docstring = ast.get_docstring(node)
        if docstring:
            entries.append(f"{qualname}\n{docstring}")
        for child in ast.iter_child_nodes(node):
            if isinstance(
                child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
            ):
                visit(child, f"{qualname}.{child.name}")

    visit(ast.parse(source), module.__name__)
    if not entries:
        return ""
    return f"Docstrings in the source of {module.__name__}\n\n" + "\n\n".join(entries)


def corpus_units() -> list[str]:
    """One text per stdlib module, then one per language reference topic."""
    units = []
    for name in module_names():
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        units.append(scrub(f"{pydoc_text(module)}\n\n{source_docstrings(module)}"))
    units.extend(
        scrub(f"Python Language Reference: {topic}\n\n{text}")
        for topic, text in sorted(pydoc_data.topics.topics.items())
    )
    return units


def train_tokenizer(units: list[str]) -> Tokenizer:
    """Byte-level BPE with BOS/EOS at ids 0 and 1 and VOCAB_SIZE ids in all."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        # All 256 bytes, so any text encodes without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(units, trainer)
    return tokenizer


def pack_documents(units: list[str], tokenizer: Tokenizer) -> list[str]:
    """Join consecutive paragraphs into documents of at least MIN_DOC_TOKENS."""
    paragraphs = [p for unit in units for p in unit.split("\n\n") if p.strip()]
    counts = [len(e.ids) for e in tokenizer.encode_batch(paragraphs)]
    docs, current, current_tokens = [], [], 0
    for paragraph, count in zip(paragraphs, counts):
        current.append(paragraph)
        current_tokens += count
        if current_tokens >= MIN_DOC_TOKENS:
            docs.append("\n\n".join(current))
            current, current_tokens = [], 0
    if current:  # too short to stand alone
        docs[-1] += "\n\n" + "\n\n".join(current)
    return docs


def split_validation(docs: list[str]) -> tuple[list[str], list[str]]:
    """Hold out VALIDATION_DOCS documents spread evenly over the corpus."""
    stride = len(docs) // VALIDATION_DOCS
    held_out = set(range(stride // 2, len(docs), stride)[:VALIDATION_DOCS])
    train = [doc for i, doc in enumerate(docs) if i not in held_out]
    validation = [doc for i, doc in enumerate(docs) if i in held_out]
    return train, validation


def write_jsonl_gz(path: Path, docs: list[str]) -> None:
    """Write one ``{"text": ...}`` object per line, gzipped reproducibly."""
    payload = "".join(
        json.dumps({"text": doc}, ensure_ascii=False) + "\n" for doc in docs
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    # mtime=0 keeps the timestamp out of the gzip header.
    path.write_bytes(gzip.compress(payload.encode(), compresslevel=9, mtime=0))


def write_tokenizer(tokenizer: Tokenizer, directory: Path) -> None:
    """Save in the layout torchtitan's HuggingFaceTokenizer loads.

    torchtitan reads BOS/EOS from tokenizer_config.json; add_bos_token makes
    plain ``encode(text)`` prepend BOS as the Llama 3 tokenizer does.
    """
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"), pretty=True)
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (directory / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, sort_keys=True) + "\n"
    )


def main() -> None:
    isolate()
    # Deprecated stdlib modules warn on import; their documentation is still text.
    warnings.simplefilter("ignore", DeprecationWarning)
    units = corpus_units()
    tokenizer = train_tokenizer(units)
    train, validation = split_validation(pack_documents(units, tokenizer))
    write_jsonl_gz(TEXT_DIR / "train.jsonl.gz", train)
    write_jsonl_gz(TEXT_DIR / "validation.jsonl.gz", validation)
    write_tokenizer(tokenizer, TOKENIZER_DIR)

    for split, docs in (("train", train), ("validation", validation)):
        tokens = [len(e.ids) for e in tokenizer.encode_batch(docs)]
        print(
            f"{split}: {len(docs)} docs, {sum(map(len, docs)):,} chars, "
            f"{sum(tokens):,} tokens, tokens/doc min {min(tokens):,} "
            f"median {statistics.median(tokens):,.0f} max {max(tokens):,}"
        )
    print(f"vocab size: {tokenizer.get_vocab_size()}")
    for path in sorted(ASSETS_DIR.rglob("*.*")):
        print(f"{path.relative_to(ASSETS_DIR)}: {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
