"""Fixtures shared by the test files."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from torchtitan_seq.titan import cpu_compat

cpu_compat.apply()  # the tests' entry point, as torchtitan_seq.train is the trainer's

# The tests' helpers (the exactness harness, the mutations, the settings walk, ...), one folder.
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

from torchtitan_seq.titan.version import TITAN_03  # noqa: E402

if TITAN_03:
    # Under torchtitan 0.3 only tests/titan03/ runs: the other tests drive torchtitan 0.2.2 (its TOML
    # configs, train spec and model, or torchtitan_seq's 0.2.2 layer), which 0.3 does not have.
    collect_ignore_glob = ["unit/*", "exactness/*", "e2e/*"]
else:
    from titan import run_train  # helpers/titan.py, which imports torchtitan: after cpu_compat and the path


def pytest_report_header() -> str:
    """Say which torchtitan layer the session tests."""
    if TITAN_03:
        return "torchtitan 0.3: tests/titan03/ only (tests/unit, exactness and e2e need torchtitan 0.2.2)"
    return "torchtitan 0.2.2: tests/titan03/ skip (they need torchtitan 0.3)"


@pytest.fixture
def one_thread():
    """Small kernels in this process: one thread runs them about ten times faster on a shared CPU than many."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """``shared_run(*overrides, env=None) -> (Run, dump_folder)``: ./run_train.sh once per session.

    A torchtitan run that several tests read (a reference schedule's losses,
    its TensorBoard events) runs the first time one asks for it; the tests
    asking for the same overrides and environment, in the same order, get that
    run. It goes through run_train.sh's start-up check, as a user's run does.
    Tests must not write into its dump folder.
    """
    runs = {}

    def get(*overrides: str, env: dict | None = None):
        key = (overrides, tuple(sorted((env or {}).items())))
        if key not in runs:
            dump = tmp_path_factory.mktemp("shared_run")
            runs[key] = (run_train(*overrides, dump_folder=dump, env=env), dump)
        return runs[key]

    return get


def pytest_collection_modifyitems(config, items) -> None:
    """Under pytest-xdist (run_tests.sh: ``-n 2 --dist loadgroup``) a file's tests run in one worker,
    so its module fixtures (a file's exactness ranks, its shared runs) run once; so do the tests
    reading the session's ``shared_run``, whose runs each worker would otherwise train again."""
    for item in items:
        shared = "shared_run" in getattr(item, "fixturenames", ())
        item.add_marker(pytest.mark.xdist_group("shared_run" if shared else item.nodeid.split("::")[0]))
