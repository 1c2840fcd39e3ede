"""The README and docs/ as written (#41): every command and code block runs, or names what exists.

Each fenced block of README.md and docs/*.md is read by its language:

* ``bash``: each command line (backslash continuations joined, comments dropped). The cheap ones run,
  in this process and in a temporary folder: ``python -m torchtitan_seq.simulate`` and
  ``python -m torchtitan_seq.plan`` (and their ``--help``). The others must name what exists: the script
  or file they run, every option of a checkout script (found in its source), every ``--section.key``
  override of a training command (the job config, with the ``[sequence_pipeline]`` section, parses it,
  from ``CONFIG_FILE`` or ``--job.config_file`` if given), every pytest path, every install extra.
* ``python``: runs as a script, in this process (the plain-torch example: one gloo rank, tiny).
* ``toml``: every section and key is a field of the job config, and the job config parses it.
* ``text``: output shown, not run.

Across the pages, every relative link and every path in inline code (``torchtitan_seq/...``,
``tests/...``, ``benchmarks/...``, ...; in the checkout or the package) exists, every setting named in inline code
(``--section.key``, ``section.key``, ``[section] key``) is a field of the job config, every page of
docs/ is linked from the README, the README stays a short read, and docs/architecture.md names every
folder of the package.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import re
import runpy
import shlex
import socket
import sys
import time
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGE = ROOT / "torchtitan_seq"
README_MAX_LINES = 260
OUTPUT_OPTIONS = {"--out", "--svg", "--csv", "--trace", "--regenerate", "--job.dump_folder", "--logdir"}
"""Options whose value is a path the command writes: it need not exist yet."""
PLACEHOLDER = re.compile(r"[<>{}*$]|\b[A-Z][A-Z_]{2,}\b|\.\.\.")
"""A path with a placeholder in it (``<dump_folder>``, ``DUMP_FOLDER``, ``benchmarks/gpu/DATE/``) names no file."""


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _blocks() -> list[Block]:
    blocks = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            if m := re.match(r"^```(\w*)\s*$", lines[i]):
                end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
                blocks.append(Block(page, i + 1, m.group(1), "\n".join(lines[i + 1 : end]) + "\n"))
                i = end
            i += 1
    return blocks


BLOCKS = _blocks()


def _command_lines(text: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", text)
    joined = re.sub(r"\$\([^)]*\)", "X", joined)  # $(date +%F) and the like: a value, not a path
    return [line for line in joined.splitlines() if shlex.split(line, comments=True)]


def _split(line: str) -> tuple[dict[str, str], list[str]]:
    """``VAR=value ... argv``: the environment the line sets and the command."""
    words = shlex.split(line, comments=True)
    env = {}
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words


COMMANDS = [(b, line) for b in BLOCKS if b.lang in ("bash", "sh") for line in _command_lines(b.text)]
"""Each command line of the pages' shell blocks, with its block."""


def _runs_here(argv: list[str]) -> bool:
    return argv[:2] == ["python", "-m"] and argv[2] in ("torchtitan_seq.simulate", "torchtitan_seq.plan")


RUN = list({line: (b, line) for b, line in reversed(COMMANDS) if _runs_here(_split(line)[1])}.values())
"""The cheap commands, each once (the README's planner command is also docs/planner.md's)."""
CHECK = [(b, line) for b, line in COMMANDS if not _runs_here(_split(line)[1])]
SLOW_RUNS = {"--regenerate"}
"""Runs that take more than a few seconds on a loaded 2-core machine (the whole standard set)."""


def _id(item: tuple[Block, str]) -> str:
    block, line = item
    return f"{block.where}+{_command_lines(block.text).index(line)}:{' '.join(_split(line)[1][2:4])}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------
# The cheap commands and the Python blocks run.


def _run_params():
    for item in RUN:
        slow = any(opt in _split(item[1])[1] for opt in SLOW_RUNS)
        yield pytest.param(*item, id=_id(item), marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("block,line", list(_run_params()))
def test_command_runs(block, line, tmp_path, monkeypatch, capsys):
    from torchtitan_seq.plan.cli import main as plan_main
    from torchtitan_seq.simulate.cli import main as simulate_main

    env, argv = _split(line)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)  # what it writes (--svg, --regenerate) lands here
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")  # what it reads (--cost files)
    main = {"torchtitan_seq.simulate": simulate_main, "torchtitan_seq.plan": plan_main}[argv[2]]
    start = time.perf_counter()
    try:
        rc = main(argv[3:])
    except SystemExit as e:  # --help
        rc = e.code or 0
    out = capsys.readouterr()
    assert rc == 0, f"{block.where}: `{line}` exited {rc}\n{out.out[-2000:]}\n{out.err[-2000:]}"
    assert out.out.strip(), f"{block.where}: `{line}` printed nothing"
    print(f"{block.where}: {time.perf_counter() - start:.1f} s")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=lambda b: b.where)
