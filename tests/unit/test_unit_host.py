"""The unit path's host cost benchmarks through their command lines, and the unit benchmark's place in
the GPU check (benchmarks/gpu_check.sh): what can be checked without a GPU.

* unit_host.py --count: leaf aten ops of a step, views left out, per unit and layer against a plain
  layer, with the CPU kernel and with the CUDA adapters against fakes of their aten ops: the unit
  path's own stays within a budget (a regression of the launches per unit-layer fails here).
* host_instructions.py: the instructions per unit-layer added, from callgrind's dumps (valgrind
  faked by a script on the PATH that writes dumps of known counts).
* gpu_check.sh: after the check, the benchmark on the same device into the same folder; the
  check's exit status kept; nothing more when the check cannot start.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


@pytest.mark.slow  # the count and the host timings at --repeats 1: about 25 s
def test_launches_per_unit_layer_stay_low(tmp_path):
    """At most 36 leaf ops per unit-layer beyond a plain layer's with the CPU kernel, 18 with the CUDA
    adapters' op sequences; a descending slab at most 2 kernels per unit-layer beyond an ascending one's.
    A plain layer runs dozens of kernels, and counting through views finds more (torch's CPU mm and
    indexed copies make views inside): a count that misses kernels fails here too."""
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "unit_host.py"), "--count", "--repeats", "1", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "unit_host_cpu.json").read_text())
    assert record == json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["device"] == "cpu"
    assert 0 <= record["descending_slab_launches_per_unit_layer"] <= 2, record
    ops = record["launches_per_unit_layer"]
    assert ops["plain"] >= 50, ops
    assert ops["unit"] - ops["plain"] <= 36, ops
    assert ops["CudnnSdpaKernel"] - ops["plain"] <= 18, ops
    assert ops["CudaSdpaKernel"] - ops["plain"] <= 18, ops
    through_views = record["leaf_ops_through_views"]
    assert through_views["unit"] > ops["unit"] and through_views["plain"] > ops["plain"], record
    # The unit path's own host time: K units and SDPA on the whole sequence at 2 and 4 layers, and with
    # each CUDA adapter against fakes that compute nothing.
    assert set(record["attention_host_us"]) == {"units_2", "sdpa_2", "units_4", "sdpa_4"}
    assert min(record["attention_host_us"].values()) > 0
    assert set(record["unit_path_host_us_launch_fakes"]) == {"CudnnSdpaKernel", "CudaSdpaKernel"}


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


FAKE_VALGRIND = """#!{python}
# Stands in for valgrind's callgrind run of host_instructions.py --inner KERNEL: writes its dumps, each
# counting a step's instructions as a fixed cost, a cost per layer, and per unit-layer beyond the first unit.
import os, sys
from pathlib import Path

out = next(a for a in sys.argv if a.startswith("--callgrind-out-file=")).split("=", 1)[1]
kernel = sys.argv[sys.argv.index("--inner") + 1]
steps = 2  # host_instructions.STEPS: the steps counted per dump
if kernel == "descending":
    print("descending unit-layers: 16")
    counts = [7, 5000 + 16 * 300 * steps, 5000]  # warm-up, told the passes, not told
else:
    # other regions first (ignored), then (units, layers) as host_instructions counts them: K = 8, 2 and 4 layers
    regions = [(1, 2), (1, 4), (8, 2), (8, 4)]
    counts = [7, 7, 7] + [steps * (1000 + 300 * n + 12345 * n * (units - 1)) for units, n in regions]
counts = counts[-int(os.environ.get("FAKE_DUMPS", len(counts))):]
for i, c in enumerate(counts, 1):
    Path(f"{{out}}.{{i}}").write_text(f"events: Ir\\nsummary: {{c}}\\n")
"""


def _host_instructions(tmp_path: Path, *args: str, dumps: int | None = None) -> subprocess.CompletedProcess:
    """host_instructions.py with a fake valgrind first on the PATH (``dumps``: it writes only the last ones)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    valgrind = bin_dir / "valgrind"
    valgrind.write_text(FAKE_VALGRIND.format(python=sys.executable))
    valgrind.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    if dumps is not None:
        env["FAKE_DUMPS"] = str(dumps)
    script = BENCHMARKS / "host_instructions.py"
    return subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=300)


def test_host_instructions_are_per_unit_layer_added(tmp_path):
    """The CPU kernel's count: instructions per unit-layer added; a descending slab's: per descending
    unit-layer over an ascending one's (the count of them as the inner run prints it)."""
    proc = _host_instructions(tmp_path, "--kernels", "cpu", "descending", "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "host_instructions.json").read_text())
    assert [(r["tree"], r["kernel"]) for r in record] == [(str(REPO), "cpu"), (str(REPO), "descending")]
    assert [r["instructions_per_unit_layer"] for r in record] == pytest.approx([12_345, 300])
    assert "cpu: 12K" in proc.stdout


def test_host_instructions_refuse_missing_dumps(tmp_path):
    proc = _host_instructions(tmp_path, "--kernels", "cpu", dumps=2)
    assert proc.returncode != 0
    assert "callgrind wrote 2 dumps, not 4: no _operator_call symbol?" in proc.stderr
