"""The README's composition matrix is what the tests train and what the job check lets through.

Each cell of the matrix (a sequence schedule with one setting) says, per torchtitan version, whether the
schedule is exact with the setting or refused. Both halves are checked here, against sources that share
nothing with the README:

- a cell exact under a version is trained by an exactness grid of that version (the ``Variant`` lists
  the harness tests of ``tests/exactness`` run under 0.2.2, of ``tests/titan03/test_titan03_harness.py``
  and ``test_titan03_compositions.py`` under 0.3), and a grid that trains a cell makes the README say so;
- under the installed torchtitan, the job check passes a job of every exact cell and refuses the job of
  every other cell in one line.

Packed documents are the block-causal flavor's; the model is the default Llama 3 (families: their own
table, tests/exactness/test_families.py and tests/titan03/test_titan03_families.py).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from harness import Variant
from torchtitan_seq.schedules import SEQUENCE_SCHEDULES
from torchtitan_seq.titan.version import TITAN_03

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = ("0.2.2", "0.3")

COLUMNS: dict[str, Callable[[Variant], bool]] = {
    "FSDP2": lambda v: v.dp_shard > 1 and v.dp_replicate == 1 and v.compile is None,
    "HSDP": lambda v: v.dp_replicate > 1 and v.dp_shard > 1,
    "TP": lambda v: v.tp > 1 and v.compile is None,
    "CP": lambda v: v.cp > 1 and v.compile is None,
    "AC full": lambda v: v.ac == "full",
    "AC selective": lambda v: v.ac.startswith("selective"),
    "AC memory budget": lambda v: v.ac == "memory_budget",
    "compile": lambda v: v.compile is not None and v.tp == v.cp == 1,
    "compile + TP": lambda v: v.compile is not None and v.tp > 1,
    "compile + CP": lambda v: v.compile is not None and v.cp > 1,
    "packed documents": lambda v: v.documents,
    "split backward": lambda v: v.split_backward,
}
"""Per column of the matrix, whether a variant of a grid trains it."""

GRIDS = {
    "0.2.2": sorted((ROOT / "tests" / "exactness").glob("test_*.py")),
    "0.3": [ROOT / "tests" / "titan03" / f"test_titan03_{name}.py" for name in ("harness", "compositions")],
}
"""Per version, the test modules whose module-level ``Variant`` lists (and dicts of them) the harness runs."""


def _variants(value) -> list[Variant]:
    if isinstance(value, Variant):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in _variants(item)]
    return []


def _trained(version: str) -> set[tuple[str, str]]:
    """The (schedule, column) cells some exact (unmutated) Llama 3 variant of the version's grids trains."""
    cells = set()
    for path in GRIDS[version]:
        spec = importlib.util.spec_from_file_location(f"matrix_{version}_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for name, value in vars(module).items():
            if name.startswith("_"):
                continue  # a base list transformed before it runs (e.g. into another schedule)
            for v in _variants(value):
                if v.mutation is None and v.family == "llama3":
                    cells |= {(v.schedule, column) for column, trains in COLUMNS.items() if trains(v)}
    return cells


def _claimed() -> dict[str, dict[tuple[str, str], bool]]:
    """Per version, per (schedule, column) cell of the README's matrix, whether it says exact.

    A cell reads ``exact`` (both versions), ``exact 0.2.2`` or ``exact 0.3`` (that version; the other
    refuses it) or ``refused ...`` (both), footnote marks aside."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| schedule | FSDP2 |"))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")][1:]
    assert header == list(COLUMNS), header
    claimed: dict[str, dict[tuple[str, str], bool]] = {version: {} for version in VERSIONS}
    for line in lines[start + 2 :]:
        if not line.startswith("| `"):
            break
        schedule, *cells = (cell.strip() for cell in line.strip("|").split("|"))
        schedule = schedule.strip("`")
        if schedule not in SEQUENCE_SCHEDULES:
            continue
        for column, cell in zip(COLUMNS, cells):
            words = re.sub(r"[¹²³⁴⁵⁶⁷⁸⁹]", "", cell).split()
            assert words and words[0] in ("exact", "refused"), (schedule, column, cell)
            for version in VERSIONS:
                exact = words[0] == "exact" and (len(words) == 1 or words[1] == version)
                claimed[version][schedule, column] = exact
    assert {s for s, _ in claimed["0.3"]} == set(SEQUENCE_SCHEDULES)
    return claimed


@pytest.mark.parametrize("version", VERSIONS)
def test_the_matrix_says_exact_where_the_grids_train_and_only_there(version):
    claimed, trained = _claimed()[version], _trained(version)
    untrained = sorted(cell for cell, exact in claimed.items() if exact and cell not in trained)
    unclaimed = sorted(cell for cell, exact in claimed.items() if not exact and cell in trained)
    assert not untrained, f"the README says exact under {version}, no grid trains: {untrained}"
    assert not unclaimed, f"a grid trains under {version}, the README does not say exact: {unclaimed}"


# Per column, (overrides, data-parallel x TP x CP degree) of a job of the debug model at pp 2.
OVERRIDES_022 = {
    "FSDP2": (("--parallelism.data_parallel_shard_degree", "2"), 2),
    "HSDP": (("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"), 4),
    "TP": (("--parallelism.tensor_parallel_degree", "2"), 2),
    "CP": (("--parallelism.context_parallel_degree", "2"), 2),
    "AC full": (("--activation_checkpoint.mode", "full"), 1),
    "AC selective": (("--activation_checkpoint.mode", "selective"), 1),
    "AC memory budget": (("--activation_checkpoint.mode", "memory_budget", "--compile.enable"), 1),
    "compile": (("--compile.enable",), 1),
    "compile + TP": (("--compile.enable", "--parallelism.tensor_parallel_degree", "2"), 2),
    "compile + CP": (("--compile.enable", "--parallelism.context_parallel_degree", "2"), 2),
    "packed documents": (("--job.config_file", "train_configs/debug_block_causal.toml"), 1),
    "split backward": (("--sequence_pipeline.split_backward",), 1),
}
OVERRIDES_03 = {
    "FSDP2": (("--parallelism.data-parallel-shard-degree", "2"), 2),
    "HSDP": (("--parallelism.data-parallel-replicate-degree", "2", "--parallelism.data-parallel-shard-degree", "2"), 4),
    "TP": (("--parallelism.tensor-parallel-degree", "2"), 2),
    "CP": (("--parallelism.context-parallel-degree", "2"), 2),
    "AC full": (("activation-checkpoint:full",), 1),
    "AC selective": (("activation-checkpoint:selective",), 1),
    "AC memory budget": (("--compile.enable", "activation-checkpoint:memory-budget"), 1),
    "compile": (("--compile.enable",), 1),
    "compile + TP": (("--compile.enable", "--parallelism.tensor-parallel-degree", "2"), 2),
    "compile + CP": (("--compile.enable", "--parallelism.context-parallel-degree", "2"), 2),
    "packed documents": (("--config", "llama3_debugmodel_block_causal_seq1f1b"), 1),
    "split backward": (("--sequence-pipeline.split-backward",), 1),
}


def _check(schedule: str, column: str) -> None:
    """The installed torchtitan's job check of the debug model's job at pp 2 with ``schedule`` and ``column``."""
    from torchtitan.config import ConfigManager

    if TITAN_03:
        from torchtitan_seq.titan.v03.job_check import check_job
        from torchtitan_seq.titan.v03.registration import register

        register()
        overrides, degree = OVERRIDES_03[column]
        flags = [a for a in overrides if not a.startswith("activation-checkpoint:")]
        subcommands = [a for a in overrides if a.startswith("activation-checkpoint:")]
        args = ["--module", "torchtitan_seq.recipes", "--config", "llama3_debugmodel_seq1f1b"]
        args += ["--parallelism.pipeline-parallel-schedule", schedule, *flags, *subcommands]
        config = ConfigManager().parse_args(args)
    else:
        from torchtitan_seq.titan.v022.job_check import check_job
        from torchtitan_seq.titan.v022.registration import register
        from torchtitan_seq.train import resolve_args

        register()
        overrides, degree = OVERRIDES_022[column]
        args = ["--job.config_file", "train_configs/debug_model.toml", *overrides]
        config = ConfigManager().parse_args(resolve_args([*args, "--parallelism.pipeline_parallel_schedule", schedule]))
    check_job(config, 2 * degree)


@pytest.mark.parametrize("column", list(COLUMNS))
def test_the_job_check_passes_the_exact_cells_and_refuses_the_others_in_one_line(column, monkeypatch):
    monkeypatch.chdir(ROOT)
    claimed = _claimed()["0.3" if TITAN_03 else "0.2.2"]
    wrong = []
    for schedule in SEQUENCE_SCHEDULES:
        try:
            _check(schedule, column)
            refusal = None
        except ValueError as e:
            refusal = str(e)
        if claimed[schedule, column] != (refusal is None) or (refusal is not None and "\n" in refusal):
            wrong.append((schedule, "exact" if claimed[schedule, column] else "refused", refusal))
    assert not wrong, wrong