def test_python_block_runs(block, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    script = tmp_path / "example.py"
    script.write_text(block.text)
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        import torch.distributed as dist

        if dist.is_initialized():  # the block failed before it let go of its group
            dist.destroy_process_group()
    assert capsys.readouterr().out.strip(), f"{block.where} printed nothing"


# ---------------------------------------------------------------------------
# The other commands name what exists.


def _job_config(argv: list[str]):
    """The job config torchtitan_seq.train would build of ``argv`` (raises AssertionError with
    tyro's message when it does not parse)."""
    from torchtitan.config import ConfigManager

    from torchtitan_seq.train import resolve_args

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
            return ConfigManager().parse_args(resolve_args(argv))
    except SystemExit:
        raise AssertionError(err.getvalue()[-3000:]) from None


def _has_setting(config, dotted: str) -> bool:
    """Whether ``section.key`` (dashes or underscores, a ``no-`` flag) is a field of ``config``."""
    obj = config
    parts = dotted.replace("-", "_").split(".")
    for i, part in enumerate(parts):
        if i == len(parts) - 1 and not hasattr(obj, part) and part.startswith("no_"):
            part = part[3:]
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


@pytest.fixture(scope="module")
def default_config():
    return _job_config(["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml")])


def _overrides(argv: list[str]) -> list[str]:
    return [w.split("=")[0][2:] for w in argv if re.match(r"^--\w+\.[\w.-]+", w)]


def _check_training(env: dict[str, str], argv: list[str], where: str, default_config) -> None:
    """A training command (run_train.sh, torchrun -m torchtitan_seq.train): its config file exists and
    its arguments parse as torchtitan_seq.train parses them."""
    if argv[0] == "./run_train.sh":
        args = argv[1:]
    else:
        args = [w for w in argv[argv.index("torchtitan_seq.train") + 1 :] if w != "--check"]
    config_file = env.get("CONFIG_FILE", "train_configs/debug_model.toml")
    if "--job.config_file" in args:
        i = args.index("--job.config_file")
        config_file, args = args[i + 1], args[:i] + args[i + 2 :]
    assert (ROOT / config_file).is_file(), f"{where}: no config file {config_file}"
    unknown = [name for name in _overrides(args) if not _has_setting(default_config, name)]
    assert not unknown, f"{where}: no such settings {unknown}"
    config = _job_config(["--job.config_file", str(ROOT / config_file), *args])
    assert config.model.name, where


def _check_titan03_training(env: dict[str, str], args: list[str], where: str, default_config) -> None:
    """A torchtitan 0.3 training command (``TORCHTITAN=0.3 ./run_train.sh``): its ``CONFIG`` is a config
    function of torchtitan_seq.recipes, and its overrides name settings (0.3's sections are 0.2.2's, the
    sequence_pipeline section alike; 0.3 itself is not installed here to parse them)."""
    recipes = ast.parse((PACKAGE / "recipes.py").read_text())
    functions = {n.name for n in recipes.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    if "CONFIG" in env:
        assert env["CONFIG"] in functions, f"{where}: torchtitan_seq.recipes has no config function {env['CONFIG']}"
    unknown = [name for name in _overrides(args) if not _has_setting(default_config, name)]
    assert not unknown, f"{where}: no such settings {unknown}"


def _check_script_options(script: Path, argv: list[str], where: str) -> None:
    """Every ``--option`` of a checkout script appears in its source (or, for a shell wrapper, in the
    Python script beside it that it runs)."""
    sources = [script.read_text()]
    if script.suffix == ".sh" and script.with_suffix(".py").exists():
        sources.append(script.with_suffix(".py").read_text())
    for word in argv:
        if word.startswith("--"):
            option = word.split("=")[0]
            assert any(option in s for s in sources), f"{where}: {script.relative_to(ROOT)} has no {option}"


def _check_paths(argv: list[str], where: str) -> None:
    """Every argument that looks like a path in the checkout exists, but what a command writes."""
    for i, word in enumerate(argv):
        if i and argv[i - 1] in OUTPUT_OPTIONS or word.startswith("-") or PLACEHOLDER.search(word):
            continue
        if re.match(r"^(\./)?(torchtitan_seq|tests|benchmarks|train_configs|tools|docs|schedules)/", word):
            assert (ROOT / word).exists(), f"{where}: {word} does not exist"


def _check_pip(argv: list[str], where: str) -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for word in argv[2:]:
        if m := re.match(r"^\.(\[(.*)\])?$", word):
            for extra in filter(None, (m.group(2) or "").split(",")):
                assert extra in extras, f"{where}: pyproject.toml has no extra {extra!r}"
        elif not word.startswith("-"):
            raise AssertionError(f"{where}: pip installs {word!r}, not this checkout")


@pytest.mark.parametrize("block,line", CHECK, ids=[_id(item) for item in CHECK])
def test_command_names_what_exists(block, line, default_config):
    env, argv = _split(line)
    where = f"{block.where}: `{line.strip()}`"
    for key in ("CONFIG_FILE",):
        if key in env:
            assert (ROOT / env[key]).is_file(), f"{where}: {key}={env[key]} does not exist"
    _check_paths(argv, where)
    program = argv[0]
    if program == "./run_train.sh" and env.get("TORCHTITAN", "").startswith("0.3"):
        _check_titan03_training(env, argv[1:], where, default_config)
    elif program == "./run_train.sh" or "torchtitan_seq.train" in argv:
        _check_training(env, argv, where, default_config)
    elif program == "./run_tests.sh":
        for word in argv[1:]:
            if not word.startswith("-") and word != "not slow":
                assert (ROOT / word).exists(), f"{where}: no test file {word}"
    elif program.startswith("./"):
        assert (ROOT / program).is_file(), f"{where}: no script {program}"
        _check_script_options(ROOT / program, argv[1:], where)
    elif program in ("python", "python3") and argv[1].endswith(".py"):
        script = ROOT / argv[1]
        if script.is_file():
            _check_script_options(script, argv[2:], where)
        else:  # the page's own example, saved under the name it gives
            assert any(f"`{argv[1]}`" in b.page.read_text() for b in BLOCKS if b.lang == "python"), where
    elif program == "torchrun":
        scripts = [w for w in argv if w.endswith(".py")]
        assert scripts, f"{where}: torchrun runs neither torchtitan_seq.train nor a script"
    elif program == "pip":
        _check_pip(argv, where)
    elif program == "tensorboard":
        assert "--logdir" in argv, where
    else:
        raise AssertionError(f"{where}: {program!r} is a command this test does not know; teach it")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "toml"], ids=lambda b: b.where)
