"""The job check (torchtitan 0.2.2) over a table of the settings a GPU job combines, on a faked CUDA
device and on the CPU, against answers derived from what torchtitan and the kernels do with each
setting, not from ``torchtitan_seq/titan/v022/job_check.py``.

Each row is a pipeline schedule (a sequence one or torch's 1F1B), the pipeline, FSDP shard and
replicate, CP and TP degrees, the parameters' dtype, the attention backend (and whether flash-attn is
installed), compile, and a causal or block-causal flavor. :func:`expected` says what a rank would do
with it, from these facts:

* torchtitan 0.2.2's ``parallelize_llama`` applies FSDP where its ``ParallelDims.fsdp_enabled`` (asked of
  torchtitan's own class), casting the parameters to ``training.mixed_precision_param``; else DDP where
  ``dp_replicate_enabled``, which raises "DDP has not supported > 1D parallelism" unless replication is
  the job's only dimension;
* its pipelined train step runs no autocast (``maybe_enable_amp`` is for the unpipelined step, and
  returns no autocast under PP or TP anyway), so a pipeline without FSDP trains in float32;
* a sequence schedule runs units only in a pipeline (pp > 1); on CUDA they attend with torch's flash or
  cuDNN op or flash-attn, which take the dtypes of :data:`CUDA_KERNEL_DTYPES` (measured on an H200 by
  the GPU check); torch's CPU kernel takes float32;
* flash-attn is a CUDA library and an optional extra;
* torchtitan's own CP (torch's schedules, or no pipeline) runs torch's ring attention, which has no
  CPU kernel, and shards flex attention's block masks, which llama3_seq's block-causal flavors
  replace by document ids;
* torch 2.13-2.15's compiled blocks lose their first input's gradient under TP, which the project repairs
  (``torch_internals.keep_async_collective_input_grads``): compile with TP runs where the repair reaches.

A row is refused in one line naming one of the settings :func:`expected` gives, or passes where it
gives none. :func:`test_every_rule_of_the_check_matters` turns each rule of ``check_job`` into one
that never refuses and asserts that the table, or a case of one wrong setting, then fails.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib.util
import inspect
import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch
from test_job_check import CP2, CP_REFUSALS, REFUSALS
from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims

from torchtitan_seq.titan.v022 import job_check
from torchtitan_seq.titan.v022.registration import register
from torchtitan_seq.train import resolve_args

ROOT = Path(__file__).resolve().parents[2]


def _cuda_kernel_dtypes() -> frozenset[str]:
    """The dtypes every CUDA unit kernel takes, as the newest committed GPU check that probed them
    found (``benchmarks/gpu/DATE/*/gpu_check.json``, ``kernel_dtypes``: one causal block forward and
    backward per kernel and dtype). Which kernel a job's units get depends on its GPU, so a dtype
    counts where every probed kernel takes it."""
    probes = [
        json.loads(p.read_text()).get("kernel_dtypes") for p in sorted(ROOT.glob("benchmarks/gpu/*/*/gpu_check.json"))
    ]
    newest = [p for p in probes if p][-1]
    return frozenset.intersection(*(frozenset(d for d, s in kernel.items() if s == "ok") for kernel in newest.values()))


CUDA_KERNEL_DTYPES = _cuda_kernel_dtypes()

SEQUENCE = "Seq1F1B"
BLOCK_CAUSAL = "debugmodel_flex_attn"


@dataclasses.dataclass(frozen=True)
class Row:
    device: str
    schedule: str
    pp: int
    shard: int  # -1: FSDP takes the ranks left (2 here)
    replicate: int
    cp: int
    tp: int
    param_dtype: str
    backend: str
    flash_installed: bool
    compile: bool
    flavor: str

    @property
    def world(self) -> int:
        return self.pp * self.replicate * self.cp * self.tp * (2 if self.shard == -1 else self.shard)


ROWS = [
    Row(*values)
    for values in itertools.product(
        ("cuda", "cpu"),
        (SEQUENCE, "1F1B"),
        (1, 2),  # pp
        (1, 2, -1),  # FSDP shard
        (1, 2),  # replicate
        (1, 2),  # cp
        (1, 2),  # tp
        ("bfloat16", "float32"),
        ("auto", "sdpa", "flash"),
        (False, True),  # flash-attn installed
        (False, True),  # compile
        ("debugmodel", BLOCK_CAUSAL),
    )
    if values[-4] == "flash" or not values[-3]  # flash-attn's presence matters to 'flash' alone
]


def expected(row: Row) -> frozenset[str]:
    """The settings a refusal of ``row`` may name; none where its ranks would train (see the module)."""
    dims = ParallelDims(
        dp_replicate=row.replicate,
        dp_shard=row.shard,
        cp=row.cp,
        tp=row.tp,
        pp=row.pp,
        ep=1,
        etp=1,
        world_size=row.world,
    )
    sequence, units, cuda = row.schedule == SEQUENCE, row.schedule == SEQUENCE and row.pp > 1, row.device == "cuda"
    names = set()
    if dims.dp_replicate_enabled and not dims.fsdp_enabled and dims.world_size != dims.dp_replicate:
        names.add("data_parallel_replicate_degree")
    if row.cp > 1 and not units and (not cuda or row.flavor == BLOCK_CAUSAL):
        names.add("context_parallel_degree")
    if sequence and row.backend == "flash" and not (cuda and row.flash_installed):
        names.add("attention_backend")
    activations = row.param_dtype if dims.fsdp_enabled else "float32"
    if units and cuda and activations not in CUDA_KERNEL_DTYPES:
        names.add("mixed_precision_param")
    return frozenset(names)


