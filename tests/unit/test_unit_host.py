"""The unit path's host cost benchmark (benchmarks/unit_host.py) and its place in the GPU check
(benchmarks/gpu_check.sh): what can be checked without a GPU.

* The count: leaf aten ops of a step, views left out, per unit and layer against a plain layer, with
  the CPU kernel and with the CUDA adapters against fakes of their aten ops: the unit path's own
  stays within what #40 brought it to (a regression of the launches per unit-layer fails here).
* The CUDA timing branch on fake CUDA events.
* host_instructions.py: the instructions per unit-layer added, from callgrind's dumps (valgrind faked).
* gpu_check.sh: after the check, the benchmark on the same device into the same folder; the
  check's exit status kept; nothing more when the check cannot start.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import unit_host  # benchmarks/ (on the path: conftest.py)

REPO = Path(__file__).resolve().parents[2]


def test_leaf_ops_count_kernels_not_views():
    x, y = torch.ones(4, 4), torch.ones(4, 4)
    # t and unsqueeze are views; add and mul run a kernel each (tensor operands: a Python scalar
    # would be copied to a tensor on the CPU first)
    assert unit_host.leaf_ops(lambda: (x.t() + y).unsqueeze(0).mul(y)) == 2
    assert unit_host._is_view("aten::transpose") and unit_host._is_view("aten::to")
    assert not unit_host._is_view("aten::add") and not unit_host._is_view("aten::copy_")


def test_leaf_ops_through_views_count_ops_that_make_views_inside():
    """torch's CPU mm and indexed copy make views inside (one kernel each on a GPU): not leaves by the
    plain count, leaves through views; views alone stay uncounted."""
    x, y, rows = torch.ones(4, 4), torch.ones(4, 4), torch.tensor([3, 2, 1, 0])
    for op in (lambda: x @ y, lambda: x.index_copy_(0, rows, y)):
        assert (unit_host.leaf_ops(op), unit_host.leaf_ops(op, through_views=True)) == (0, 1)
    assert unit_host.leaf_ops(lambda: (x.t() + y).unsqueeze(0).mul(y), through_views=True) == 2


def test_per_unit_layer_is_the_difference_over_the_added_unit_layers():
    figures = {"k1": 10.0, "k": 10.0 + 3 * unit_host.UNIT_LAYERS, "2": 5.0, "4": 9.0}
    assert unit_host._per_unit_layer(figures) == {"unit": 3.0, "plain": 2.0}


@pytest.mark.slow
def test_launches_per_unit_layer_stay_low():
    """#40's count: at most 36 leaf ops per unit-layer beyond a plain layer's with the CPU kernel
    (65.6 before), 18 with the CUDA adapters' op sequences (63.6 and 55.6 before); a descending slab
    at most 2 kernels per unit-layer beyond an ascending one's (4.9 with flipped copies)."""
    record = unit_host.measure(repeats=1)
    assert record["descending_slab_launches_per_unit_layer"] <= 2, record
    ops = record["launches_per_unit_layer"]
    assert ops["unit"] - ops["plain"] <= 36, ops
    assert ops["CudnnSdpaKernel"] - ops["plain"] <= 18, ops
    assert ops["CudaSdpaKernel"] - ops["plain"] <= 18, ops


def test_attention_steps_run_the_unit_path_and_sdpa_on_the_same_sequence():
    """The unit path's own host time: k units through the op and SDPA on the whole sequence run (twice:
    a microbatch's slab goes with its last backward), and with the CUDA adapters against fakes that
    compute nothing, whose outputs have the kernels' shapes."""
    for kernel in (None, "CudnnSdpaKernel", "CudaSdpaKernel"):
        with unit_host._fake_cuda_ops(compute=False) if kernel else contextlib.nullcontext():
            units, sdpa = unit_host.attention_steps(torch.device("cpu"), 2, kernel, layers=2)
            for _ in range(2):
                units(), sdpa()


