"""Build the offline training assets shipped in ``torchtitan_seq/assets``.

Writes::

    torchtitan_seq/assets/text/train.jsonl.gz
    torchtitan_seq/assets/text/validation.jsonl.gz
    torchtitan_seq/assets/text/packed.jsonl.gz
    torchtitan_seq/assets/text/packed_validation.jsonl.gz
    torchtitan_seq/assets/tokenizer/tokenizer.json
    torchtitan_seq/assets/tokenizer/tokenizer_config.json

The corpus is the Python standard library's own documentation: the pydoc text
of every importable stdlib module, the docstrings of their source files and the
language reference topics pydoc ships in ``pydoc_data``. Building therefore
needs no network, and re-running it on the same Python build rewrites
byte-identical files.

``train``/``validation`` hold long documents (at least MIN_DOC_TOKENS each);
``packed``/``packed_validation`` hold short documents of log-normally spread
lengths, cut at paragraph boundaries from the same text, for training with many
documents packed into one sequence (block-causal attention).

Usage (from the repository root, inside the virtualenv)::

    python tools/build_assets.py
    # Only the packed files, cut from the shipped train/validation text with the
    # shipped tokenizer (under a minute; the same bytes as a full rebuild):
    python tools/build_assets.py --packed-only
"""

import argparse
import ast
import gzip
import importlib
import inspect
import json
import math
import os
import pkgutil
import pydoc
import pydoc_data.topics
import random
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
# Packed corpus: document lengths in tokens (without BOS/EOS) drawn from a
# log-normal distribution, clipped to [PACKED_MIN_TOKENS, PACKED_MAX_TOKENS].
PACKED_MEDIAN_TOKENS = 400
PACKED_SIGMA = 1.0  # of log(length): 5% of documents under ~80, 5% over ~2000
PACKED_MIN_TOKENS = 32
PACKED_MAX_TOKENS = 4096
PACKED_SEED = 0
# About this much text (characters) per split, taken evenly over the source.
PACKED_TRAIN_CHARS = 3_000_000
PACKED_VALIDATION_CHARS = 300_000

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
    return "\n".join(line for line in lines if not any(m in line for m in MACHINE_MARKERS))


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
            walk = pkgutil.walk_packages(module.__path__, f"{name}.", onerror=lambda _: None)
            names.extend(
                info.name
                for info in walk
                if not any(
                    part.startswith("_") or part in ("test", "tests", "idle_test") for part in info.name.split(".")
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
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
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


def cut_short_documents(docs: list[str], tokenizer: Tokenizer, rng: random.Random) -> list[str]:
    """Cut ``docs`` at blank lines into documents of log-normally drawn lengths.

    Each document takes consecutive paragraphs until it is as close to its
    drawn length as paragraph boundaries allow, never below PACKED_MIN_TOKENS
    nor above PACKED_MAX_TOKENS. A paragraph longer than the drawn length on
    its own is skipped when it would start a document (about half the source
    text), so that the lengths follow the drawn distribution.
    """
    paragraphs = [p for doc in docs for p in doc.split("\n\n") if p.strip()]
    counts = [len(e.ids) for e in tokenizer.encode_batch(paragraphs)]
    separator = len(tokenizer.encode("\n\n").ids)
    mu = math.log(PACKED_MEDIAN_TOKENS)

    def draw() -> int:
        length = round(rng.lognormvariate(mu, PACKED_SIGMA))
        return min(max(length, PACKED_MIN_TOKENS), PACKED_MAX_TOKENS)

    short_docs, current, current_tokens, target = [], [], 0, draw()
    for paragraph, count in zip(paragraphs, counts):
        if not current and count > target:
            # Left out rather than let long paragraphs (tables, long lists)
            # skew the lengths up: they hold a large share of the tokens.
            continue
        joined = current_tokens + separator + count if current else count
        if current and (
            joined > PACKED_MAX_TOKENS
            or (current_tokens >= PACKED_MIN_TOKENS and joined - target > target - current_tokens)
        ):
            # Adding the paragraph would move away from the target: close.
            short_docs.append("\n\n".join(current))
            current, current_tokens, target = [], 0, draw()
            if count > target:
                continue
            joined = count
        current.append(paragraph)
        current_tokens = joined
        if current_tokens >= target:
            short_docs.append("\n\n".join(current))
            current, current_tokens, target = [], 0, draw()
    if current:
        short_docs.append("\n\n".join(current))
    # Tokens can merge across a blank line, so the sums above are estimates:
    # leave out the few documents whose exact length falls outside the clip.
    lengths = [len(e.ids) for e in tokenizer.encode_batch(short_docs)]
    return [doc for doc, length in zip(short_docs, lengths) if PACKED_MIN_TOKENS <= length <= PACKED_MAX_TOKENS]


def spread_subset(docs: list[str], chars: int) -> list[str]:
    """About ``chars`` characters of ``docs``, taken evenly over the list."""
    total = sum(map(len, docs))
    if total <= chars:
        return docs
    # Keep document i when the running quota chars/total crosses an integer.
    return [doc for i, doc in enumerate(docs) if (i + 1) * chars // total != i * chars // total]


def build_packed(train: list[str], validation: list[str], tokenizer: Tokenizer) -> dict[str, list[str]]:
    """The packed corpus, by file name: short documents from each split."""
    packed = {}
    for name, docs, chars, seed in (
        ("packed.jsonl.gz", train, PACKED_TRAIN_CHARS, PACKED_SEED),
        ("packed_validation.jsonl.gz", validation, PACKED_VALIDATION_CHARS, PACKED_SEED + 1),
    ):
        packed[name] = spread_subset(cut_short_documents(docs, tokenizer, random.Random(seed)), chars)
    return packed


def split_validation(docs: list[str]) -> tuple[list[str], list[str]]:
    """Hold out VALIDATION_DOCS documents spread evenly over the corpus."""
    stride = len(docs) // VALIDATION_DOCS
    held_out = set(range(stride // 2, len(docs), stride)[:VALIDATION_DOCS])
    train = [doc for i, doc in enumerate(docs) if i not in held_out]
    validation = [doc for i, doc in enumerate(docs) if i in held_out]
    return train, validation


def write_jsonl_gz(path: Path, docs: list[str]) -> None:
    """Write one ``{"text": ...}`` object per line, gzipped reproducibly."""
    payload = "".join(json.dumps({"text": doc}, ensure_ascii=False) + "\n" for doc in docs)
    path.parent.mkdir(parents=True, exist_ok=True)
    # mtime=0 keeps the timestamp out of the gzip header.
    path.write_bytes(gzip.compress(payload.encode(), compresslevel=9, mtime=0))


def read_jsonl_gz(path: Path) -> list[str]:
    """The texts of a file written by :func:`write_jsonl_gz`."""
    lines = gzip.decompress(path.read_bytes()).decode().splitlines()
    return [json.loads(line)["text"] for line in lines]


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
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def print_stats(split: str, docs: list[str], tokenizer: Tokenizer) -> None:
    """One line: document count, size and token-length distribution."""
    tokens = sorted(len(e.ids) for e in tokenizer.encode_batch(docs))
    p10, p25, p75, p90 = (tokens[len(tokens) * q // 100] for q in (10, 25, 75, 90))
    print(
        f"{split}: {len(docs)} docs, {sum(map(len, docs)):,} chars, "
        f"{sum(tokens):,} tokens, tokens/doc min {min(tokens):,} "
        f"median {statistics.median(tokens):,.0f} max {max(tokens):,} "
        f"(p10 {p10:,} p25 {p25:,} p75 {p75:,} p90 {p90:,})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--packed-only",
        action="store_true",
        help="only rewrite packed*.jsonl.gz, from the shipped train/validation files and tokenizer",
    )
    args = parser.parse_args()
    if args.packed_only:
        tokenizer = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
        train = read_jsonl_gz(TEXT_DIR / "train.jsonl.gz")
        validation = read_jsonl_gz(TEXT_DIR / "validation.jsonl.gz")
        splits = {}
    else:
        isolate()
        # Deprecated stdlib modules warn on import; their documentation is still text.
        warnings.simplefilter("ignore", DeprecationWarning)
        units = corpus_units()
        tokenizer = train_tokenizer(units)
        train, validation = split_validation(pack_documents(units, tokenizer))
        splits = {"train.jsonl.gz": train, "validation.jsonl.gz": validation}
    splits.update(build_packed(train, validation, tokenizer))
    for name, docs in splits.items():
        write_jsonl_gz(TEXT_DIR / name, docs)
    if not args.packed_only:
        write_tokenizer(tokenizer, TOKENIZER_DIR)

    for name, docs in splits.items():
        print_stats(name.removesuffix(".jsonl.gz"), docs, tokenizer)
    print(f"vocab size: {tokenizer.get_vocab_size()}")
    for path in sorted(ASSETS_DIR.rglob("*.*")):
        print(f"{path.relative_to(ASSETS_DIR)}: {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