@contextlib.contextmanager
def _device(row: Row) -> Iterator[None]:
    """The row's device and flash-attn, faked as the CUDA branches' tests fake them."""
    find_spec = importlib.util.find_spec

    def spec(name, *args, **kwargs):
        if name == "flash_attn":
            return mock.sentinel.flash_attn if row.flash_installed else None
        return find_spec(name, *args, **kwargs)

    with (
        mock.patch.object(torch.cuda, "is_available", lambda: row.device == "cuda"),
        mock.patch.object(importlib.util, "find_spec", spec),
    ):
        yield


@functools.cache
def _base():
    register()
    return ConfigManager().parse_args(resolve_args(["--job.config_file", "train_configs/debug_model.toml"]))


def _job(base, row: Row):
    job = copy.copy(base)
    job.parallelism = dataclasses.replace(
        base.parallelism,
        pipeline_parallel_schedule=row.schedule,
        pipeline_parallel_degree=row.pp,
        data_parallel_shard_degree=row.shard,
        data_parallel_replicate_degree=row.replicate,
        context_parallel_degree=row.cp,
        tensor_parallel_degree=row.tp,
    )
    job.training = dataclasses.replace(base.training, mixed_precision_param=row.param_dtype)
    job.sequence_pipeline = dataclasses.replace(base.sequence_pipeline, attention_backend=row.backend)
    job.compile = dataclasses.replace(base.compile, enable=row.compile, components=["model", "loss"])
    job.model = dataclasses.replace(base.model, flavor=row.flavor)
    return job


def _mismatch(base, row: Row) -> str | None:
    """What is wrong with the check's answer to ``row``, None where it is :func:`expected`'s."""
    want = expected(row)
    try:
        with _device(row):
            job_check.check_job(_job(base, row), row.world)
    except ValueError as e:
        message = str(e)
        if not want:
            return f"{row} refused, but its ranks would train: {message}"
        if "\n" in message or not any(name in message for name in want):
            return f"{row} refused without naming one of {sorted(want)} in one line: {message}"
        return None
    except Exception as e:  # noqa: BLE001 (any other error is a check that crashed)
        return f"{row}: the check raised {type(e).__name__}: {e}"
    return f"{row} passed, but its ranks would fail on {sorted(want)}" if want else None


def _table_mismatches(base, stop_at_first: bool = False) -> list[str]:
    wrong = []
    for row in ROWS:
        if (problem := _mismatch(base, row)) is not None:
            wrong.append(problem)
            if stop_at_first:
                break
    return wrong


def test_the_cuda_kernels_take_half_precision_alone():
    """On the H200, torch's flash op refuses float32 (cuDNN's ran it: the rule holds for the kernel a GPU
    may select, whichever it is)."""
    assert CUDA_KERNEL_DTYPES == {"bfloat16", "float16"}


def test_the_table_covers_every_answer():
    """Rows the job runs, and rows refused for each fact of :func:`expected`, on each device."""
    answers = {(row.device, name) for row in ROWS for name in expected(row) or {"runs"}}
    facts = {"runs", "data_parallel_replicate_degree", "context_parallel_degree", "attention_backend"}
    assert answers == {(d, f) for d in ("cuda", "cpu") for f in facts} | {("cuda", "mixed_precision_param")}


def test_the_check_decides_every_row_as_torchtitan_and_the_kernels_do():
    wrong = _table_mismatches(_base())
    assert not wrong, f"{len(wrong)} of {len(ROWS)} rows: " + "\n".join(wrong[:10])


def _refusal_mismatch(overrides: tuple[str, ...], needle: str, world: int = 2) -> str | None:
    """A case of one wrong setting (test_job_check's :data:`REFUSALS` on 2 CPU processes, :data:`CP_REFUSALS`
    on 4) not refused so."""
    job = ConfigManager().parse_args(resolve_args(["--job.config_file", "train_configs/debug_model.toml", *overrides]))
    try:
        job_check.check_job(job, world)
    except ValueError as e:
        return None if needle in str(e) and "\n" not in str(e) else f"{overrides}: {e}"
    except Exception as e:  # noqa: BLE001
        return f"{overrides}: the check raised {type(e).__name__}: {e}"
    return f"{overrides} passed"


def _rules() -> list[str]:
    """The rules ``check_job`` calls, and those they call, by their names in job_check's namespace."""
    found, todo = set(), [job_check.check_job]
    while todo:
        for name in re.findall(r"\b(_?check_\w+)\(", inspect.getsource(todo.pop())):
            if name not in found and name != "check_job" and hasattr(job_check, name):
                found.add(name)
                todo.append(getattr(job_check, name))
    return sorted(found)


def test_the_rules_are_found():
    rules = set(_rules())
    assert {"_check_cuda_precision", "check_unit_precision", "_check_replicate", "check_compile"} <= rules
    assert len(rules) >= 20, rules


@pytest.mark.parametrize("rule", _rules())
def test_every_rule_of_the_check_matters(rule):
    """With ``rule`` refusing nothing, the table or a case of one wrong setting is decided wrong."""
    original = getattr(job_check, rule)

    def never_refuses(*args, **kwargs):
        with contextlib.suppress(ValueError):
            return original(*args, **kwargs)

    register()
    with mock.patch.object(job_check, rule, never_refuses):
        if _table_mismatches(_base(), stop_at_first=True):
            return
        for overrides, needle in REFUSALS:
            if _refusal_mismatch(overrides, needle) is not None:
                return
        for overrides, needle in CP_REFUSALS:
            if _refusal_mismatch((*CP2, *overrides), needle, world=4) is not None:
                return
    pytest.fail(f"{rule} refusing nothing: every row and refusal case is still decided right")