def test_cuda_timing_reads_host_and_device_time(monkeypatch):
    """The CUDA branch of the timing on a fake device clock: the host's issue time and the events'."""
    from test_cuda_branches import FakeCudaEvent, FakeGpuClock, _synchronize_device

    monkeypatch.setattr(FakeGpuClock, "now", 0.0)
    monkeypatch.setattr(FakeGpuClock, "completed", -1.0)
    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", _synchronize_device)

    def step() -> None:  # the device runs 4 ms after the host has issued the step
        FakeGpuClock.now += 4.0

    host, device = unit_host._best_us(step, 3, torch.device("cuda", 0))
    assert device == pytest.approx(4000.0)
    assert 0 <= host < device


def _fake_tree(tmp_path: Path, check_status: int) -> Path:
    """A copy of gpu_check.sh beside stand-ins for the check and the benchmark that record their
    arguments, and a setup_env.sh whose ``python`` is this interpreter."""
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "tools").mkdir()
    shutil.copy(REPO / "benchmarks" / "gpu_check.sh", tmp_path / "benchmarks")
    (tmp_path / "tools" / "setup_env.sh").write_text(f'python() {{ "{sys.executable}" "$@"; }}\n')
    record = "import sys, pathlib; pathlib.Path('{}').open('a').write(' '.join(sys.argv[1:]) + '\\n')"
    (tmp_path / "benchmarks" / "gpu_check.py").write_text(
        record.format(tmp_path / "calls") + f"\nsys.exit({check_status})\n"
    )
    (tmp_path / "benchmarks" / "unit_host.py").write_text(record.format(tmp_path / "calls"))
    return tmp_path / "benchmarks" / "gpu_check.sh"


@pytest.mark.parametrize("status", [0, 1, 2])
def test_gpu_check_runs_the_unit_benchmark_after_the_check(tmp_path, status):
    script = _fake_tree(tmp_path, status)
    proc = subprocess.run(["bash", str(script), "--device", "cpu", "--tiny", "--out", "OUT"], capture_output=True)
    assert proc.returncode == status, proc.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0] == "--device cpu --tiny --out OUT"
    if status == 2:  # the check could not start: nothing else runs
        assert len(calls) == 1
    else:
        assert calls[1:] == ["--count --device cpu --repeats 25 --out OUT"]


def _fake_callgrind(per_unit_layer: float, dumps_before: int = 0, regions: int | None = None):
    """A stand-in for valgrind's run: callgrind dumps whose counts make ``per_unit_layer`` instructions per
    unit-layer added, after ``dumps_before`` dumps of other regions."""
    import host_instructions

    def run(command, **kwargs):
        out = Path(next(a for a in command if a.startswith("--callgrind-out-file=")).split("=", 1)[1])
        counts = [7.0] * dumps_before  # other regions: ignored
        for units, n in host_instructions._regions()[:regions]:
            # per step: a fixed cost, a cost per layer, and per unit-layer beyond the first unit
            counts.append(host_instructions.STEPS * (1000 + 300 * n + per_unit_layer * n * (units - 1)))
        for i, c in enumerate(counts, 1):
            (out.parent / f"{out.name}.{i}").write_text(f"events: Ir\nsummary: {int(c)}\n")
        return subprocess.CompletedProcess(command, 0)

    return run


def test_host_instructions_are_per_unit_layer_added(monkeypatch):
    import host_instructions

    monkeypatch.setattr(subprocess, "run", _fake_callgrind(12_345, dumps_before=3))
    assert host_instructions.count(REPO, "cpu") == pytest.approx(12_345)


def test_host_instructions_of_a_descending_slab_are_per_descending_unit_layer(monkeypatch):
    import host_instructions

    def run(command, **kwargs):
        out = Path(next(a for a in command if a.startswith("--callgrind-out-file=")).split("=", 1)[1])
        for i, c in enumerate((7, 5000 + 16 * 300 * host_instructions.STEPS, 5000), 1):  # warm-up, told, untold
            (out.parent / f"{out.name}.{i}").write_text(f"events: Ir\nsummary: {c}\n")
        return subprocess.CompletedProcess(command, 0, stdout="descending unit-layers: 16\n")

    monkeypatch.setattr(subprocess, "run", run)
    assert host_instructions.count(REPO, "descending") == pytest.approx(300)


def test_host_instructions_refuse_missing_dumps(monkeypatch):
    import host_instructions

    monkeypatch.setattr(subprocess, "run", _fake_callgrind(1.0, regions=2))
    with pytest.raises(RuntimeError, match="_operator_call"):
        host_instructions.count(REPO, "cpu")