def test_toml_block_is_a_job_config(block, tmp_path, default_config):
    table = tomllib.loads(block.text)
    for section, keys in table.items():
        for key in keys:
            assert _has_setting(default_config, f"{section}.{key}"), f"{block.where}: [{section}] {key} is no setting"
    path = tmp_path / "job.toml"
    path.write_text(block.text)
    config = _job_config(["--job.config_file", str(path)])
    for section, keys in table.items():
        for key, value in keys.items():
            if key != "hf_assets_path":  # "builtin" resolves to the shipped tokenizer's folder
                assert getattr(getattr(config, section), key) == value, (block.where, section, key)


def test_every_block_has_a_known_language():
    unknown = [f"{b.where}: ```{b.lang}" for b in BLOCKS if b.lang not in ("bash", "sh", "python", "toml", "text")]
    assert not unknown, "\n".join(unknown)


# ---------------------------------------------------------------------------
# The prose: links, paths and settings in inline code, the pages' places.


def _inline_code(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_paths_exist(page):
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"^(https?:|mailto:|#)", target):
            continue
        if not (page.parent / target.split("#")[0]).exists():
            missing.append(f"link {target}")
    for span in _inline_code(page):
        for word in span.split():
            word = word.rstrip(",.;:)")
            if re.match(r"^(torchtitan_seq|tests|benchmarks|train_configs|tools|docs|schedules|\.ci)/", word):
                if not PLACEHOLDER.search(word) and not (ROOT / word).exists() and not (PACKAGE / word).exists():
                    missing.append(f"path {word}")
    assert not missing, f"{page.relative_to(ROOT)}: " + ", ".join(missing)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_settings_in_prose_exist(page, default_config):
    sections = {f.name for f in dataclasses.fields(default_config)}
    unknown = []
    for span in _inline_code(page):
        named = re.findall(r"(?:^|\s)--(\w+\.[\w.-]+)", span)
        named += [
            m
            for m in re.findall(r"^(\w+\.[\w.]+)(?:\s|$)", span)
            if m.split(".")[0] in sections and not re.search(r"\.(py|jsonl?|md|toml)$", m)
        ]
        named += [f"{s}.{k}" for s, k in re.findall(r"^\[(\w+)\] (\w+)", span)]
        unknown += [name for name in named if not _has_setting(default_config, name)]
    assert not unknown, f"{page.relative_to(ROOT)}: no such settings: {unknown}"


def test_every_page_is_linked_from_the_readme_and_it_stays_short():
    readme = (ROOT / "README.md").read_text()
    unlinked = [p.name for p in PAGES[1:] if f"(docs/{p.name})" not in readme]
    assert not unlinked, f"README.md links no {unlinked}"
    assert len(readme.splitlines()) <= README_MAX_LINES, "README.md: a user's guide; the rest goes to docs/"


def test_the_architecture_page_names_every_folder():
    page = (ROOT / "docs" / "architecture.md").read_text()
    folders = {f"{p.parent.relative_to(PACKAGE)}/" for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE}
    # the layers, and each torchtitan version's layer; the folders inside them are their own business
    folders = {f for f in folders if f.count("/") == 1 or (f.startswith("titan/") and f.count("/") == 2)}
    named = set(re.findall(r"`([\w/]+/)`", page))
    assert not folders - named, f"docs/architecture.md does not name {sorted(folders - named)}"
    gone = {f for f in named if not (PACKAGE / f).is_dir() and not (ROOT / f).is_dir()}
    assert not gone, f"docs/architecture.md names folders that do not exist: {sorted(gone)}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))
